"""When data snapshots are cut: on a cadence (new silver text), on a schedule, or by hand;
preference snapshots on their own cadence (new pairs), by the same rule."""

from collections.abc import Callable

from dagster import (
    AssetSelection,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    schedule,
    sensor,
)

from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.gold.cadence import (
    PREFERENCE_SERIES,
    SNAPSHOT_REASON_TAG,
    SnapshotDecision,
    SnapshotSeries,
    snapshot_decision,
)
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import GOLD_PREFERENCE_SNAPSHOTS, GOLD_SNAPSHOTS
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.mlflow_tracking import MlflowResource

snapshot_job = define_asset_job(
    "cut_snapshot",
    selection=AssetSelection.assets(GOLD_SNAPSHOTS),
    description="Cut a data snapshot from every usable gold shard (gold/snapshots and its checks).",
)


@sensor(
    name="snapshot_cadence",
    target=snapshot_job,
    minimum_interval_seconds=10,
    default_status=DefaultSensorStatus.RUNNING,
    description="Cuts the first snapshot once a gold shard exists, then a new one whenever the "
    "tokens of the shards built since the last cut reach PIPELINE_SNAPSHOT_MIN_NEW_FRACTION of the "
    "last snapshot's.",
)
def snapshot_cadence(
    context: SensorEvaluationContext, gold_policy: GoldPolicy, batch_gates: BatchGates
):
    decision = snapshot_decision(
        context.instance, batch_gates, gold_policy.snapshot_min_new_fraction
    )
    if not decision.due:
        return SkipReason(decision.reason)
    context.log.info(decision.reason)
    return RunRequest(
        run_key=f"snapshot@{decision.state}", tags={SNAPSHOT_REASON_TAG: decision.reason}
    )


preference_snapshot_job = define_asset_job(
    "cut_preference_snapshot",
    selection=AssetSelection.assets(GOLD_PREFERENCE_SNAPSHOTS),
    description="Cut a preference snapshot (dpo-v<N>) from every usable gold/preference_sequences "
    "shard.",
)


@sensor(
    name="preference_snapshot_cadence",
    target=preference_snapshot_job,
    minimum_interval_seconds=10,
    default_status=DefaultSensorStatus.RUNNING,
    description="Once an sft champion exists (DPO's reference and starting point), or at once with "
    "a base model (PIPELINE_BASE_MODEL), cuts the first "
    "preference snapshot once a shard of pairs exists, then a new one whenever the tokens of the "
    "shards built since the last cut reach PIPELINE_SNAPSHOT_MIN_NEW_FRACTION of the last "
    "snapshot's.",
)
def preference_snapshot_cadence(
    context: SensorEvaluationContext,
    gold_policy: GoldPolicy,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    batch_gates: BatchGates,
    base_model: BaseModelResource,
):
    decision, waiting = snapshot_waits(
        context.instance,
        PREFERENCE_SERIES,
        gold_policy,
        batch_gates,
        lambda: no_reference_model(mlflow_tracking, registry_policy, base_model),
    )
    if waiting:
        return SkipReason(waiting)
    context.log.info(decision.reason)
    return RunRequest(
        run_key=f"preference-snapshot@{decision.state}", tags={SNAPSHOT_REASON_TAG: decision.reason}
    )


def snapshot_waits(
    instance: DagsterInstance,
    series: SnapshotSeries,
    gold_policy: GoldPolicy,
    batch_gates: BatchGates,
    reference_model_wait: Callable[[], str | None],
) -> tuple[SnapshotDecision, str | None]:
    """The series' cadence decision, and why its next snapshot waits (None: cut it now). A
    preference snapshot also waits for DPO's reference model (``no_reference_model``), asked only
    once the cadence says one is due: MLflow's client costs a command about 2 s to start, and an
    sft-only code location need not define MLflow at all."""
    decision = snapshot_decision(
        instance, batch_gates, gold_policy.snapshot_min_new_fraction, series
    )
    if not decision.due:
        return decision, decision.reason
    if series is PREFERENCE_SERIES:
        return decision, reference_model_wait()
    return decision, None


def no_reference_model(
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    base_model: BaseModelResource,
) -> str | None:
    """Why preference snapshots wait (no sft champion, nor a base model, to be DPO's reference and
    starting point), or None."""
    if base_model.configured:
        return None  # DPO starts from the sft champion, else from the base model
    if mlflow_tracking.version_by_alias(registry_policy.model_name, "champion") is not None:
        return None
    return (
        f"no {registry_policy.model_name} champion yet: a preference snapshot waits for one, since "
        "its reference pass and DPO start from it (or set PIPELINE_BASE_MODEL: DPO then starts "
        "from the base model)"
    )


@schedule(
    job=snapshot_job,
    cron_schedule="0 1 * * *",
    execution_timezone="UTC",
    default_status=DefaultScheduleStatus.STOPPED,
    description="Every night at 01:00 UTC, a snapshot of whatever shards were built since the last "
    "one, however little (turn it on for a fixed cadence; the sensor's share rule keeps running "
    "beside it).",
)
def snapshot_schedule(context: ScheduleEvaluationContext, batch_gates: BatchGates):
    decision = snapshot_decision(context.instance, batch_gates, min_new_fraction=0.0)
    if not decision.due:
        return SkipReason(decision.reason)
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    return RunRequest(
        run_key=f"snapshot-schedule-{night}",
        tags={SNAPSHOT_REASON_TAG: f"schedule: {decision.reason}"},
    )
