"""silver_in_order: silver for one ingest batch at a time, oldest first, skipping blocked
batches."""

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    sensor,
)

from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.keys import SILVER_MINHASH_BANDS, SILVER_MINHASH_INDEX, SILVER_REJECTS
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.silver.order import batch_events
from pipeline_assets.lib.silver.order import next_batch

SILVER_SELECTION = AssetSelection.assets(
    *(tables.silver for tables in FORMAT_TABLES),
    SILVER_REJECTS,
    SILVER_MINHASH_INDEX,
    SILVER_MINHASH_BANDS,
)

silver_job = define_asset_job(
    "silver_batch",
    selection=SILVER_SELECTION,
    partitions_def=ingest_batches,
    description="Silver (and its checks) for one ingest batch: what silver_in_order requests.",
)


@sensor(
    name="silver_in_order",
    target=silver_job,
    minimum_interval_seconds=5,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests silver for the oldest batch whose bronze passed and whose silver is "
    "missing or older, once every earlier batch is done or excluded (blocked, or its run failed), "
    "and never while a silver run is queued or running.",
)
def silver_in_order(context: SensorEvaluationContext, batch_gates: BatchGates):
    decision = next_batch(batch_events(context.instance, batch_gates))
    if decision.batch is None:
        return SkipReason(decision.reason)
    context.log.info(decision.reason)
    batch = decision.batch
    # One request per bronze materialization: the daemon never launches it twice, and new bronze
    # asks again.
    return RunRequest(
        partition_key=batch.batch_id, run_key=f"{batch.batch_id}@bronze-{batch.bronze.storage_id}"
    )
