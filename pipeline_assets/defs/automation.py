"""How downstream layers follow upstream ones without a click (the README's asset graph)."""

from dagster import (
    AssetSelection,
    AutomationCondition,
    AutomationConditionSensorDefinition,
    DefaultSensorStatus,
)

from pipeline_assets.defs.keys import REFERENCE_BASE_MODEL, REFERENCE_EVAL_SETS

# Maintained outside the pipeline and observed, never materialized: never a "missing" dependency.
REFERENCE_SOURCES = AssetSelection.assets(REFERENCE_EVAL_SETS, REFERENCE_BASE_MODEL)


def after_upstream_passes() -> AutomationCondition:
    """Materialize when an upstream partition updates, unless a blocking check on it failed.

    The reference sources (eval sets, base model) are maintained outside the pipeline and never
    materialized, so they must not hold the flow back as a "missing" dependency.
    """
    return (
        AutomationCondition.eager().ignore(REFERENCE_SOURCES)
        & AutomationCondition.all_deps_blocking_checks_passed()
    )


# Dagster ships its default automation sensor stopped; new landing data must flow on its own.
automation_sensor = AutomationConditionSensorDefinition(
    "pipeline_automation",
    target=AssetSelection.all(),
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Evaluates every asset's automation condition: downstream layers follow upstream "
    "ones.",
)


ONCE_WHEN_MISSING = "once_when_missing"


def once_when_missing() -> AutomationCondition:
    """Materialize when missing, on the tick an upstream partition updates (so alongside what
    that update triggers downstream); once it exists, only by hand."""
    return (
        AutomationCondition.missing()
        & AutomationCondition.any_deps_updated()
        & ~AutomationCondition.in_progress()
    ).with_label(ONCE_WHEN_MISSING)
