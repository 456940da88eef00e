"""Conversations through Dagster: a conversation source and an sft source landing in one batch,
read into bronze/conversations and bronze/records, curated into silver/conversations and
silver/records, every line and every bronze row accounted for; a snapshot of both pins both
formats' tables and is evaluated per source; conversations alone train a tokenizer."""

from __future__ import annotations

import json
import random

import polars as pl
from dagster import materialize
from deltalake import write_deltalake

from pipeline_assets.contracts import SilverReject, polars_schema
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.evaluation.assets import EvaluationData
from pipeline_assets.defs.gold.assets import NO_TOKENIZER_SAMPLE, tokenizer_waits
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.defs.snapshots import snapshot_versions
from pipeline_assets.lib.formats import CONVERSATION
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, materialize_bronze, register
from pipeline_assets_tests.defs.gold_helpers import build_gold
from pipeline_assets_tests.lib.silver.test_dedup import WORDS

GRAPH = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]
EVAL_QUESTION = " ".join(f"riddle{i}" for i in range(15))
LEGACY_BATCH = "20200101T000000Z-000000"
# the tables a snapshot of sft records and conversations pins beside gold's
TABLES = ("silver/records", "bronze/records", "silver/conversations", "bronze/conversations")


def _text(rng: random.Random, words: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def _chat(rng: random.Random, i: int) -> dict:
    turns = [{"role": "system", "content": "You are a patient tutor."}]
    for number in range(1 + i % 2):  # one or two exchanges
        turns.append({"role": "user", "content": f"Question {i}.{number}: {_text(rng, 10)}"})
        turns.append({"role": "assistant", "content": _text(rng)})
    return {"id": f"c{i}", "messages": turns}


def _sharegpt(chat: dict) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": names[t["role"]], "value": t["content"]} for t in chat["messages"]]
    return {"id": chat["id"], "conversations": turns}


def _legacy_rejects(lake) -> None:
    """silver/rejects as a lake written before conversations had it: no messages column."""
    row = {
        **dict.fromkeys(polars_schema(SilverReject)),
        "record_id": "0" * 32,
        "batch_id": LEGACY_BATCH,
        "source": "old",
        "source_file": "old/a.jsonl",
        "source_line": 1,
        "prompt": "An old prompt.",
        "response": "An old answer.",
        "stage": "exact_dup",
        "evidence": "{}",
    }
    legacy = pl.DataFrame([row], schema=polars_schema(SilverReject)).drop("messages")
    write_deltalake(
        lake.table_uri("silver", "rejects"), legacy.to_arrow(), partition_by=["batch_id"]
    )


def test_a_conversation_source_and_an_sft_source_go_through_bronze_and_silver_in_one_batch(
    instance, resources, landing_dir, eval_sets_dir
):
    rng = random.Random(5)
    chats = [_chat(rng, i) for i in range(40)]
    broken = {"id": "bad", "messages": chats[1]["messages"][:4]}  # ends on its user turn
    leaked = json.loads(json.dumps(chats[5]))
    leaked["id"] = "leak"
    leaked["messages"][1]["content"] = f"Solve this: {EVAL_QUESTION}"
    write_landing_file(landing_dir, "chats", "a.jsonl", [*chats[:30], broken, leaked])
    write_landing_file(
        landing_dir, "chats", "b.jsonl", [*map(_sharegpt, chats[30:]), {**chats[3], "id": "copy"}]
    )
    write_landing_file(
        landing_dir,
        "annotate",
        "s.jsonl",
        [record(i, response=_text(rng), created_at=...) for i in range(20)],
    )
    item = {"eval_set": "bench", "item_id": "q1", "prompt": EVAL_QUESTION, "response": "An answer"}
    (eval_sets_dir / "bench.jsonl").write_text(json.dumps(item) + "\n")
    lake = resources["lake"]
    _legacy_rejects(lake)
    chats_source = LandingResource(
        uri=resources["landing"].uri, source_formats={"chats": CONVERSATION.name}
    )
    batch = register(instance, resources)

    result = materialize(
        GRAPH,
        partition_key=batch,
        instance=instance,
        resources={**resources, "landing": chats_source},
        raise_on_error=False,
    )

    assert result.success, [
        e.event_specific_data.error.message for e in result.get_step_failure_events()
    ]
    checks = checks_by_name(result)
    assert all(check.passed for check in checks.values()), [
        (name, c.description) for name, c in checks.items() if not c.passed
    ]
    assert {"bronze/conversations:contract", "silver/conversations:contract"} <= set(checks)
    bronze_rows = lake.read("bronze", "conversations")
    quarantine = lake.read("bronze", "quarantine")
    assert bronze_rows.height == 42 and set(bronze_rows["source"]) == {"chats"}
    assert quarantine.select("source", "source_file", "source_line", "reason").rows() == [
        ("chats", "chats/a.jsonl", 31, "ends_on_user_turn")
    ]
    by_id = {row["id"]: row for row in bronze_rows.iter_rows(named=True)}
    assert by_id["c35"]["messages"] == chats[35]["messages"], "the ShareGPT file, as messages"
    assert lake.read("bronze", "records").height == 20, "the sft records go their own way"

    kept = lake.read("silver", "conversations")
    rejects = lake.read("silver", "rejects", where=pl.col("batch_id") == batch)
    assert kept.height + rejects.height == bronze_rows.height, "every bronze row kept or rejected"
    ids = dict(bronze_rows.select("record_id", "id").iter_rows())
    stages = {ids[r["record_id"]]: r for r in rejects.iter_rows(named=True)}
    assert {i: r["stage"] for i, r in stages.items()} == {
        "copy": "exact_dup",
        "leak": "decontaminated",
    }
    assert json.loads(stages["leak"]["evidence"])["field"] == "messages[1]"
    assert stages["leak"]["messages"][1]["content"] == f"Solve this: {EVAL_QUESTION}"
    assert stages["leak"]["prompt"] is None
    assert not set(CONVERSATION.views) & set(kept.columns), "views are not stored"
    assert kept["prompt_hash"].n_unique() == kept.height
    assert lake.read("silver", "records").height == 20

    legacy = lake.read("silver", "rejects", where=pl.col("batch_id") == LEGACY_BATCH)
    assert legacy.height == 1 and legacy["messages"].is_null().all(), "the table took the column"
    metadata = {
        m.asset_key.to_user_string(): m.metadata
        for m in result.asset_materializations_for_node("silver")
    }
    counts = metadata["silver/conversations"]
    assert (counts["bronze_rows"].value, counts["silver_rows"].value) == (42, 40)
    assert counts["input_chars"].value > 40 * 80


def test_conversations_landing_in_an_sft_source_block_the_batch_naming_the_format_setting(
    instance, resources, landing_dir
):
    rng = random.Random(2)
    write_landing_file(landing_dir, "support", "a.jsonl", [_chat(rng, i) for i in range(10)])
    batch = register(instance, resources)

    result = materialize_bronze(instance, resources, batch)

    check = checks_by_name(result)["bronze/records:quarantine_rate"]
    assert not check.passed
    assert """set PIPELINE_SOURCE_FORMATS='{"support": "conversation"}'""" in check.description


def _with_chats(resources: dict, **gold) -> dict:
    """The resources with ``chats`` a conversation source and gold's rows short."""
    landing = LandingResource(
        uri=resources["landing"].uri, source_formats={"chats": CONVERSATION.name}
    )
    return {**resources, "landing": landing, "gold_policy": GoldPolicy(seq_len=256, **gold)}


def _ingest(instance, resources) -> str:
    batch = register(instance, resources)
    ingested = materialize(GRAPH, partition_key=batch, instance=instance, resources=resources)
    assert ingested.success
    return batch


def test_a_snapshot_of_conversations_and_sft_records_pins_both_and_is_evaluated_per_source(
    instance, resources, landing_dir
):
    rng = random.Random(11)
    write_landing_file(landing_dir, "chats", "a.jsonl", [_chat(rng, i) for i in range(60)])
    sft = [record(i, response=_text(rng), created_at=...) for i in range(60)]
    write_landing_file(landing_dir, "annotate", "s.jsonl", sft[:40])
    with_chats = _with_chats(resources, validation_fraction=0.3)
    lake = resources["lake"]
    _ingest(instance, with_chats)
    assert build_gold(instance, with_chats, GRAPH).success
    snapshot = instance.get_dynamic_partitions(data_snapshots.name)[-1]
    pinned = {table: lake.version(*table.split("/")) for table in TABLES}
    write_landing_file(landing_dir, "annotate", "t.jsonl", sft[40:])
    _ingest(instance, with_chats)  # every silver and bronze table moves on

    versions = snapshot_versions(instance, snapshot)

    assert {table: versions[table] for table in TABLES} == pinned
    assert all(lake.version(*table.split("/")) > pinned[table] for table in TABLES)
    data = EvaluationData.load(lake, None, versions, max_tokens=10**9)
    validation = set(data.validation["record_ids"].explode())
    sources = pl.concat(
        lake.read(*table.split("/"), version=pinned[table]).select("record_id", "source")
        for table in ("silver/records", "silver/conversations")
    ).filter(pl.col("record_id").is_in(validation))
    assert set(sources["source"]) == {"annotate", "chats"}, "both sources have validation rows"
    slices = dict(data.slices.group_by("slice").agg("record_id").iter_rows())
    assert set(slices) == {"overall", "source:annotate", "source:chats"}
    for source in ("annotate", "chats"):
        assert sorted(slices[f"source:{source}"]) == sorted(
            sources.filter(pl.col("source") == source)["record_id"]
        )


def test_a_lake_of_conversations_alone_gets_a_tokenizer_and_a_shard(
    instance, resources, landing_dir
):
    rng = random.Random(3)
    write_landing_file(landing_dir, "chats", "a.jsonl", [_chat(rng, i) for i in range(40)])
    with_chats = _with_chats(resources)
    lake = resources["lake"]
    assert tokenizer_waits(lake, with_chats["gold_policy"]) == NO_TOKENIZER_SAMPLE
    batch = _ingest(instance, with_chats)
    assert lake.read("silver", "records").is_empty()

    assert tokenizer_waits(lake, with_chats["gold_policy"]) is None
    built = build_gold(instance, with_chats, GRAPH)

    assert built.success
    trained = {
        k: v.value
        for k, v in built.tokenizer.asset_materializations_for_node("gold__tokenizer")[
            0
        ].metadata.items()
    }
    kept = lake.read("silver", "conversations")
    assert 0 < trained["sample_records"] == trained["training_split_records"] < kept.height
    assert trained["upstream_delta_versions"]["silver/conversations"] == lake.version(
        "silver", "conversations"
    )
    shard = lake.read("gold", "sequences", where=pl.col("batch_id") == batch)
    assert set(shard["record_ids"].explode()) == set(kept["record_id"])
