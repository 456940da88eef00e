"""Every command README.md and docs/*.md show is run as a user types it.

``DOCUMENTED`` lists each command as a document shows it, beside the command line this suite runs
for it: the same words, with a placeholder filled in or a size the suite can afford. A document
that shows a command the list lacks fails ``test_every_documented_command_is_listed``; the flow
below runs every listed line, in order, on one persistent instance, as a user would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from pipeline_assets.definitions import defs
from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_DPO_REPORT,
    REGISTRY_DPO_MODEL_VERSION,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
    TRAINING_DPO_CHECKPOINT,
)
from pipeline_assets.defs.snapshots import latest_per_partition, materialization_history
from pipeline_assets.lib.gold.base_model import inspect_base_model
from pipeline_assets.sample_data.corpus import MANIFEST_NAME
from pipeline_assets_tests.conftest import cli_environment, write_landing_file
from pipeline_assets_tests.hf_models import assert_servable, llama_folder

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command: `make` or `pipeline-assets` with at least a target or a subcommand after it.
COMMAND = re.compile(r"^(make|pipeline-assets) [a-z]")

# The lines the story below runs for the documents' commands, where they differ from the document:
# the demo at the story's size, placeholders filled in, sizes the suite can afford.
DEMO = "make demo SAMPLE_RECORDS=1500 SAMPLE_PAIRS=200 SAMPLE_CONVERSATIONS=150"
RUN = "pipeline-assets run"
RL = 'pipeline-assets run --select "key:rl/*"'
EVERYTHING = "pipeline-assets run --select '*'"
BRONZE_ONLY = 'pipeline-assets run --select "key:bronze/*"'
LINEAGE = "pipeline-assets lineage sft-model@champion"
EXPORT = "pipeline-assets export sft-model@champion --out {scratch}/served"
PROMOTE = 'pipeline-assets promote sft-model/1 --reason "a drill"'
ROLLBACK = 'pipeline-assets rollback sft-model --reason "the drill is over"'
SIZER_BILLION = (
    "pipeline-assets sizer --records 1000000000 --cpu-workers 256 --gpus 64 --preset base"
)
SIZER_ALL = "pipeline-assets sizer --records 1000000000 --cpu-workers 256 --gpus 64 --json"
SAMPLE = (
    "pipeline-assets sample-data --records 600 --out {scratch}/sample --preference-pairs 100 "
    "--conversations 100"
)
MARKOV = "pipeline-assets sample-data --text markov --records 4000 --out {scratch}/markov"
# As a document shows it -> the line the story runs for it.
DOCUMENTED = {
    "make demo": DEMO,
    "make lint": "make lint",
    "pipeline-assets run": RUN,
    "pipeline-assets run [--select SELECTION]": BRONZE_ONLY,
    'pipeline-assets run --select "key:rl/*"': RL,
    "pipeline-assets snapshot": "pipeline-assets snapshot",
    "pipeline-assets summary": "pipeline-assets summary",
    "pipeline-assets lineage": LINEAGE,
    "pipeline-assets lineage sft-model@champion": LINEAGE,
    "pipeline-assets lineage dpo-model@champion": "pipeline-assets lineage dpo-model@champion",
    "pipeline-assets lineage MODEL@ALIAS\\|MODEL/VERSION": "pipeline-assets lineage sft-model/1",
    "pipeline-assets export": EXPORT,
    "pipeline-assets export MODEL@ALIAS\\|MODEL/VERSION --out DIR": EXPORT,
    "pipeline-assets export sft-model@champion --out DIR": EXPORT,
    "pipeline-assets promote MODEL/VERSION [--reason]": PROMOTE,
    "pipeline-assets rollback MODEL [--reason]": ROLLBACK,
    "pipeline-assets promote dpo-model/N": "pipeline-assets promote dpo-model/1",
    "pipeline-assets backfill-decontamination": "pipeline-assets backfill-decontamination",
    # the sizer at a size and as a table, then in JSON: each line is 7 s of a process's start
    "pipeline-assets sizer": SIZER_BILLION,
    "pipeline-assets sizer --records N": SIZER_BILLION,
    "pipeline-assets sizer --records 50000 --json": SIZER_ALL,
    "pipeline-assets sizer --records 1000000000 --cpu-workers 256 --gpus 64 --preset base": (
        SIZER_BILLION
    ),
    "pipeline-assets sizer --records N [--avg-chars C] [--cpu-workers K] [--gpus G] [--json]": (
        SIZER_ALL
    ),
    "pipeline-assets sample-data --records N --out DIR [--text markov] [--file-records M] "
    "[--preference-pairs P] [--conversations C]": SAMPLE,
    "pipeline-assets sample-data --preference-pairs 2000": SAMPLE,
    "pipeline-assets sample-data --conversations 2000": SAMPLE,
    "pipeline-assets sample-data --text markov --records 4000000": MARKOV,
}
# Shown, and run elsewhere than in this flow.
RUN_ELSEWHERE = {
    "make test": "CI runs it (.ci/run); it is the suite itself",
    "make bench": "bench/ (test_bench_imports.py imports every module); 35 minutes on 2 cores",
    "make dev": "test_ui_browser.py: it serves until stopped, for the browser and GraphQL tests",
    "pipeline-assets export sft-model@champion --out served "
    '--generate "How do I reset my password?"': (
        "test_base_model.py, after a run with PIPELINE_BASE_MODEL (the demo's make demo line "
        "exports and generates from the built-in champion)"
    ),
}


def documented_commands() -> dict[str, str]:
    """Every command the documents show (code spans and code blocks), with the first document."""
    found: dict[str, str] = {}
    for document in DOCUMENTS:
        text = document.read_text()
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
        lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        spans = [span.strip() for span in re.findall(r"`([^`\n]+)`", prose)]
        for command in lines + spans:
            if COMMAND.match(command):
                found.setdefault(command, document.name)
    return found


def test_every_documented_command_is_listed():
    shown = documented_commands()
    listed = set(DOCUMENTED) | set(RUN_ELSEWHERE)
    assert {c: d for c, d in shown.items() if c not in listed} == {}
    assert sorted(listed - set(shown)) == [], "listed, but no document shows it any more"


def _argv(line: str, scratch: Path) -> list[str]:
    words = shlex.split(line.format(scratch=scratch))
    if words[0] == "pipeline-assets":
        return [sys.executable, "-m", "pipeline_assets.cli.main", *words[1:]]
    return words


class Commands:
    """Runs command lines as a user types them, on one PIPELINE_HOME, and keeps which it ran."""

    def __init__(self, home: Path):
        self.home, self.ran, self.seconds = home, set(), []

    def __call__(self, line: str, expect: int = 0, **env: str) -> subprocess.CompletedProcess:
        started = time.monotonic()
        done = subprocess.run(
            _argv(line, self.home / "scratch"),
            cwd=ROOT,
            env=cli_environment(self.home, **env),
            capture_output=True,
            text=True,
            timeout=900,
        )
        self.seconds.append((time.monotonic() - started, line))
        print(f"{self.seconds[-1][0]:6.1f} s  {line}")  # where the story's time goes (pytest -s)
        assert done.returncode == expect, (line, done.stdout[-2000:], done.stderr[-4000:])
        for noise in ("Traceback", "PreviewWarning", "BetaWarning"):
            assert noise not in done.stdout + done.stderr, (line, noise, done.stderr[-4000:])
        self.ran.add(line)
        return done


PREFS = {"PIPELINE_SOURCE_FORMATS": '{"prefs": "preference", "chats": "conversation"}'}
MEASURED_STAGES = ["bronze", "silver", "gold/tokenizer", "gold/sequences", "training", "evaluation"]


def test_the_documented_commands_tell_one_story(tmp_path):
    """A user's story on one persistent instance, every line as a document shows it: the demo, a
    run with nothing new, schema drift blocked and fixed with a mapping, a snapshot by hand and its
    training, the registry's and the reports' commands, the RL overlay, every asset (the search
    too), and the sample's other forms."""
    run = Commands(tmp_path)
    first = run(DEMO)  # sample-data, run, summary, lineage and export, through the Makefile
    assert "new ingest batches: 2" in first.stdout  # the key starts with the year
    # the demo ends with its champion's answer (make's own lines may follow it)
    served = json.loads(next(x for x in reversed(first.stdout.splitlines()) if x.startswith("{")))
    assert served["model"] == "sft-model" and isinstance(served["generation"], str)
    assert_servable(tmp_path / "export" / "champion")
    manifest = json.loads((tmp_path / "landing" / MANIFEST_NAME).read_text())

    nothing = run(RUN, **PREFS)
    assert "new ingest batches: none" in nothing.stdout and "runs: 0" in nothing.stdout

    renamed = [
        {
            "prompt": f"Question {i} about topic {i * 7}?",
            "completion": f"The answer to {i} is {i * 7}, for these reasons.",
        }
        for i in range(10)
    ]
    write_landing_file(tmp_path / "landing", "annotate", "b.jsonl", renamed)
    drift = run(RUN, expect=1, **PREFS)
    assert "bronze/records:quarantine_rate failed" in drift.stderr
    assert '{"annotate": {"completion": "response"}}' in drift.stderr

    mapping = {"PIPELINE_FIELD_MAPPINGS": '{"annotate": {"completion": "response"}}', **PREFS}
    fixed = run(RUN, **mapping)
    assert "runs: 2" in fixed.stdout, (
        "the blocked batch is retried (the good one is not), its gold shard in the same run"
    )
    assert "no new data snapshot: gold shards built since gold-v0: 1 batch(es)" in fixed.stderr, (
        "10 records: under 10%"
    )
    cut = run("pipeline-assets snapshot", **mapping)
    assert "runs: 1" in cut.stdout
    run(RUN, **mapping)  # trains gold-v1

    _the_story_so_far(tmp_path, run, manifest)
    _the_dpo_report_and_its_registration(tmp_path)
    _the_registry_and_the_reports(tmp_path, run)
    _the_overlay_and_every_asset(tmp_path, run, mapping)
    run(SAMPLE)
    run(MARKOV)
    run("make lint")
    assert set(DOCUMENTED.values()) <= run.ran


