"""The paths a first user takes with their own data, through `pipeline-assets run` with the default
settings (the suite's short training aside): no eval sets, and degenerate first landings. Each ends
in a clean run or a named refusal, never an internal error."""

from __future__ import annotations

import json
import random
from pathlib import Path

import polars as pl
from dagster import DagsterInstance

from pipeline_assets.defs.keys import EVALUATION_REPORT, GOLD_SEQUENCES, SILVER_RECORDS
from pipeline_assets_tests.conftest import run_cli, write_landing_file
from pipeline_assets_tests.user_data import (
    land_support_chats,
    land_support_export,
    support_answers,
    support_preference_pairs,
)

PREFS = {"PIPELINE_SOURCE_FORMATS": '{"prefs": "preference"}'}
CHATS = {"PIPELINE_SOURCE_FORMATS": '{"chats": "conversation"}'}
NOISE = ("PreviewWarning", "BetaWarning", "Traceback")


def _latest(home: Path, key, name: str):
    instance = DagsterInstance.from_config(str(home / "dagster"))
    record = instance.fetch_materializations(key, limit=1).records[0]
    return record.asset_materialization.metadata[name].value


def _summary(home: Path) -> dict:
    done = run_cli(home, "summary")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _clean(done) -> None:
    """Exit 0, nothing failed, and none of Dagster's preview/beta chatter or a traceback."""
    assert done.returncode == 0, done.stderr[-4000:]
    assert "FAILED" not in done.stderr, done.stderr[-4000:]
    for noise in NOISE:
        assert noise not in done.stdout + done.stderr, noise


def _long_text(words: int, seed: int = 3) -> str:
    """Prose-shaped text of made-up words: no rule of the quality gate rejects it."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tas", "vo", "qui", "del", "np", "ur", "shi", "bo"]
    made_up = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(words)
    ]
    return " ".join(" ".join(made_up[i : i + 12]).capitalize() + "." for i in range(0, words, 12))


def test_own_data_without_eval_sets_reaches_an_sft_champion(tmp_path):
    """Support answers, one of them far longer than a training row, and support chats (a
    conversation source) in one landing: one batch, one snapshot, one champion trained on both
    formats, the long answer cut and counted."""
    land_support_export(tmp_path, 240)
    long = {"id": "long", "prompt": "Tell me everything about it.", "response": _long_text(3000)}
    write_landing_file(tmp_path / "landing", "support", "long.jsonl", [long])
    land_support_chats(tmp_path, 60)
    long_chat = {
        "id": "long-chat",
        "messages": [
            {"role": "user", "content": "My router will not turn on."},
            {"role": "assistant", "content": "Hold the reset button until the light blinks."},
            {"role": "user", "content": "Tell me everything about it."},
            {"role": "assistant", "content": _long_text(3000, seed=4)},
        ],
    }
    write_landing_file(tmp_path / "landing", "chats", "long.jsonl", [long_chat])
    assert not (tmp_path / "reference").exists()
    done = run_cli(tmp_path, "run", **CHATS)
    _clean(done)
    summary = _summary(tmp_path)
    assert summary["model"]["champion_version"] == "1"
    _trained_on_both_formats(tmp_path)
    silver = pl.read_delta(str(tmp_path / "lake" / "silver" / "records"))
    assert silver.filter(pl.col("response") == long["response"]).height == 1
    assert _latest(tmp_path, GOLD_SEQUENCES, "truncated_documents") == 2, (
        "the long answer cut inside its response, the long chat after its first answer"
    )
    assert _latest(tmp_path, GOLD_SEQUENCES, "conversation_loss") == "all"
    _every_assistant_turn_is_trained(tmp_path)
    lineage = run_cli(tmp_path, "lineage", "sft-model@champion", **CHATS)
    assert lineage.returncode == 0, lineage.stderr[-4000:]
    traced = json.loads(lineage.stdout)
    assert traced["other_formats"]["conversation"]["silver"]["table"] == "silver/conversations"
    assert {f["source"] for f in traced["landing_files"]} == {"support", "chats"}
    [scored] = traced["silver"]["quality_models"]  # no scorer set: the language-ID model alone
    assert scored["batches"] == traced["silver"]["batches"]
    assert [(m["name"], len(m["sha256"])) for m in scored["models"]] == [("language", 64)]
    scored_on = _latest(tmp_path, EVALUATION_REPORT, "scored_on")
    assert scored_on.startswith("the validation split alone: no eval set items")
    assert _latest(tmp_path, SILVER_RECORDS, "decontamination").startswith("none: no eval set")

    # an eval set file that is empty is no eval set either: the next batch's silver (which reads
    # the eval sets through the resource evaluation reads them through) says so
    folder = tmp_path / "reference" / "eval_sets"
    folder.mkdir(parents=True)
    (folder / "benchmark.jsonl").write_bytes(b"")
    write_landing_file(tmp_path / "landing", "support", "more.jsonl", support_answers(20, seed=11))
    more = run_cli(tmp_path, "run", **CHATS)
    _clean(more)
    assert "runs: 3" in more.stdout, "bronze, silver and its gold shard: no new snapshot"
    assert _latest(tmp_path, SILVER_RECORDS, "decontamination").startswith("none: no eval set")


def _trained_on_both_formats(home: Path) -> None:
    """gold-v0's training rows hold sft records and conversations of the one batch."""
    lake = home / "lake"
    sequences = pl.read_delta(str(lake / "gold" / "sequences")).filter(pl.col("split") == "train")
    trained = set(sequences["record_ids"].explode().to_list())
    for table in ("records", "conversations"):
        silver = pl.read_delta(str(lake / "silver" / table))
        assert silver["batch_id"].n_unique() == 1
        assert trained & set(silver["record_id"]), f"no silver/{table} record trained"
    manifest = pl.read_delta(str(lake / "gold" / "snapshots"))
    assert manifest.height == 1, "one snapshot, gold-v0"


