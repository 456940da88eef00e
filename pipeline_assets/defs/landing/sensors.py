"""landing_sensor: new landing files become an ingest batch (a dynamic partition) and a run."""

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.keys import BRONZE_QUARANTINE
from pipeline_assets.defs.landing.batches import BatchRegistration, discover_batches
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource


def _tags(batch: str, registration: BatchRegistration) -> dict[str, str]:
    """Changed files are named on the run, where users look, as well as in the tick log."""
    if batch != registration.batch_id:
        return {}
    tags = {"pipeline/new_files": str(len(registration.new_files))}
    if registration.changed_files:
        tags["pipeline/changed_files"] = ",".join(registration.changed_files)
    return tags


BRONZE_SELECTION = AssetSelection.assets(
    *(tables.bronze for tables in FORMAT_TABLES), BRONZE_QUARANTINE
)

# A named job: the sensor's target, and what clients submit (GraphQL, `dagster job launch`).
ingest_job = define_asset_job(
    "ingest_batch",
    selection=BRONZE_SELECTION,
    partitions_def=ingest_batches,
    description="Bronze for one ingest batch: what landing_sensor requests when files land.",
)


@sensor(
    name="landing_sensor",
    target=ingest_job,
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers new landing files as one ingest batch and requests its bronze run.",
)
def landing_sensor(context: SensorEvaluationContext, landing: LandingResource, lake: LakeResource):
    known = context.instance.get_dynamic_partitions(ingest_batches.name)
    registration, batches = discover_batches(landing, lake, known, context.log)
    if not batches:
        return SkipReason("no new landing files")
    return SensorResult(
        run_requests=[
            RunRequest(partition_key=batch, run_key=batch, tags=_tags(batch, registration))
            for batch in batches
        ],
        dynamic_partitions_requests=[ingest_batches.build_add_request(batches)],
    )
