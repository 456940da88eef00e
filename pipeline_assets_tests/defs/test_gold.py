"""materialize() of gold on a test instance: snapshots, determinism, checks, tokenizer choice."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import polars as pl
import pytest
from dagster import AssetMaterialization, RunRequest, SkipReason, build_schedule_context, build_sensor_context, materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer, read_snapshot
from pipeline_assets.defs.gold.cadence import SNAPSHOT_REASON_TAG, snapshot_decision
from pipeline_assets.defs.gold.checks import JudgedSnapshot, packing_result
from pipeline_assets.defs.gold.sensors import snapshot_cadence, snapshot_schedule
from pipeline_assets.defs.keys import TRAINING_CHECKPOINT
from pipeline_assets.defs.ops.schedules import nightly_retrain
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.lib import gold as gold_lib
from pipeline_assets.lib.sample_corpus import write_sample_corpus
from pipeline_assets.lib.splits import assign_split
from pipeline_assets.resources import GoldPolicy
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, register

UPSTREAM = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]
GOLD = [gold_tokenizer, gold_sequences]


def _ingest(instance, resources):
    batch = register(instance, resources)
    assert materialize(UPSTREAM, partition_key=batch, instance=instance, resources=resources).success
    return batch


def _gold(instance, resources, selection=GOLD, tags=None):
    return materialize([*UPSTREAM, *GOLD], selection=selection, instance=instance,
                       resources=resources, raise_on_error=False, tags=tags)


def _materializations(result) -> dict:
    events = (e.event_specific_data.materialization for e in result.get_asset_materialization_events())
    return {m.asset_key.to_user_string(): m.metadata for m in events}


def _tokenizer_metadata(result) -> dict:
    return {key: value.value for key, value in _materializations(result)["gold/tokenizer"].items()}


def _training_split_size(silver: pl.DataFrame) -> int:
    policy = GoldPolicy()
    return int((assign_split(silver, policy.validation_fraction, search_fraction=policy.search_fraction)["split"] == "train").sum())


@pytest.fixture
def sample_in_two_batches(instance, resources, landing_dir, eval_sets_dir, tmp_path):
    staging = tmp_path / "staging"
    write_sample_corpus(staging, records=3000, eval_sets_dir=eval_sets_dir)
    for sources in (("annotate", "logs"), ("scrape", "synth")):
        for source in sources:
            shutil.copytree(staging / source, landing_dir / source)
        _ingest(instance, resources)


def test_gold_snapshot_from_silver(sample_in_two_batches, instance, resources):
    result = _gold(instance, resources)
    assert result.success
    lake = resources["lake"]
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0"]
    checks = checks_by_name(result)
    assert checks["gold/sequences:contract"].passed
    assert checks["gold/sequences:packing_efficiency"].passed
    assert checks["gold/sequences:packing_efficiency"].metadata["packing_efficiency"].value >= 0.98

    sequences = lake.read("gold", "sequences")
    pieces = sequences.select("split", "record_ids", "document_lengths").explode("record_ids", "document_lengths")
    per_record = pieces.group_by("record_ids").agg(
        pieces=pl.len(), tokens=pl.col("document_lengths").sum(), splits=pl.col("split").n_unique()
    )
    assert set(per_record["record_ids"]) == set(lake.read("silver", "records")["record_id"])
    assert (per_record["splits"] == 1).all(), "a record lives in one split"
    assert (per_record["pieces"] == 1).all() and (per_record["tokens"] <= 512).all(), "a record is never split"
    assert set(sequences["split"]) == {"train", "validation", "search"}
    assert (sequences["input_ids"].list.len() == 512).all()
    assert (sequences["real_tokens"] == sequences["document_lengths"].list.sum()).all()

    metadata = _materializations(result)
    gold_meta = metadata["gold/sequences"]
    assert gold_meta["long_records"].value == "truncate" and gold_meta["dropped_long_records"].value == 0
    assert gold_meta["truncated_documents"].value == int((per_record["tokens"] == 512).sum())
    assert gold_meta["data_snapshot"].value == "gold-v0"
    assert gold_meta["upstream_delta_versions"].value == {"silver/records": lake.version("silver", "records"), "gold/tokenizer": 0}
    assert gold_meta["tokens"].value == sum(r.data["tokens"] for r in gold_meta["tokens_by_source"].value.records)
    tokenizer_meta = _tokenizer_metadata(result)
    assert tokenizer_meta["vocab_size"] == 8192
    assert tokenizer_meta["sample_chars_cap"] == 100_000_000, "the default cap is above this corpus: all of train"
    assert tokenizer_meta["sample_records"] == tokenizer_meta["training_split_records"] == _training_split_size(lake.read("silver", "records"))
    assert tokenizer_meta["sample_chars"] == tokenizer_meta["training_split_chars"] == tokenizer_meta["input_chars"]


def test_same_inputs_give_identical_snapshots_and_a_new_version(sample_in_two_batches, instance, resources):
    assert _gold(instance, resources).success
    assert _gold(instance, resources, selection=[gold_sequences]).success
    lake = resources["lake"]
    first, second = (read_snapshot(lake, v) for v in (0, 1))
    assert first.equals(second)
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0", "gold-v1"]
    checks = checks_by_name(_gold(instance, resources, selection=[gold_sequences]))
    assert checks["gold/sequences:token_volume"].passed and "gold-v1" in checks["gold/sequences:token_volume"].description
    assert checks["gold/sequences:token_length_drift"].passed


def test_a_provided_tokenizer_without_the_chat_tokens_is_refused(sample_in_two_batches, instance, resources, tmp_path):
    from tokenizers import Tokenizer, models

    bad = tmp_path / "tokenizer.json"
    bad.write_text(Tokenizer(models.BPE()).to_str())
    result = _gold(instance, {**resources, "gold_policy": GoldPolicy(tokenizer_path=str(bad))}, selection=[gold_tokenizer])
    assert not result.success
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    assert "<|pad|>" in message and "<|assistant|>" in message


def test_batches_blocked_in_silver_are_left_out(instance, resources, landing_dir):
    long = "This response explains the idea in plenty of ordinary words so that it passes every rule we have here today."
    for i in range(3):
        write_landing_file(landing_dir, "logs", f"ok{i}.jsonl", [record(100 * i + j, response=f"{long} Case {i} {j}.") for j in range(20)])
        _ingest(instance, resources)
    write_landing_file(landing_dir, "logs", "bad.jsonl", [record(900 + j, response=f"ok {j}") for j in range(20)])
    blocked = register(instance, resources)
    materialize(UPSTREAM, partition_key=blocked, instance=instance, resources=resources, raise_on_error=False)
    result = _gold(instance, {**resources, "gold_policy": GoldPolicy(tokenizer_sample_chars=3000)})
    assert result.success
    meta = _materializations(result)["gold/sequences"]
    assert meta["batches_left_out"].value == [blocked]
    packed = set(resources["lake"].read("gold", "sequences")["record_ids"].explode())
    assert not packed & set(resources["lake"].read("silver", "records", where=pl.col("batch_id") == blocked)["record_id"])
    assert json.dumps(meta["batches_left_out"].value)

    usable = resources["lake"].read("silver", "records", where=pl.col("batch_id") != blocked)
    tokenizer_meta = _tokenizer_metadata(result)
    assert tokenizer_meta["training_split_records"] == _training_split_size(usable)
    assert tokenizer_meta["sample_chars_cap"] == 3000 and 0 < tokenizer_meta["sample_chars"] <= 3000
    assert 0 < tokenizer_meta["sample_records"] < tokenizer_meta["training_split_records"]


def test_a_snapshot_that_doubles_in_tokens_is_reported(instance, resources, landing_dir, eval_sets_dir, tmp_path):
    staging = tmp_path / "staging"
    write_sample_corpus(staging, records=3000, eval_sets_dir=eval_sets_dir)
    shutil.copytree(staging / "annotate", landing_dir / "annotate")
    _ingest(instance, resources)
    assert _gold(instance, resources).success
    for source in ("logs", "scrape", "synth"):
        shutil.copytree(staging / source, landing_dir / source)
    _ingest(instance, resources)
    result = _gold(instance, resources, selection=[gold_sequences])
    assert result.success, "volume and drift report; they do not block"
    volume = checks_by_name(result)["gold/sequences:token_volume"]
    assert not volume.passed and "against" in volume.description and "gold-v0" in volume.description
    assert volume.metadata["change"].value > 1.0
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v0", "gold-v1"]


def test_a_small_uniform_first_dataset_passes_packing_and_broken_packing_fails(instance, resources, landing_dir):
    """300 support answers of similar length cannot fill rows to 0.98: the check judges packing by
    what those lengths allow (first-fit of the same pieces), so the snapshot passes; the same
    pieces one per row is broken packing and fails."""
    answer = "Thanks for reaching out. To reset your password open settings, choose security, then reset."
    write_landing_file(landing_dir, "support", "first.jsonl",
                       [record(i, prompt=f"How do I reset my password, case {i}?", response=f"{answer} Ticket {i}.") for i in range(300)])
    _ingest(instance, resources)
    result = _gold(instance, resources)
    packing = checks_by_name(result)["gold/sequences:packing_efficiency"]
    assert result.success and packing.passed, packing.description
    assert packing.metadata["packing_efficiency"].value < 0.98
    assert packing.metadata["rows"].value <= packing.metadata["allowed_rows"].value

    one_per_row = resources["lake"].read("gold", "sequences").explode("record_ids", "document_lengths").with_columns(
        document_lengths=pl.concat_list("document_lengths"), record_ids=pl.concat_list("record_ids"))
    broken = packing_result(JudgedSnapshot.of("gold-v1", one_per_row), GoldPolicy().min_packing_efficiency)
    assert not broken.passed and "packing is broken" in broken.description
    assert broken.metadata["rows"].value > broken.metadata["first_fit_rows"].value


def _records(first: int, count: int) -> list[dict]:
    long = "This response explains the idea in plenty of ordinary words so that it passes every rule we have here today."
    return [record(first + i, response=f"{long} Case {first + i}.") for i in range(count)]


def test_snapshots_are_cut_on_a_cadence_and_only_checked_ones_train(instance, resources, landing_dir, monkeypatch):
    """The first snapshot is cut once silver and the tokenizer exist; one that fails a blocking check
    never becomes a data_snapshots partition (nothing trains it) and is not cut again for the same
    silver; later snapshots wait until the silver changed since the last cut reaches 10% of the last
    accepted one, and say why they were cut. The nightly retrain skips a snapshot already trained."""
    policy = resources["gold_policy"]
    write_landing_file(landing_dir, "logs", "a.jsonl", _records(0, 100))
    _ingest(instance, resources)
    assert _gold(instance, resources, selection=[gold_tokenizer]).success
    decision = snapshot_decision(instance, policy.snapshot_min_new_fraction)
    assert decision.due and decision.reason.startswith("first snapshot")

    real_planner = gold_lib.plan_best_fit_decreasing
    monkeypatch.setattr(gold_lib, "plan_best_fit_decreasing", lambda lengths, seq_len: real_planner(lengths, seq_len // 4))
    broken = _gold(instance, resources, selection=[gold_sequences])
    packing = checks_by_name(broken)["gold/sequences:packing_efficiency"]
    assert not packing.passed and "packing is broken" in packing.description
    assert packing.metadata["data_snapshot"].value == "gold-v0"
    assert instance.get_dynamic_partitions(data_snapshots.name) == []
    assert not snapshot_decision(instance, policy.snapshot_min_new_fraction).due, "the same silver is not cut again"

    monkeypatch.setattr(gold_lib, "plan_best_fit_decreasing", real_planner)
    good = _gold(instance, resources, selection=[gold_sequences], tags={SNAPSHOT_REASON_TAG: "by hand"})
    assert good.success, [(c.check_name, c.description) for c in good.get_asset_check_evaluations()]
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v1"]
    nightly = nightly_retrain(build_schedule_context(instance=instance, scheduled_execution_time=datetime(2026, 11, 25, 2)))
    assert nightly.partition_key == "gold-v1"
    instance.report_runless_asset_event(AssetMaterialization(TRAINING_CHECKPOINT, partition="gold-v1"))
    skipped = nightly_retrain(build_schedule_context(instance=instance, scheduled_execution_time=datetime(2026, 11, 26, 2)))
    assert isinstance(skipped, SkipReason) and "already trained" in skipped.skip_message

    write_landing_file(landing_dir, "logs", "b.jsonl", _records(1000, 5))
    _ingest(instance, resources)
    tick = snapshot_cadence(build_sensor_context(instance=instance, resources={"gold_policy": policy}))
    assert isinstance(tick, SkipReason) and "cut at 10%" in tick.skip_message and "gold-v1" in tick.skip_message
    nightly_cut = snapshot_schedule(build_schedule_context(instance=instance, scheduled_execution_time=datetime(2026, 11, 26, 1)))
    assert nightly_cut.tags[SNAPSHOT_REASON_TAG].startswith("schedule: "), "the schedule cuts whatever changed"

    write_landing_file(landing_dir, "logs", "c.jsonl", _records(2000, 20))
    _ingest(instance, resources)
    request = snapshot_cadence(build_sensor_context(instance=instance, resources={"gold_policy": policy}))
    assert isinstance(request, RunRequest), "5 + 20 new records reach 10% of the 100 in gold-v1"
    cut = _gold(instance, resources, selection=[gold_sequences], tags=request.tags)
    meta = _materializations(cut)["gold/sequences"]
    assert meta["snapshot_reason"].value == request.tags[SNAPSHOT_REASON_TAG] and "2 batch(es)" in meta["snapshot_reason"].value
    assert instance.get_dynamic_partitions(data_snapshots.name) == ["gold-v1", "gold-v2"]
    assert checks_by_name(cut)["gold/sequences:token_volume"].metadata["compared_with"].value == "gold-v1"

@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_long_records_keep_their_prompt_or_are_left_out_by_name(instance, resources, landing_dir, mode):
    words = " ".join(f"word{i % 97} term{i % 89}" for i in range(300))
    long = "This response explains the idea in plenty of ordinary words so that it passes every rule we have here today."
    rows = [record(j, response=f"{long} Case {j}.") for j in range(20)]
    rows += [record(100, response=f"{long} {words}"), record(101, prompt=f"Read this: {words}", response=f"{long} Short.")]
    write_landing_file(landing_dir, "logs", "long.jsonl", rows)
    _ingest(instance, resources)
    policy = GoldPolicy(seq_len=128, long_records=mode, min_packing_efficiency=0.1)
    result = _gold(instance, {**resources, "gold_policy": policy})
    assert result.success
    meta = _materializations(result)["gold/sequences"]
    ids = dict(resources["lake"].read("bronze", "records").select("id", "record_id").iter_rows())
    left_out = {row.data["record_id"]: row.data["reason"] for row in meta["long_records_left_out"].value.records}
    expected = {ids["r101"]: "prompt_too_long", **({ids["r100"]: "too_long"} if mode == "drop" else {})}
    assert left_out == expected and meta["dropped_long_records"].value == len(expected)
    assert meta["truncated_documents"].value == (1 if mode == "truncate" else 0)
    sequences = resources["lake"].read("gold", "sequences")
    assert set(sequences["record_ids"].explode()) == set(ids.values()) - set(expected)
    for mask, lengths in sequences.select("loss_mask", "document_lengths").iter_rows():
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        assert not any(mask[start] for start in starts), "every piece opens with its prompt (no loss there)"