def _every_assistant_turn_is_trained(home: Path) -> None:
    """With the default loss, each chat in gold-v0 is trained on as many spans as it has assistant
    turns (the long chat on its first only: it was cut after it)."""
    lake = home / "lake"
    chats = pl.read_delta(str(lake / "silver" / "conversations"))
    answers = {
        row["record_id"]: sum(turn["role"] == "assistant" for turn in row["messages"])
        for row in chats.iter_rows(named=True)
    }
    long_chat = chats.filter(pl.col("id") == "long-chat")["record_id"].item()
    answers[long_chat] = 1
    spans = {}
    rows = pl.read_delta(str(lake / "gold" / "sequences"))
    for row in rows.select("loss_mask", "document_lengths", "record_ids").iter_rows():
        mask, start = row[0], 0
        for length, record_id in zip(row[1], row[2], strict=True):
            piece = mask[start : start + length]
            start += length
            if record_id in answers:
                spans[record_id] = sum(
                    1 for i, m in enumerate(piece) if m and (i == 0 or not piece[i - 1])
                )
    assert spans == answers and max(answers.values()) >= 2


def _waits_for_more_records(done) -> None:
    """The batch is curated; no snapshot is cut and what reports on one waits, with reasons."""
    _clean(done)
    assert "no new data snapshot: the usable gold shards hold no validation sequence" in (
        done.stderr
    ), done.stderr[-4000:]
    assert "WAITING: ops/pipeline_report waits: no data snapshot was cut yet" in done.stdout


def test_a_batch_of_one_record_repeated_keeps_one_and_says_why_of_the_rest(tmp_path):
    """One sft source, no eval sets, nothing overridden."""
    write_landing_file(tmp_path / "landing", "support", "a.jsonl", support_answers(1) * 40)
    _waits_for_more_records(run_cli(tmp_path, "run"))
    summary = _summary(tmp_path)
    assert summary["tables"]["silver/records"]["rows"] == 1
    assert summary["rejected_by_stage"] == {"exact_dup": 39}
    # the defaults of silver's models: every record's language labelled, none rejected for it
    # (PIPELINE_LANGUAGES unset), no scorer (PIPELINE_QUALITY_MODELS empty)
    silver = pl.read_delta(str(tmp_path / "lake" / "silver" / "records"))
    assert silver["language"].to_list() == ["en"]
    assert 0.5 < silver["language_score"].item() <= 1.0
    assert not [c for c in silver.columns if c.startswith("score_")]
    assert _latest(tmp_path, SILVER_RECORDS, "language_mix") == {"en": 1}
    assert _latest(tmp_path, SILVER_RECORDS, "scorers") == {}
    models = _latest(tmp_path, SILVER_RECORDS, "quality_models")
    assert [m["name"] for m in models] == ["language"]


def test_a_landing_of_preference_pairs_only_is_curated_and_the_rest_waits(tmp_path):
    pairs = support_preference_pairs(60)
    write_landing_file(tmp_path / "landing", "prefs", "pairs.jsonl", pairs)
    done = run_cli(tmp_path, "run", **PREFS)
    _clean(done)
    waiting = [line for line in done.stdout.splitlines() if line.startswith("WAITING: ")]
    assert any(
        line.startswith("WAITING: gold/tokenizer waits: no silver training records")
        for line in waiting
    ), done.stdout
    assert any(line.startswith("WAITING: gold/sequences waits: gold/tokenizer") for line in waiting)
    assert "no new preference snapshot" in done.stderr
    summary = _summary(tmp_path)
    assert summary["tables"]["silver/preference_pairs"]["rows"] > 0
    assert summary["tables"]["gold/tokenizer"] is None


def test_the_overlays_command_on_a_fresh_instance_builds_the_bank_and_waits_for_a_champion(
    tmp_path,
):
    """docs/rl.md's command, before any model exists (it failed with DagsterInvalidSubsetError:
    rl/replay_buffer was selected without rl/policy, the multi-asset that makes both)."""
    land_support_export(tmp_path, 20)
    done = run_cli(tmp_path, "run", "--select", "key:rl/*")
    _clean(done)
    for key in ("rl/policy", "rl/replay_buffer"):
        assert f"WAITING: {key} waits: no sft-model champion to start the RL run from" in (
            done.stdout
        ), done.stdout
    bank = pl.read_delta(str(tmp_path / "lake" / "rl" / "prompt_bank"))
    assert bank.filter(pl.col("status") == "in_bank").height > 0
