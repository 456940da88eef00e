"""The headless command against a persistent instance, as a user runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from pipeline_assets.defs.keys import BRONZE_RECORDS, TRAINING_CHECKPOINT, TRAINING_DPO_CHECKPOINT
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets.sample_data.preferences import add_preference_source
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.conftest import run_cli as _cli

PREFS = {"PIPELINE_SOURCE_FORMATS": '{"prefs": "preference"}'}


def test_run_ingests_new_files_blocks_on_drift_and_recovers_with_a_mapping(tmp_path):
    landing = tmp_path / "landing"
    write_sample_corpus(landing, records=1500, eval_sets_dir=tmp_path / "reference" / "eval_sets")
    manifest = add_preference_source(
        landing, 200, eval_sets_dir=tmp_path / "reference" / "eval_sets"
    )
    first = _cli(tmp_path, "run", **PREFS)
    assert first.returncode == 0, first.stderr
    assert "new ingest batches: 2" in first.stdout  # the key starts with the year

    nothing = _cli(tmp_path, "run", **PREFS)
    assert (
        nothing.returncode == 0
        and "new ingest batches: none" in nothing.stdout
        and "runs: 0" in nothing.stdout
    )

    renamed = [
        {
            "prompt": f"Question {i} about topic {i * 7}?",
            "completion": f"The answer to {i} is {i * 7}, for these reasons.",
        }
        for i in range(10)
    ]
    write_landing_file(landing, "annotate", "b.jsonl", renamed)
    drift = _cli(tmp_path, "run", **PREFS)
    assert drift.returncode == 1
    assert "bronze/records:quarantine_rate failed" in drift.stderr
    assert '{"annotate": {"completion": "response"}}' in drift.stderr

    mapping = {"PIPELINE_FIELD_MAPPINGS": '{"annotate": {"completion": "response"}}', **PREFS}
    fixed = _cli(tmp_path, "run", **mapping)
    assert fixed.returncode == 0, fixed.stderr
    assert "runs: 2" in fixed.stdout, (
        "the blocked batch is retried (the good one is not), its gold shard in the same run"
    )
    assert "no new data snapshot: gold shards built since gold-v0: 1 batch(es)" in fixed.stderr, (
        "10 records: under 10%"
    )
    cut = _cli(tmp_path, "snapshot", **mapping)
    assert cut.returncode == 0 and "runs: 1" in cut.stdout, cut.stderr
    trained = _cli(tmp_path, "run", **mapping)
    assert trained.returncode == 0, trained.stderr

    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    assert len(instance.get_materialized_partitions(BRONZE_RECORDS)) == 2
    bronze_rows = manifest["expected"]["bronze_rows"] + 10
    records = pl.read_delta(str(tmp_path / "lake" / "bronze" / "records"))
    assert records.height == bronze_rows

    summary = json.loads(_cli(tmp_path, "summary").stdout)
    assert summary["tables"]["bronze/records"]["rows"] == bronze_rows
    pairs = manifest["preference"]["expected"]
    assert summary["tables"]["bronze/preference_records"]["rows"] == pairs["bronze_rows"]
    assert summary["rejected_by_stage"]["pair_cap"] == pairs["pairs_over_prompt_cap"]
    assert summary["tables"]["gold/preference_sequences"]["rows"] > 0
    assert summary["tables"]["gold/preference_snapshots"]["rows"] == 1, (
        "the pairs' first snapshot, dpo-v0"
    )
    reference = pl.read_delta(str(tmp_path / "lake" / "gold" / "reference_logps"))
    assert reference.height == summary["tables"]["gold/preference_sequences"]["rows"], (
        "dpo-v0 holds every shard of pairs"
    )
    assert set(reference["reference_model"]) == {"sft-model/1"}, (
        "the first sft champion, trained in the same run"
    )
    assert (reference["reference_logps"].list.len() % 2 == 0).all() and reference[
        "reference_logps"
    ].list.max().max() < 0
    assert instance.get_materialized_partitions(TRAINING_DPO_CHECKPOINT) == {"dpo-v0"}, (
        "DPO from sft-model/1"
    )
    dpo = instance.get_latest_materialization_event(
        TRAINING_DPO_CHECKPOINT
    ).asset_materialization.metadata
    assert dpo["reference_model"].value == "sft-model/1" and dpo["objective"].value == "dpo"
    assert dpo["final_loss"].value < 0.6931, (
        "below log 2, where DPO starts (its policy is its reference)"
    )
    assert dpo["eval/preference_accuracy"].value >= 0.75, (
        "held-out pairs, from 0 (every margin 0) at step 0"
    )
    assert (
        summary["dpo"]["partition"] == "dpo-v0"
        and summary["dpo"]["reference_model"] == "sft-model/1"
    )
    assert summary["dpo"]["champion"]["version"] == "1", (
        "registry/dpo_model_version: the first dpo-model beat chance"
    )
    assert (
        sum(summary["quarantined_by_reason"].values())
        == manifest["expected"]["quarantined"] + pairs["quarantined"]
    )
    silver = (
        summary["tables"]["silver/records"]["rows"]
        + summary["tables"]["silver/preference_pairs"]["rows"]
    )
    rejected = sum(summary["rejected_by_stage"].values())
    assert silver + rejected == bronze_rows + pairs["bronze_rows"], (
        "run also materializes silver for each batch"
    )
    assert summary["data_snapshot"]["partition"] == "gold-v1", (
        "a gold snapshot over all batches, rebuilt after the fix"
    )
    assert instance.get_materialized_partitions(TRAINING_CHECKPOINT) == {"gold-v0", "gold-v1"}, (
        "each snapshot is trained"
    )
    assert (
        summary["model"]["champion_version"] == "2" and summary["model"]["partition"] == "gold-v1"
    )
    pipeline = summary["pipeline"]
    assert set(pipeline["stages"]) == {
        "bronze",
        "silver",
        "gold/tokenizer",
        "gold/sequences",
        "training",
        "evaluation",
    }
    slowest = max(pipeline["stages"], key=lambda stage: pipeline["stages"][stage]["wall_seconds"])
    assert pipeline["bottleneck"] == slowest and pipeline["usd_per_million_tokens"] > 0
    lineage = json.loads(_cli(tmp_path, "lineage", "sft-model@champion").stdout)
    assert len(lineage["silver"]["batches"]) == 2 and lineage["gold"]["tokenizer_version"] == 0, (
        "the tokenizer is made once"
    )

    sized = _cli(
        tmp_path,
        "sizer",
        "--records",
        "1000000000",
        "--cpu-workers",
        "256",
        "--gpus",
        "64",
        "--json",
    )
    assert sized.returncode == 0, sized.stderr
    prediction = json.loads(sized.stdout)
    stages = {row["stage"]: row for row in prediction["stages"]}
    assert list(stages) == [
        "bronze",
        "silver",
        "gold/tokenizer",
        "gold/sequences",
        "training",
        "evaluation",
    ]
    totals = prediction["totals"]
    assert totals["batches"] == 1000 and totals["bottleneck"] == max(
        stages, key=lambda s: stages[s]["wall_seconds"]
    )
    assert totals["wall_seconds"] == pytest.approx(
        sum(row["wall_seconds"] for row in stages.values())
    )
    cores = len(os.sched_getaffinity(0))  # what the calibration's processes ran on
    assert (
        stages["bronze"]["runs_on"] == f"{256 // cores} x {cores} cores"
        and stages["silver"]["runs_on"] == f"{cores} + 256 on Ray"
    )
    assert (
        stages["training"]["runs_on"] == "64 GPUs" and "not measured" in totals["gpu_speed_assumed"]
    )
    # Two batches of different sizes: two points (how the fit reads them depends on this
    # machine's timing).
    assert totals["fits"]["bronze"]["points"] == 2 and not totals["fits"]["bronze"][
        "note"
    ].startswith("one size")
    assert totals["fits"]["training"]["note"].startswith("one size"), (
        "both snapshots trained the same 6 steps"
    )
    assert totals["fits"]["silver/index lookup"]["points"] >= 1, (
        "the second batch's lookup, fitted on its tasks' seconds"
    )
    assert Path(totals["picture"]).read_bytes().startswith(b"\x89PNG")
    table = _cli(tmp_path, "sizer", "--records", "50000", "--first-model")
    assert (
        table.returncode == 0 and "bottleneck:" in table.stdout and "evaluation" in table.stdout
    ), table.stderr


def test_run_with_a_selection_and_a_bad_setting(tmp_path):
    write_landing_file(tmp_path / "landing", "annotate", "a.jsonl", [record(1)])
    selected = _cli(tmp_path, "run", "--select", "key:bronze/quarantine")
    assert selected.returncode == 0, selected.stderr
    assert "runs: 1" in selected.stdout  # the multi-asset runs whole
    unmeasured = _cli(tmp_path, "sizer", "--records", "1000")
    assert (
        unmeasured.returncode == 2
        and "no measured run of silver" in unmeasured.stderr
        and "Traceback" not in unmeasured.stderr
    )
    bad = _cli(tmp_path, "run", PIPELINE_FIELD_MAPPINGS="{not json")
    assert bad.returncode == 2 and "PIPELINE_FIELD_MAPPINGS is not valid JSON" in bad.stderr
    unknown_format = _cli(tmp_path, "run", PIPELINE_SOURCE_FORMATS='{"prefs": "dpo"}')
    assert (
        unknown_format.returncode == 2
        and "PIPELINE_SOURCE_FORMATS names unknown record format(s) dpo" in unknown_format.stderr
    )
    assert "Traceback" not in bad.stderr
    (tmp_path / "kuberay.yaml").write_text("imagee: registry.example.com/pipeline-assets:1.4\n")
    misspelt = _cli(tmp_path, "run", PIPELINE_KUBERAY=str(tmp_path / "kuberay.yaml"))
    assert (
        misspelt.returncode == 2
        and "unknown field(s) imagee" in misspelt.stderr
        and "Traceback" not in misspelt.stderr
    )


def test_sample_data_command_is_deterministic(tmp_path):
    """The command in a fresh process writes the same bytes as this process does (no hash seed,
    no clock)."""
    done = _cli(
        tmp_path,
        "sample-data",
        "--records",
        "400",
        "--out",
        str(tmp_path / "command"),
        "--eval-sets-out",
        str(tmp_path / "command-eval"),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lines"] == 400
    write_sample_corpus(tmp_path / "here", records=400, eval_sets_dir=tmp_path / "here-eval")
    outputs = [
        {
            p.relative_to(tmp_path / name): p.read_bytes()
            for p in (tmp_path / name).rglob("*")
            if p.is_file()
        }
        for name in ("command", "here")
    ]
    assert outputs[0] == outputs[1]
    suffixes = {"".join(path.suffixes) for path in outputs[0]}
    assert {".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"} <= suffixes
