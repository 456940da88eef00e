"""The DPO path's end, end to end: the headless command on a small corpus with a preference source
trains sft-model/1, DPO on dpo-v0, judges the DPO candidate on dpo-v0's held-out pairs (no DPO
champion yet), registers it as dpo-model/1, and `pipeline-assets lineage dpo-model@champion` walks
back to both sources' landing files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from pipeline_assets.defs.keys import EVALUATION_DPO_REPORT, REGISTRY_DPO_MODEL_VERSION
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets.sample_data.preferences import add_preference_source
from pipeline_assets_tests.conftest import cli_environment

SETTINGS = {
    "PIPELINE_SOURCE_FORMATS": '{"prefs": "preference"}',
    "PIPELINE_PREFERENCE_VALIDATION_FRACTION": "0.3",
}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """PIPELINE_HOME after one `pipeline-assets run` over 600 sft records and 100
    preference pairs."""
    home = tmp_path_factory.mktemp("home")
    landing, eval_sets = home / "landing", home / "reference" / "eval_sets"
    write_sample_corpus(landing, records=600, eval_sets_dir=eval_sets)
    add_preference_source(landing, 100, eval_sets_dir=eval_sets)
    done = _cli(home, "run")
    assert done.returncode == 0, done.stderr[-5000:]
    return home


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli.main", *args],
        env=cli_environment(home, **SETTINGS),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_reports_the_dpo_candidate_on_held_out_pairs_and_its_sft_loss(home):
    instance = DagsterInstance.from_config(str(home / "dagster"))
    assert instance.get_materialized_partitions(EVALUATION_DPO_REPORT) == {"dpo-v0"}, (
        "pipeline-assets run judges it"
    )
    metadata = {
        k: v.value
        for k, v in instance.get_latest_materialization_event(
            EVALUATION_DPO_REPORT
        ).asset_materialization.metadata.items()
    }
    report = pl.read_delta(str(home / "lake" / "evaluation" / "dpo_report")).filter(
        pl.col("partition") == "dpo-v0"
    )

    candidate = {
        row["slice"]: row
        for row in report.filter(pl.col("model") == "candidate").iter_rows(named=True)
    }
    assert {"overall", "source:prefs", "sft_validation_loss"} <= set(candidate)
    assert all(
        name.startswith("source:") for name in set(candidate) - {"overall", "sft_validation_loss"}
    )
    overall = candidate["overall"]
    assert (
        0 <= overall["preference_accuracy"] <= 1
        and overall["pairs"] == metadata["validation_pairs"] > 0
    )
    assert metadata["candidate_preference_accuracy"] == pytest.approx(
        overall["preference_accuracy"]
    )
    assert metadata["champion_preference_accuracy"] is None and metadata["champion_version"] is None
    assert "no champion of dpo-model yet" in metadata["champion"]

    margins = pl.read_parquet(metadata["pair_margins"]).filter(pl.col("model") == "candidate")
    assert margins.height == overall["pairs"] and margins["pair_id"].n_unique() == margins.height
    assert overall["preference_accuracy"] == pytest.approx(float((margins["margin"] > 0).mean()))
    assert overall["mean_margin"] == pytest.approx(float(margins["margin"].mean()))
    by_source = margins.group_by("source").agg(
        pairs=pl.len(), accuracy=(pl.col("margin") > 0).mean()
    )
    for source, pairs, accuracy in by_source.iter_rows():
        assert candidate[f"source:{source}"]["pairs"] == pairs
        assert candidate[f"source:{source}"]["preference_accuracy"] == pytest.approx(accuracy)

    sft = report.filter(pl.col("slice") == "sft_validation_loss").sort("model")
    assert sft["model"].to_list() == ["candidate", "champion"]
    assert sft["model_version"].to_list() == [None, "sft-model/1"], (
        "the sft champion trained in the same run"
    )
    assert (sft["loss"] > 0).all() and report.filter(pl.col("model") == "champion").height == 1, (
        "no DPO champion rows"
    )
    assert metadata["sft_candidate_loss"] == pytest.approx(sft["loss"][0])
    assert metadata["sft_champion_loss"] == pytest.approx(sft["loss"][1])
    relative = (sft["loss"][0] - sft["loss"][1]) / sft["loss"][1]
    assert metadata["sft_within_tolerance"] == (relative <= 1.0), (
        "cli_environment sets the slice tolerance to 1"
    )
    assert metadata["sft_validation"]["champion_version"] == "sft-model/1"
    assert Path(metadata["picture"]).read_bytes().startswith(b"\x89PNG")
    assert metadata["delta_version"] >= 0 and metadata["dagster/row_count"] == report.height


def test_run_registers_dpo_model_and_its_lineage_reaches_both_sources(home):
    instance = DagsterInstance.from_config(str(home / "dagster"))
    assert instance.get_materialized_partitions(REGISTRY_DPO_MODEL_VERSION) == {"dpo-v0"}
    registered = instance.get_latest_materialization_event(
        REGISTRY_DPO_MODEL_VERSION
    ).asset_materialization.metadata
    assert registered["model_version"].value == "1" and registered["promoted"].value is True
    assert (
        "first DPO model" in registered["gate"].value
        and registered["reference_model"].value == "sft-model/1"
    )

    done = _cli(home, "lineage", "dpo-model@champion")
    assert done.returncode == 0, done.stderr
    lineage = json.loads(done.stdout)
    assert lineage["model"] == {**lineage["model"], "name": "dpo-model", "version": "1"}
    assert (
        "champion" in lineage["model"]["aliases"] and lineage["checkpoint"]["partition"] == "dpo-v0"
    )
    assert (
        lineage["silver"]["table"] == "silver/preference_pairs"
        and lineage["silver"]["version"] is not None
    )
    assert lineage["gold"]["reference_logps_version"] is not None
    assert {f["source"] for f in lineage["landing_files"]} == {"prefs"}, (
        "only the preference source fed DPO"
    )
    landed = sorted(
        path.relative_to(home / "landing").as_posix()
        for path in (home / "landing" / "prefs").rglob("*.*")
    )
    assert sorted(f["uri"].split("landing/", 1)[1] for f in lineage["landing_files"]) == landed
    started_from = lineage["started_from"]
    assert (started_from["model"]["name"], started_from["model"]["version"]) == ("sft-model", "1")
    assert started_from["silver"]["table"] == "silver/records"
    assert (
        "prefs" not in {f["source"] for f in started_from["landing_files"]}
        and started_from["landing_files"]
    )


def test_the_report_holds_both_models_side_by_side_when_a_dpo_champion_exists():
    from pipeline_assets.contracts import DpoEvaluationSlice, conform, validate
    from pipeline_assets.defs.evaluation.dpo import _comparison, _report_frame
    from pipeline_assets.lib.training.preference_eval import preference_slices

    sources = pl.DataFrame({"pair_id": ["a", "b", "c"], "source": ["x", "x", "y"]})
    margins = {"candidate": [1.0, -1.0, 2.0], "champion": [-1.0, -1.0, 2.0]}
    slices = {
        role: preference_slices(
            pl.DataFrame({"pair_id": ["a", "b", "c"], "margin": values}), sources
        )
        for role, values in margins.items()
    }
    sft = {"candidate_loss": 2.1, "champion_loss": 2.0, "champion_version": "sft-model/3"}
    report = _report_frame("dpo-v2", slices, {"candidate": None, "champion": "dpo-model/1"}, sft)
    report = validate(conform(report, DpoEvaluationSlice), DpoEvaluationSlice)
    assert report.height == 8 and set(report["model_version"].drop_nulls()) == {
        "dpo-model/1",
        "sft-model/3",
    }
    wide = {row["slice"]: row for row in _comparison(report).iter_rows(named=True)}
    assert list(wide) == ["overall", "source:x", "source:y", "sft_validation_loss"]
    assert (wide["overall"]["candidate"], wide["overall"]["champion"]) == (
        pytest.approx(2 / 3),
        pytest.approx(1 / 3),
    )
    assert (wide["sft_validation_loss"]["candidate"], wide["sft_validation_loss"]["champion"]) == (
        2.1,
        2.0,
    )
