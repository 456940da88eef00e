"""What the instance knows about each ingest batch's bronze and silver, for lib.silver.order."""

from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.keys import BRONZE_RECORDS, SILVER_RECORDS
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.snapshots import latest_records_by_partition
from pipeline_assets.lib.silver.order import BatchEvents, Event

_NOT_FINISHED = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.SUSPENDED,
    DagsterRunStatus.CANCELING,
]


def batch_events(instance: DagsterInstance, gates: BatchGates) -> list[BatchEvents]:
    """Every registered batch, oldest first, with its latest bronze and silver materializations and
    attempts, and whether a blocking check of either blocks it."""
    unfinished = set(instance.get_run_ids(RunsFilter(statuses=_NOT_FINISHED)))
    bronze, silver = (
        _materializations(instance, key, unfinished) for key in (BRONZE_RECORDS, SILVER_RECORDS)
    )
    bronze_attempts, silver_attempts = (
        _attempts(instance, key, unfinished) for key in (BRONZE_RECORDS, SILVER_RECORDS)
    )
    blocked = gates.blocked_by_layer(instance)
    return [
        BatchEvents(
            batch,
            bronze=bronze.get(batch),
            bronze_attempt=bronze_attempts.get(batch),
            bronze_blocked=batch in blocked.get("bronze", ()),
            silver=silver.get(batch),
            silver_attempt=silver_attempts.get(batch),
            silver_blocked=batch in blocked.get("silver", ()),
        )
        for batch in sorted(instance.get_dynamic_partitions(ingest_batches.name))
    ]


def _materializations(
    instance: DagsterInstance, key: AssetKey, unfinished: set[str]
) -> dict[str, Event]:
    """Per batch, the latest materialization of ``key``."""
    return {
        batch: Event(r.storage_id, r.run_id, r.run_id not in unfinished)
        for batch, r in latest_records_by_partition(instance, key).items()
    }


def _attempts(instance: DagsterInstance, key: AssetKey, unfinished: set[str]) -> dict[str, Event]:
    """Per batch, the latest planned materialization of ``key`` newer than its latest
    materialization."""
    storage = instance.event_log_storage
    attempts = storage.get_latest_asset_partition_materialization_attempts_without_materializations(
        key
    )
    return {
        batch: Event(storage_id, run_id, run_id not in unfinished)
        for batch, (run_id, storage_id) in attempts.items()
    }
