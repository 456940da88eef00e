"""evaluation/dpo_report end to end: the headless command on a small corpus with a preference source trains
sft-model/1, DPO on dpo-v0, and judges the DPO candidate on dpo-v0's held-out pairs (no DPO champion yet)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from pipeline_assets.defs.keys import EVALUATION_DPO_REPORT
from pipeline_assets.lib.sample_corpus import write_sample_corpus
from pipeline_assets.lib.sample_preferences import add_preference_source
from pipeline_assets_tests.conftest import cli_environment

SETTINGS = {"PIPELINE_SOURCE_FORMATS": '{"prefs": "preference"}', "PIPELINE_PREFERENCE_VALIDATION_FRACTION": "0.3"}


def test_run_reports_the_dpo_candidate_on_held_out_pairs_and_its_sft_loss(tmp_path):
    landing, eval_sets = tmp_path / "landing", tmp_path / "reference" / "eval_sets"
    write_sample_corpus(landing, records=600, eval_sets_dir=eval_sets)
    add_preference_source(landing, 100, eval_sets_dir=eval_sets)
    done = subprocess.run([sys.executable, "-m", "pipeline_assets.cli", "run"],
                          env=cli_environment(tmp_path, **SETTINGS), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]

    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    assert instance.get_materialized_partitions(EVALUATION_DPO_REPORT) == {"dpo-v0"}, "pipeline-assets run judges it"
    metadata = {k: v.value for k, v in
                instance.get_latest_materialization_event(EVALUATION_DPO_REPORT).asset_materialization.metadata.items()}
    report = pl.read_delta(str(tmp_path / "lake" / "evaluation" / "dpo_report")).filter(pl.col("partition") == "dpo-v0")

    candidate = {row["slice"]: row for row in report.filter(pl.col("model") == "candidate").iter_rows(named=True)}
    assert {"overall", "source:prefs", "sft_validation_loss"} <= set(candidate)
    assert all(name.startswith("source:") for name in set(candidate) - {"overall", "sft_validation_loss"})
    overall = candidate["overall"]
    assert 0 <= overall["preference_accuracy"] <= 1 and overall["pairs"] == metadata["validation_pairs"] > 0
    assert metadata["candidate_preference_accuracy"] == pytest.approx(overall["preference_accuracy"])
    assert metadata["champion_preference_accuracy"] is None and metadata["champion_version"] is None
    assert "no champion of dpo-model yet" in metadata["champion"]

    margins = pl.read_parquet(metadata["pair_margins"]).filter(pl.col("model") == "candidate")
    assert margins.height == overall["pairs"] and margins["pair_id"].n_unique() == margins.height
    assert overall["preference_accuracy"] == pytest.approx(float((margins["margin"] > 0).mean()))
    assert overall["mean_margin"] == pytest.approx(float(margins["margin"].mean()))
    by_source = margins.group_by("source").agg(pairs=pl.len(), accuracy=(pl.col("margin") > 0).mean())
    for source, pairs, accuracy in by_source.iter_rows():
        assert candidate[f"source:{source}"]["pairs"] == pairs
        assert candidate[f"source:{source}"]["preference_accuracy"] == pytest.approx(accuracy)

    sft = report.filter(pl.col("slice") == "sft_validation_loss").sort("model")
    assert sft["model"].to_list() == ["candidate", "champion"]
    assert sft["model_version"].to_list() == [None, "sft-model/1"], "the sft champion trained in the same run"
    assert (sft["loss"] > 0).all() and report.filter(pl.col("model") == "champion").height == 1, "no DPO champion rows"
    assert metadata["sft_candidate_loss"] == pytest.approx(sft["loss"][0])
    assert metadata["sft_champion_loss"] == pytest.approx(sft["loss"][1])
    relative = (sft["loss"][0] - sft["loss"][1]) / sft["loss"][1]
    assert metadata["sft_within_tolerance"] == (relative <= 1.0), "cli_environment sets the slice tolerance to 1"
    assert metadata["sft_validation"]["champion_version"] == "sft-model/1"
    assert Path(metadata["picture"]).read_bytes().startswith(b"\x89PNG")
    assert metadata["delta_version"] >= 0 and metadata["dagster/row_count"] == report.height


def test_the_report_holds_both_models_side_by_side_when_a_dpo_champion_exists():
    from pipeline_assets.contracts import DpoEvaluationSlice, conform, validate
    from pipeline_assets.defs.evaluation.dpo import _comparison, _report_frame
    from pipeline_assets.lib.preference_eval import preference_slices

    sources = pl.DataFrame({"pair_id": ["a", "b", "c"], "source": ["x", "x", "y"]})
    margins = {"candidate": [1.0, -1.0, 2.0], "champion": [-1.0, -1.0, 2.0]}
    slices = {role: preference_slices(pl.DataFrame({"pair_id": ["a", "b", "c"], "margin": values}), sources)
              for role, values in margins.items()}
    sft = {"candidate_loss": 2.1, "champion_loss": 2.0, "champion_version": "sft-model/3"}
    report = _report_frame("dpo-v2", slices, {"candidate": None, "champion": "dpo-model/1"}, sft)
    report = validate(conform(report, DpoEvaluationSlice), DpoEvaluationSlice)
    assert report.height == 8 and set(report["model_version"].drop_nulls()) == {"dpo-model/1", "sft-model/3"}
    wide = {row["slice"]: row for row in _comparison(report).iter_rows(named=True)}
    assert list(wide) == ["overall", "source:x", "source:y", "sft_validation_loss"]
    assert (wide["overall"]["candidate"], wide["overall"]["champion"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert (wide["sft_validation_loss"]["candidate"], wide["sft_validation_loss"]["champion"]) == (2.1, 2.0)
