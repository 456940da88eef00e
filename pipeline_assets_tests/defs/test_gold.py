"""materialize() of gold on a test instance: snapshots, determinism, checks, tokenizer choice."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer, read_snapshot
from pipeline_assets.defs.gold.checks import gold_checks, gold_packing_efficiency
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.lib.sample_corpus import write_sample_corpus
from pipeline_assets.resources import GoldPolicy
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, register

UPSTREAM = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]
GOLD = [gold_tokenizer, gold_sequences]


def _ingest(instance, resources):
    batch = register(instance, resources)
    assert materialize(UPSTREAM, partition_key=batch, instance=instance, resources=resources).success
    return batch


def _gold(instance, resources, selection=GOLD):
    return materialize([*UPSTREAM, *GOLD, *gold_checks], selection=selection, instance=instance,
                       resources=resources, raise_on_error=False)


def _materializations(result) -> dict:
    events = (e.event_specific_data.materialization for e in result.get_asset_materialization_events())
    return {m.asset_key.to_user_string(): m.metadata for m in events}


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
    assert (per_record["pieces"] == (per_record["tokens"] + 511) // 512).all(), "split only when longer than seq_len"
    assert set(sequences["split"]) == {"train", "validation", "search"}
    assert (sequences["input_ids"].list.len() == 512).all()
    assert (sequences["real_tokens"] == sequences["document_lengths"].list.sum()).all()

    metadata = _materializations(result)
    gold_meta = metadata["gold/sequences"]
    assert gold_meta["split_documents"].value == int((per_record["pieces"] > 1).sum())
    assert gold_meta["data_snapshot"].value == "gold-v0"
    assert gold_meta["upstream_delta_versions"].value == {"silver/records": lake.version("silver", "records"), "gold/tokenizer": 0}
    assert gold_meta["tokens"].value == sum(r.data["tokens"] for r in gold_meta["tokens_by_source"].value.records)
    assert metadata["gold/tokenizer"]["vocab_size"].value == 8192


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
    result = _gold(instance, resources)
    assert result.success
    meta = _materializations(result)["gold/sequences"]
    assert meta["batches_left_out"].value == [blocked]
    packed = set(resources["lake"].read("gold", "sequences")["record_ids"].explode())
    assert not packed & set(resources["lake"].read("silver", "records", where=pl.col("batch_id") == blocked)["record_id"])
    assert json.dumps(meta["batches_left_out"].value)


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
    assert packing.metadata["rows"].value <= packing.metadata["first_fit_rows"].value

    lake = resources["lake"]
    one_per_row = lake.read("gold", "sequences").explode("record_ids", "document_lengths").with_columns(
        document_lengths=pl.concat_list("document_lengths"), record_ids=pl.concat_list("record_ids"))
    lake.overwrite("gold", "sequences", one_per_row)
    broken = gold_packing_efficiency(lake=lake, gold_policy=GoldPolicy())
    assert not broken.passed and "packing is broken" in broken.description
    assert broken.metadata["rows"].value > broken.metadata["first_fit_rows"].value
