"""What the instance says about silver since the last data snapshot, for lib.snapshot_cadence."""

from dataclasses import dataclass

from dagster import DagsterInstance

from pipeline_assets.defs.keys import GOLD_SEQUENCES, GOLD_TOKENIZER, SILVER_RECORDS
from pipeline_assets.defs.partitions import data_snapshots, snapshot_version
from pipeline_assets.defs.silver.order import blocked_batches
from pipeline_assets.defs.snapshots import latest_materialization_metadata, latest_records_by_partition, plain_metadata
from pipeline_assets.lib.snapshot_cadence import CadenceInputs, snapshot_due

SNAPSHOT_REASON_TAG = "pipeline/snapshot_reason"  # why a run cuts a snapshot; gold records it


@dataclass(frozen=True)
class SnapshotDecision:
    due: bool
    reason: str
    state: str  # names what was judged (the newest silver write), so one state asks once


def snapshot_decision(instance: DagsterInstance, min_new_fraction: float) -> SnapshotDecision:
    if instance.get_latest_materialization_event(GOLD_TOKENIZER) is None:
        return SnapshotDecision(False, "gold/tokenizer is not built yet", "")
    silver = _latest_silver_by_batch(instance)
    last_cut = instance.fetch_materializations(GOLD_SEQUENCES, limit=1).records
    since = last_cut[0].storage_id if last_cut else -1
    blocked = blocked_batches(instance)
    usable = {batch: written for batch, written in silver.items() if batch not in blocked}
    changed = {batch: chars for batch, (storage_id, chars) in usable.items() if storage_id > since}
    last_key, last_chars = _last_accepted(instance)
    due, reason = snapshot_due(CadenceInputs(changed, last_key, last_chars), min_new_fraction)
    return SnapshotDecision(due, reason, f"silver-{max((s for s, _ in silver.values()), default=0)}")


def _latest_silver_by_batch(instance: DagsterInstance) -> dict[str, tuple[int, int]]:
    """Per batch, its latest silver/records write: (storage id, text characters kept)."""
    found = {}
    for batch, record in latest_records_by_partition(instance, SILVER_RECORDS).items():
        metadata = plain_metadata(record.asset_materialization)
        found[batch] = (record.storage_id, int(metadata.get("output_chars", metadata.get("input_chars", 0))))
    return found


def _last_accepted(instance: DagsterInstance) -> tuple[str | None, int]:
    snapshots = instance.get_dynamic_partitions(data_snapshots.name)
    if not snapshots:
        return None, 0
    key = max(snapshots, key=snapshot_version)
    built = latest_materialization_metadata(instance, GOLD_SEQUENCES, lambda m: m.get("data_snapshot") == key)
    return key, int((built or {}).get("input_chars", 0))
