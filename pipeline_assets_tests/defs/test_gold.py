"""materialize() of gold on a test instance: a shard per batch, snapshots as manifests, determinism,
checks, the tokenizer and its rebuilds."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import polars as pl
import pytest
from dagster import (
    AssetMaterialization,
    RunRequest,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
    materialize,
)

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.gold.assets import read_snapshot
from pipeline_assets.defs.gold.cadence import SNAPSHOT_REASON_TAG, snapshot_decision
from pipeline_assets.defs.gold.checks import JudgedSnapshot, packing_result
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.gold.sensors import snapshot_cadence, snapshot_schedule
from pipeline_assets.defs.keys import TRAINING_CHECKPOINT
from pipeline_assets.defs.ops.schedules import nightly_retrain
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.lib.gold import sequences as gold_lib
from pipeline_assets.lib.gold.splits import assign_split
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, register
from pipeline_assets_tests.defs.gold_helpers import (
    build_gold,
    build_shards,
    build_tokenizer,
    cut_snapshot,
)

UPSTREAM = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]


def _ingest(instance, resources):
    batch = register(instance, resources)
    assert materialize(
        UPSTREAM, partition_key=batch, instance=instance, resources=resources
    ).success
    return batch


def _gold(instance, resources, tags=None):
    return build_gold(instance, resources, UPSTREAM, tags=tags)


def _shards(instance, resources, batches=None):
    return build_shards(instance, resources, UPSTREAM, batches)


def _cut(instance, resources, tags=None):
    return cut_snapshot(instance, resources, UPSTREAM, tags)


def _metadata(result, key: str) -> dict:
    events = (
        e.event_specific_data.materialization for e in result.get_asset_materialization_events()
    )
    return next(
        {name: value.value for name, value in m.metadata.items()}
        for m in events
        if m.asset_key.to_user_string() == key
    )


def _training_split_size(silver: pl.DataFrame) -> int:
    policy = GoldPolicy()
    return int(
        (
            assign_split(
                silver, policy.validation_fraction, search_fraction=policy.search_fraction
            )["split"]
            == "train"
        ).sum()
    )


@pytest.fixture
def sample_in_two_batches(instance, resources, landing_dir, eval_sets_dir, tmp_path):
    staging = tmp_path / "staging"
    write_sample_corpus(staging, records=3000, eval_sets_dir=eval_sets_dir)
    for sources in (("annotate", "logs"), ("scrape", "synth")):
        for source in sources:
            shutil.copytree(staging / source, landing_dir / source)
        _ingest(instance, resources)


def test_each_batch_is_packed_into_its_own_shard_and_a_snapshot_lists_them(
    sample_in_two_batches, instance, resources
):
    runs = _gold(instance, resources)
    assert runs.success
    lake = resources["lake"]
    batches = sorted(runs.shards)
    assert len(batches) == 2 and instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0"]
    silver = lake.read("silver", "records")
    for batch, result in runs.shards.items():
        checks = checks_by_name(result)
        assert (
            checks["gold/sequences:contract"].passed
            and checks["gold/sequences:packing_efficiency"].passed
        )
        shard = lake.read("gold", "sequences", where=pl.col("batch_id") == batch)
        assert set(shard["record_ids"].explode()) == set(
            silver.filter(pl.col("batch_id") == batch)["record_id"]
        ), "a shard holds exactly its batch's records"
        assert (shard["tokenizer_version"] == 0).all()
        for _, part in shard.group_by("split"):
            assert sorted(part["sequence_index"]) == list(range(part.height)), (
                "each shard numbers its splits 0..n-1"
            )

    sequences = read_snapshot(lake, "gold-v0")
    pieces = sequences.select("split", "record_ids", "document_lengths").explode(
        "record_ids", "document_lengths"
    )
    per_record = pieces.group_by("record_ids").agg(
        pieces=pl.len(), tokens=pl.col("document_lengths").sum(), splits=pl.col("split").n_unique()
    )
    assert set(per_record["record_ids"]) == set(silver["record_id"])
    assert (per_record["splits"] == 1).all(), "a record lives in one split"
    assert (per_record["pieces"] == 1).all() and (per_record["tokens"] <= 512).all(), (
        "a record is never split"
    )
    assert set(sequences["split"]) == {"train", "validation", "search"}
    assert (sequences["input_ids"].list.len() == 512).all()
    assert (sequences["real_tokens"] == sequences["document_lengths"].list.sum()).all()
    for _, part in sequences.group_by("split"):
        assert part["sequence_index"].to_list() == list(range(part.height)), (
            "one global order per split"
        )

    shards = {batch: _metadata(result, "gold/sequences") for batch, result in runs.shards.items()}
    cut = _metadata(runs.cut, "gold/snapshots")
    assert all(
        m["long_records"] == "truncate" and m["dropped_long_records"] == 0 for m in shards.values()
    )
    assert sum(m["truncated_documents"] for m in shards.values()) == int(
        (per_record["tokens"] == 512).sum()
    )
    assert all(m["upstream_delta_versions"]["gold/tokenizer"] == 0 for m in shards.values())
    assert all(
        m["tokens"] == sum(r.data["tokens"] for r in m["tokens_by_source"].records)
        for m in shards.values()
    )
    assert (
        cut["data_snapshot"] == "gold-v0"
        and cut["batches"] == batches
        and cut["batches_left_out"] == {}
    )
    assert cut["upstream_delta_versions"] == {
        "gold/sequences": lake.version("gold", "sequences"),
        "gold/tokenizer": 0,
    }
    assert cut["tokens"] == sum(m["tokens"] for m in shards.values())
    assert cut["real_tokens"] == int(sequences["real_tokens"].sum())
    assert cut["sequences_by_split"] == {
        split: int((sequences["split"] == split).sum())
        for split in ("train", "validation", "search")
    }
    tokenizer_meta = _metadata(runs.tokenizer, "gold/tokenizer")
    assert tokenizer_meta["vocab_size"] == 8192
    assert tokenizer_meta["sample_chars_cap"] == 100_000_000, (
        "the default cap is above this corpus: all of train"
    )
    assert (
        tokenizer_meta["sample_records"]
        == tokenizer_meta["training_split_records"]
        == _training_split_size(silver)
    )
    assert (
        tokenizer_meta["sample_chars"]
        == tokenizer_meta["training_split_chars"]
        == tokenizer_meta["input_chars"]
    )


def test_a_rebuilt_shard_is_identical_and_a_cut_tokenizes_nothing(
    sample_in_two_batches, instance, resources
):
    assert _gold(instance, resources).success
    lake = resources["lake"]
    before = lake.read("gold", "sequences").sort("batch_id", "split", "sequence_index")
    sequences_version = lake.version("gold", "sequences")
    second = _cut(instance, resources)
    assert second.success
    assert lake.version("gold", "sequences") == sequences_version, (
        "cutting a snapshot writes no sequence"
    )
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0", "gold-v1"]
    assert read_snapshot(lake, "gold-v0").equals(read_snapshot(lake, "gold-v1"))
    checks = checks_by_name(second)
    assert (
        checks["gold/snapshots:token_volume"].passed
        and "gold-v0" in checks["gold/snapshots:token_volume"].description
    )
    assert checks["gold/snapshots:token_length_drift"].passed

    assert all(result.success for result in _shards(instance, resources).values())
    assert (
        lake.read("gold", "sequences").sort("batch_id", "split", "sequence_index").equals(before)
    ), "the same batch and tokenizer give the same shard, shuffle included"


def test_a_provided_tokenizer_without_the_chat_tokens_is_refused(
    sample_in_two_batches, instance, resources, tmp_path
):
    from tokenizers import Tokenizer, models

    bad = tmp_path / "tokenizer.json"
    bad.write_text(Tokenizer(models.BPE()).to_str())
    result = build_tokenizer(
        instance, {**resources, "gold_policy": GoldPolicy(tokenizer_path=str(bad))}, UPSTREAM
    )
    assert not result.success
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    assert "<|pad|>" in message and "<|assistant|>" in message


def test_batches_blocked_in_silver_are_left_out(instance, resources, landing_dir):
    long = (
        "This response explains the idea in plenty of ordinary words so that it passes every "
        "rule we have here today."
    )
    for i in range(3):
        write_landing_file(
            landing_dir,
            "logs",
            f"ok{i}.jsonl",
            [record(100 * i + j, response=f"{long} Case {i} {j}.") for j in range(20)],
        )
        _ingest(instance, resources)
    write_landing_file(
        landing_dir, "logs", "bad.jsonl", [record(900 + j, response=f"ok {j}") for j in range(20)]
    )
    blocked = register(instance, resources)
    materialize(
        UPSTREAM,
        partition_key=blocked,
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    runs = _gold(instance, {**resources, "gold_policy": GoldPolicy(tokenizer_sample_chars=3000)})
    assert runs.success, (
        "a shard built by hand for the blocked batch is still left out of the snapshot"
    )
    meta = _metadata(runs.cut, "gold/snapshots")
    assert meta["batches_left_out"] == {blocked: "a blocking check on its bronze or silver failed"}
    assert blocked not in meta["batches"] and len(meta["batches"]) == 3
    packed = set(read_snapshot(resources["lake"], "gold-v0")["record_ids"].explode())
    assert not packed & set(
        resources["lake"].read("silver", "records", where=pl.col("batch_id") == blocked)[
            "record_id"
        ]
    )
    assert json.dumps(meta["batches_left_out"])

    usable = resources["lake"].read("silver", "records", where=pl.col("batch_id") != blocked)
    tokenizer_meta = _metadata(runs.tokenizer, "gold/tokenizer")
    assert tokenizer_meta["training_split_records"] == _training_split_size(usable)
    assert tokenizer_meta["sample_chars_cap"] == 3000 and 0 < tokenizer_meta["sample_chars"] <= 3000
    assert 0 < tokenizer_meta["sample_records"] < tokenizer_meta["training_split_records"]


def test_a_snapshot_that_doubles_in_tokens_is_reported(
    instance, resources, landing_dir, eval_sets_dir, tmp_path
):
    staging = tmp_path / "staging"
    write_sample_corpus(staging, records=3000, eval_sets_dir=eval_sets_dir)
    shutil.copytree(staging / "annotate", landing_dir / "annotate")
    _ingest(instance, resources)
    assert _gold(instance, resources).success
    for source in ("logs", "scrape", "synth"):
        shutil.copytree(staging / source, landing_dir / source)
    second = _ingest(instance, resources)
    assert all(r.success for r in _shards(instance, resources, [second]).values())
    result = _cut(instance, resources)
    assert result.success, "volume and drift report; they do not block"
    volume = checks_by_name(result)["gold/snapshots:token_volume"]
    assert not volume.passed and "against" in volume.description and "gold-v0" in volume.description
    assert (
        volume.metadata["change"].value > 1.0
        and volume.metadata["data_snapshot"].value == "gold-v1"
    )
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0", "gold-v1"]


def test_a_small_uniform_first_dataset_passes_packing_and_broken_packing_fails(
    instance, resources, landing_dir
):
    """300 support answers of similar length cannot fill rows to 0.98: the check judges packing by
    what those lengths allow (first-fit of the same pieces), so the shard passes; the same
    pieces one per row is broken packing and fails."""
    answer = (
        "Thanks for reaching out. To reset your password open settings, choose security, "
        "then reset."
    )
    write_landing_file(
        landing_dir,
        "support",
        "first.jsonl",
        [
            record(
                i, prompt=f"How do I reset my password, case {i}?", response=f"{answer} Ticket {i}."
            )
            for i in range(300)
        ],
    )
    batch = _ingest(instance, resources)
    runs = _gold(instance, resources)
    packing = checks_by_name(runs.shards[batch])["gold/sequences:packing_efficiency"]
    assert runs.success and packing.passed, packing.description
    assert packing.metadata["packing_efficiency"].value < 0.98
    assert packing.metadata["rows"].value <= packing.metadata["allowed_rows"].value

    one_per_row = (
        resources["lake"]
        .read("gold", "sequences")
        .explode("record_ids", "document_lengths")
        .with_columns(
            document_lengths=pl.concat_list("document_lengths"),
            record_ids=pl.concat_list("record_ids"),
        )
    )
    broken = packing_result(
        JudgedSnapshot.of("shard", one_per_row), GoldPolicy().min_packing_efficiency
    )
    assert not broken.passed and "packing is broken" in broken.description
    assert broken.metadata["rows"].value > broken.metadata["first_fit_rows"].value


def _records(first: int, count: int) -> list[dict]:
    long = (
        "This response explains the idea in plenty of ordinary words so that it passes every "
        "rule we have here today."
    )
    return [record(first + i, response=f"{long} Case {first + i}.") for i in range(count)]


def _tick(instance, policy):
    resources = {"gold_policy": policy, "batch_gates": batch_gates()}
    # as a context manager: its resources are closed when the tick ends, not when collected
    with build_sensor_context(instance=instance, resources=resources) as context:
        return snapshot_cadence(context)


@pytest.mark.sqlite_instance  # a schedule's context rebuilds the instance from its reference
def test_snapshots_are_cut_on_a_cadence_from_shards_that_passed(
    instance, resources, landing_dir, monkeypatch
):
    """A shard that fails a blocking check is in no snapshot; the first snapshot is cut once a shard
    passes; later ones wait until the tokens of the shards built since the last cut reach 10% of it,
    and say why they were cut. The nightly retrain skips a snapshot already trained."""
    policy = resources["gold_policy"]
    write_landing_file(landing_dir, "logs", "a.jsonl", _records(0, 100))
    first = _ingest(instance, resources)
    assert build_tokenizer(instance, resources, UPSTREAM).success
    assert not snapshot_decision(instance, batch_gates(), policy.snapshot_min_new_fraction).due, (
        "no shard yet"
    )

    real_planner = gold_lib.plan_best_fit_decreasing
    monkeypatch.setattr(
        gold_lib,
        "plan_best_fit_decreasing",
        lambda lengths, seq_len: real_planner(lengths, seq_len // 4),
    )
    broken = _shards(instance, resources)[first]
    packing = checks_by_name(broken)["gold/sequences:packing_efficiency"]
    assert not packing.passed and "packing is broken" in packing.description
    assert isinstance(_tick(instance, policy), SkipReason), "a blocked shard is no reason to cut"
    refused = _cut(instance, resources)
    assert not refused.success and instance.get_dynamic_partitions(data_snapshots.name) == []
    assert (
        "no gold/sequences shard to cut a snapshot from: 1 left out"
        in refused.get_step_failure_events()[0].event_specific_data.error.message
    )

    monkeypatch.setattr(gold_lib, "plan_best_fit_decreasing", real_planner)
    assert _shards(instance, resources)[first].success
    decision = snapshot_decision(instance, batch_gates(), policy.snapshot_min_new_fraction)
    assert decision.due and decision.reason.startswith("first snapshot")
    assert _cut(instance, resources, tags={SNAPSHOT_REASON_TAG: "by hand"}).success
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0"]
    nightly = nightly_retrain(
        build_schedule_context(
            instance=instance, scheduled_execution_time=datetime(2026, 11, 25, 2)
        )
    )
    assert nightly.partition_key == "gold-v0"
    instance.report_runless_asset_event(
        AssetMaterialization(TRAINING_CHECKPOINT, partition="gold-v0")
    )
    skipped = nightly_retrain(
        build_schedule_context(
            instance=instance, scheduled_execution_time=datetime(2026, 11, 26, 2)
        )
    )
    assert isinstance(skipped, SkipReason) and "already trained" in skipped.skip_message

    write_landing_file(landing_dir, "logs", "b.jsonl", _records(1000, 5))
    assert _shards(instance, resources, [_ingest(instance, resources)])
    tick = _tick(instance, policy)
    assert (
        isinstance(tick, SkipReason)
        and "cut at 10%" in tick.skip_message
        and "gold-v0" in tick.skip_message
    )
    with build_schedule_context(
        instance=instance,
        resources={"batch_gates": batch_gates()},
        scheduled_execution_time=datetime(2026, 11, 26, 1),
    ) as context:
        nightly_cut = snapshot_schedule(context)
    assert nightly_cut.tags[SNAPSHOT_REASON_TAG].startswith("schedule: "), (
        "the schedule cuts whatever changed"
    )

    write_landing_file(landing_dir, "logs", "c.jsonl", _records(2000, 20))
    assert _shards(instance, resources, [_ingest(instance, resources)])
    request = _tick(instance, policy)
    assert isinstance(request, RunRequest), "5 + 20 new records reach 10% of the 100 in gold-v0"
    cut = _cut(instance, resources, tags=request.tags)
    meta = _metadata(cut, "gold/snapshots")
    assert (
        meta["snapshot_reason"] == request.tags[SNAPSHOT_REASON_TAG]
        and "2 batch(es)" in meta["snapshot_reason"]
    )
    assert len(meta["batches"]) == 3
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0", "gold-v1"]
    assert (
        checks_by_name(cut)["gold/snapshots:token_volume"].metadata["compared_with"].value
        == "gold-v0"
    )


def test_a_new_tokenizer_holds_snapshots_until_every_shard_is_rebuilt(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "logs", "a.jsonl", _records(0, 60))
    _ingest(instance, resources)
    write_landing_file(landing_dir, "logs", "b.jsonl", _records(100, 60))
    second = _ingest(instance, resources)
    assert _gold(instance, resources).success
    policy = resources["gold_policy"]

    assert build_tokenizer(instance, resources, UPSTREAM).success, (
        "a new tokenizer version (by hand)"
    )
    waiting = snapshot_decision(instance, batch_gates(), 0.0)
    assert (
        not waiting.due
        and "2 shard(s) still encoded by an older gold/tokenizer than v1" in waiting.reason
    )
    assert _shards(instance, resources, [second])[second].success
    cut = _cut(instance, resources)
    assert cut.success, "the rebuilt shard alone can be cut by hand"
    meta = _metadata(cut, "gold/snapshots")
    assert len(meta["batches"]) == 1 and list(meta["batches_left_out"].values()) == [
        "older tokenizer"
    ]
    assert set(
        read_snapshot(resources["lake"], "gold-v1").select(pl.col("record_ids").explode())[
            "record_ids"
        ]
    ) <= set(
        resources["lake"].read("silver", "records", where=pl.col("batch_id") == second)["record_id"]
    )
    assert not snapshot_decision(instance, batch_gates(), policy.snapshot_min_new_fraction).due
    assert all(r.success for r in _shards(instance, resources).values())
    assert snapshot_decision(instance, batch_gates(), 0.0).due, (
        "every shard is on the new tokenizer"
    )


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_long_records_keep_their_prompt_or_are_left_out_by_name(
    instance, resources, landing_dir, mode
):
    words = " ".join(f"word{i % 97} term{i % 89}" for i in range(300))
    long = (
        "This response explains the idea in plenty of ordinary words so that it passes every "
        "rule we have here today."
    )
    rows = [record(j, response=f"{long} Case {j}.") for j in range(20)]
    rows += [
        record(100, response=f"{long} {words}"),
        record(101, prompt=f"Read this: {words}", response=f"{long} Short."),
    ]
    write_landing_file(landing_dir, "logs", "long.jsonl", rows)
    batch = _ingest(instance, resources)
    policy = GoldPolicy(seq_len=128, long_records=mode, min_packing_efficiency=0.1)
    runs = _gold(instance, {**resources, "gold_policy": policy})
    assert runs.success
    meta = _metadata(runs.shards[batch], "gold/sequences")
    ids = dict(resources["lake"].read("bronze", "records").select("id", "record_id").iter_rows())
    left_out = {
        row.data["record_id"]: row.data["reason"] for row in meta["long_records_left_out"].records
    }
    expected = {
        ids["r101"]: "prompt_too_long",
        **({ids["r100"]: "too_long"} if mode == "drop" else {}),
    }
    assert left_out == expected and meta["dropped_long_records"] == len(expected)
    assert meta["truncated_documents"] == (1 if mode == "truncate" else 0)
    sequences = resources["lake"].read("gold", "sequences")
    assert set(sequences["record_ids"].explode()) == set(ids.values()) - set(expected)
    for mask, lengths in sequences.select("loss_mask", "document_lengths").iter_rows():
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        assert not any(mask[start] for start in starts), (
            "every piece opens with its prompt (no loss there)"
        )
