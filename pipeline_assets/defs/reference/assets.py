"""reference/eval_sets: benchmark items the data must not contain (maintained outside the pipeline).

An observable source: its data version is the sha256 of its files, so a changed benchmark shows
silver as stale ("upstream data changed") until `pipeline-assets backfill-decontamination` redoes
it.
"""

from dagster import (
    AssetSelection,
    DagsterInstance,
    DataVersion,
    DefaultSensorStatus,
    EventLogRecord,
    ObserveResult,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    observable_source_asset,
    sensor,
)

from pipeline_assets.defs.keys import REFERENCE_EVAL_SETS
from pipeline_assets.resources.eval_sets import EvalSetsResource

_DATA_VERSION_TAG = "dagster/data_version"  # the tag an observation's data version is stored under


@observable_source_asset(
    key=REFERENCE_EVAL_SETS,
    description="Benchmark items (JSONL: eval_set, item_id, prompt, response) under "
    "PIPELINE_EVAL_SETS_URI. Silver decontaminates against them; evaluation scores on them. Data "
    "version: sha256 of the files.",
    group_name="reference",
    tags={"dagster/kind/jsonl": ""},
)
def eval_sets(eval_sets: EvalSetsResource) -> ObserveResult:
    files = eval_sets.files()
    items = eval_sets.items(files)  # a malformed file fails the observation, naming file and line
    counts = items.group_by("eval_set").len("items").sort("eval_set")
    return ObserveResult(
        data_version=DataVersion(eval_sets.fingerprint(files)),
        metadata={
            "uri": eval_sets.uri,
            "files": sorted(files),
            "items": items.height,
            "items_by_eval_set": dict(counts.iter_rows()),
        },
    )


observe_eval_sets_job = define_asset_job(
    "observe_eval_sets",
    selection=AssetSelection.assets(REFERENCE_EVAL_SETS),
    description="Observe reference/eval_sets: records the sha256 of its files as its data version.",
)


@sensor(
    name="eval_sets_watcher",
    job=observe_eval_sets_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests an observation of reference/eval_sets when its files' sha256 differs "
    "from the data version last observed (and once, when it was never observed).",
)
def eval_sets_watcher(context: SensorEvaluationContext, eval_sets: EvalSetsResource):
    current = eval_sets.fingerprint(eval_sets.files())
    latest = _latest_observation(context.instance)
    if latest is not None and current == _data_version(latest):
        return SkipReason(f"eval sets unchanged (data version {current[:12]})")
    # One request per change: the same files after the same observation give the same run key.
    after = latest.storage_id if latest else 0
    return RunRequest(run_key=f"{current}@after-{after}")


def observed_version(instance: DagsterInstance) -> str | None:
    """The data version reference/eval_sets was last observed at (None: never observed)."""
    latest = _latest_observation(instance)
    return None if latest is None else _data_version(latest)


def _latest_observation(instance: DagsterInstance) -> EventLogRecord | None:
    records = instance.fetch_observations(REFERENCE_EVAL_SETS, limit=1).records
    return records[0] if records else None


def _data_version(record: EventLogRecord) -> str | None:
    return record.asset_observation.tags.get(_DATA_VERSION_TAG)