def _the_story_so_far(home: Path, run: Commands, manifest: dict) -> None:
    instance = DagsterInstance.from_config(str(home / "dagster"))
    assert len(instance.get_materialized_partitions(BRONZE_RECORDS)) == 2
    bronze_rows = manifest["expected"]["bronze_rows"] + 10
    records = pl.read_delta(str(home / "lake" / "bronze" / "records"))
    assert records.height == bronze_rows

    summary = json.loads(run("pipeline-assets summary").stdout)
    assert summary["tables"]["bronze/records"]["rows"] == bronze_rows
    pairs = manifest["preference"]["expected"]
    assert summary["tables"]["bronze/preference_records"]["rows"] == pairs["bronze_rows"]
    assert summary["rejected_by_stage"]["pair_cap"] == pairs["pairs_over_prompt_cap"]
    assert summary["tables"]["gold/preference_sequences"]["rows"] > 0
    assert summary["tables"]["gold/preference_snapshots"]["rows"] == 1, (
        "the pairs' first snapshot, dpo-v0"
    )
    reference = pl.read_delta(str(home / "lake" / "gold" / "reference_logps"))
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
    chats = manifest["conversation"]["expected"]
    assert summary["tables"]["bronze/conversations"]["rows"] == chats["bronze_rows"]
    assert (
        sum(summary["quarantined_by_reason"].values())
        == manifest["expected"]["quarantined"] + pairs["quarantined"] + chats["quarantined"]
    )
    silver = sum(
        summary["tables"][f"silver/{table}"]["rows"]
        for table in ("records", "preference_pairs", "conversations")
    )
    rejected = sum(summary["rejected_by_stage"].values())
    assert silver + rejected == bronze_rows + pairs["bronze_rows"] + chats["bronze_rows"], (
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
    assert set(pipeline["stages"]) == set(MEASURED_STAGES)
    slowest = max(pipeline["stages"], key=lambda stage: pipeline["stages"][stage]["wall_seconds"])
    assert pipeline["bottleneck"] == slowest and pipeline["usd_per_million_tokens"] > 0
    lineage = json.loads(run(LINEAGE).stdout)
    assert len(lineage["silver"]["batches"]) == 2 and lineage["gold"]["tokenizer_version"] == 0, (
        "the tokenizer is made once"
    )
    assert lineage["model"]["version"] == "2", "the snapshot cut by hand was trained"
    assert lineage["other_formats"]["conversation"]["silver"]["table"] == "silver/conversations"
    assert "chats" in {f["source"] for f in lineage["landing_files"]}, (
        "the demo's conversations trained the champion"
    )
    assert json.loads(run(EXPORT).stdout)["version"] == "2"
    assert_servable(run.home / "scratch" / "served")
    _sizer_calibrated_on_the_story(run, instance)


def _sizer_calibrated_on_the_story(run: Commands, instance: DagsterInstance) -> None:
    prediction = json.loads(run(SIZER_ALL).stdout)
    stages = {row["stage"]: row for row in prediction["stages"]}
    assert list(stages) == MEASURED_STAGES
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
    lookup = totals["fits"]["silver/index lookup"]
    measured = json.loads((run.home / "reports" / "lookup-rate.json").read_text())
    assert len(measured["points"]) == 2 and lookup["points"] >= 3, (
        "the second batch's lookup and the two measured on synthetic indexes, fitted together"
    )
    rows, seconds = measured["points"][-1]
    assert rows == 400_000 and lookup["fixed_seconds"] + lookup["seconds_per_unit"] * rows == (
        pytest.approx(seconds, rel=0.3)
    ), "the rate shown by the largest index searched"
    decision = totals["fits"]["silver/decision"]
    measured = json.loads((run.home / "reports" / "decision-rate.json").read_text())
    assert [rows for rows, _ in measured["points"]] == [100_000, 400_000]
    assert decision["points"] >= 4, "the story's batches and the two synthetic ones, together"
    assert "0.000 exact" not in measured["measured_on"], "with the exact copies the story removed"
    silver = latest_per_partition(materialization_history(instance, SILVER_RECORDS))
    chars = 400_000 * sum(b["input_chars"] for b in silver) / sum(b["bronze_rows"] for b in silver)
    # The decision takes tens of milliseconds at 400,000 records since near dedup's pairs are built
    # by tasks: the fit's fixed part, from the story's batches timed under the suite's load, can
    # move it by more than 30%. 50 ms a batch is under a minute over the billion's 1,000 batches.
    assert decision["fixed_seconds"] + decision["seconds_per_unit"] * chars == pytest.approx(
        measured["points"][-1][1], rel=0.3, abs=0.05
    ), "the rate a record shown by the largest batch decided"
    assert Path(totals["picture"]).read_bytes().startswith(b"\x89PNG")
    table = run(SIZER_BILLION).stdout
    assert "bottleneck:" in table and "evaluation" in table and "silver" in table
    llama = llama_folder(run.home / "scratch" / "llama")
    with_base = json.loads(run(SIZER_ALL, PIPELINE_BASE_MODEL=str(llama)).stdout)["totals"]
    assert with_base["parameters"] == inspect_base_model(llama).parameters != totals["parameters"]
    assert (
        with_base["model"].startswith(f"base model {llama}")
        and "LlamaForCausalLM" in (with_base["gpu_speed_assumed"])
    )


def _the_dpo_report_and_its_registration(home: Path) -> None:
    """The demo's DPO path, to its end: the DPO candidate judged on dpo-v0's held-out pairs with no
    DPO champion yet, its sft validation loss against sft-model/1, and dpo-model/1 registered."""
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

    assert instance.get_materialized_partitions(REGISTRY_DPO_MODEL_VERSION) == {"dpo-v0"}
    registered = instance.get_latest_materialization_event(
        REGISTRY_DPO_MODEL_VERSION
    ).asset_materialization.metadata
    assert registered["model_version"].value == "1" and registered["promoted"].value is True
    assert (
        "first DPO model" in registered["gate"].value
        and registered["reference_model"].value == "sft-model/1"
    )


def _the_dpo_lineage_reaches_both_sources(home: Path, lineage: dict) -> None:
    """`lineage dpo-model@champion` walks back to the pairs' landing files, and through the sft
    model DPO started from to the sft sources'."""
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


def _the_registry_and_the_reports(home: Path, run: Commands) -> None:
    dpo = json.loads(run("pipeline-assets lineage dpo-model@champion").stdout)
    _the_dpo_lineage_reaches_both_sources(home, dpo)
    assert json.loads(run("pipeline-assets lineage sft-model/1").stdout)["model"]["version"] == "1"
    assert json.loads(run(PROMOTE).stdout)["champion"] == "1"
    assert json.loads(run(ROLLBACK).stdout)["champion"] == "2", "the champion before the drill"
    assert json.loads(run("pipeline-assets promote dpo-model/1").stdout)["champion"] == "1"
    backfill = run("pipeline-assets backfill-decontamination")
    assert "runs:" in backfill.stdout


def _the_overlay_and_every_asset(home: Path, run: Commands, mapping: dict) -> None:
    """Every asset left (the search, the RL overlay); then the overlay's command as docs/rl.md
    gives it, with nothing of it stale (its rollouts landed, not yet ingested): a run of nothing.
    Its run from a fresh instance is test_first_user.py's."""
    # One trial a search: `--select '*'` searches every snapshot left unsearched (gold-v0 and
    # gold-v1), each trial a torchrun launch; the search's rungs: trainer/test_hparam_search.py.
    everything = run(EVERYTHING, **mapping, PIPELINE_SEARCH_TRIALS="1")
    assert "materializing rl/policy, rl/replay_buffer" in everything.stderr
    assert "training/hparam_search" in everything.stderr
    instance = DagsterInstance.from_config(str(home / "dagster"))
    never = [
        key.to_user_string()
        for key in defs.resolve_asset_graph().materializable_asset_keys
        if instance.get_latest_materialization_event(key) is None
    ]
    assert never == []
    assert "runs: 0" in run(RL, **mapping).stdout
    run(BRONZE_ONLY, **mapping)  # the rollouts' batch, through bronze
