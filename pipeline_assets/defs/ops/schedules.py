"""The nightly retrain (off by default) and the sensor that records failed runs where users look."""

from datetime import datetime, timezone

import polars as pl
from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunFailureSensorContext,
    RunRequest,
    ScheduleEvaluationContext,
    SkipReason,
    define_asset_job,
    run_failure_sensor,
    schedule,
)

from pipeline_assets.contracts import RunFailure, conform, validate
from pipeline_assets.defs.keys import EVALUATION_REPORT, REGISTRY_MODEL_VERSION, TRAINING_CHECKPOINT
from pipeline_assets.defs.partitions import data_snapshots, snapshot_number
from pipeline_assets.resources.lake import LakeResource

retrain_job = define_asset_job(
    "retrain_latest_snapshot",
    selection=AssetSelection.assets(TRAINING_CHECKPOINT, EVALUATION_REPORT, REGISTRY_MODEL_VERSION),
    partitions_def=data_snapshots,
    description="Train, evaluate and register one data snapshot (a new materialization: from step "
    "0).",
)


@schedule(
    job=retrain_job,
    cron_schedule="0 2 * * *",
    execution_timezone="UTC",
    # a retrain costs GPU hours: turned on deliberately
    default_status=DefaultScheduleStatus.STOPPED,
    description="Every night at 02:00 UTC, train the newest data snapshot (only snapshots whose "
    "blocking checks passed exist) unless it is already trained; the registry's gate decides "
    "whether the result replaces the champion.",
)
def nightly_retrain(context: ScheduleEvaluationContext):
    snapshots = context.instance.get_dynamic_partitions(data_snapshots.name)
    if not snapshots:
        return SkipReason("no data snapshot yet: gold/sequences has never been materialized")
    newest = max(snapshots, key=snapshot_number)
    if newest in context.instance.get_materialized_partitions(TRAINING_CHECKPOINT):
        reason = (
            f"{newest}, the newest snapshot, is already trained: the same rows, seed and settings "
            "would train the same model; a new snapshot (cut on its cadence) is what a retrain "
            "needs"
        )
        context.log.info(reason)
        return SkipReason(reason)
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    return RunRequest(
        run_key=f"{newest}-{night}",
        partition_key=newest,
        tags={"pipeline/trigger": "nightly_retrain"},
    )


@run_failure_sensor(
    name="run_failure_recorder",
    monitor_all_code_locations=False,
    default_status=DefaultSensorStatus.RUNNING,
    description="Appends every failed run (job, partition, failed steps, the error) to the Delta "
    "table ops/run_failures and logs it on the sensor's tick.",
)
def run_failure_recorder(context: RunFailureSensorContext, lake: LakeResource):
    run = context.dagster_run
    step_failures = context.get_step_failure_events()
    failed_steps = sorted({event.step_key for event in step_failures if event.step_key})
    reasons = [
        f"{event.step_key}: {event.step_failure_data.error.message.strip()}"
        for event in step_failures
        if event.step_failure_data.error
    ]
    row = pl.DataFrame(
        {
            "run_id": [run.run_id],
            "job_name": [run.job_name],
            "partition": [run.tags.get("dagster/partition")],
            "failed_steps": [",".join(failed_steps)],
            "error": ["\n".join([context.failure_event.message or "", *reasons])[:4000]],
            "failed_at": [datetime.now(timezone.utc)],
        }
    )
    lake.append("ops", "run_failures", validate(conform(row, RunFailure), RunFailure))
    context.log.warning(
        f"run {run.run_id} ({run.job_name}) failed at {', '.join(failed_steps) or 'the run level'}"
    )
