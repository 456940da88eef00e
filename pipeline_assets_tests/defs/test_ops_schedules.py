"""The nightly retrain schedule and the run-failure recorder."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from dagster import (
    DagsterEventType,
    DagsterInstance,
    DefaultScheduleStatus,
    Failure,
    RunRequest,
    SkipReason,
    asset,
    build_run_status_sensor_context,
    build_schedule_context,
    materialize,
)

from pipeline_assets.defs.ops.schedules import nightly_retrain, run_failure_recorder
from pipeline_assets.defs.partitions import data_snapshots

NIGHT = datetime(2026, 11, 22, 2, 0, tzinfo=timezone.utc)


@pytest.mark.sqlite_instance  # a schedule's context rebuilds the instance from its reference
def test_the_nightly_retrain_is_off_by_default_and_picks_the_newest_snapshot(
    instance: DagsterInstance,
):
    assert nightly_retrain.default_status == DefaultScheduleStatus.STOPPED
    empty = nightly_retrain(
        build_schedule_context(instance=instance, scheduled_execution_time=NIGHT)
    )
    assert isinstance(empty, SkipReason)

    instance.add_dynamic_partitions(data_snapshots.name, ["gold-v2", "gold-v10", "gold-v9"])
    request = nightly_retrain(
        build_schedule_context(instance=instance, scheduled_execution_time=NIGHT)
    )
    assert isinstance(request, RunRequest)
    assert request.partition_key == "gold-v10" and request.run_key == "gold-v10-2026-11-22"


@asset
def breaks():
    raise Failure(description="the landing bucket is unreachable")


def test_a_failed_run_is_recorded_in_the_lake(instance: DagsterInstance, lake):
    result = materialize([breaks], instance=instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == DagsterEventType.RUN_FAILURE)
    context = build_run_status_sensor_context(
        sensor_name="run_failure_recorder",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(result.run_id),
        resources={"lake": lake},
    ).for_run_failure()
    run_failure_recorder(context)
    recorded = lake.read("ops", "run_failures")
    assert recorded.height == 1
    row = recorded.row(0, named=True)
    assert row["run_id"] == result.run_id and row["failed_steps"] == "breaks"
    assert "the landing bucket is unreachable" in row["error"], (
        "the step's own error, not only 'run failed'"
    )
