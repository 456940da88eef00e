"""ops/pipeline_report: per stage, how fast and how costly the latest pass was, and the
bottleneck."""

from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AutomationCondition,
    DagsterInstance,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from pipeline_assets.contracts import PipelineStage, conform, validate
from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_REPORT,
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
    OPS_PIPELINE_REPORT,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.ops.stages import PIPELINE_STAGES, MeasuredStage
from pipeline_assets.defs.policies import CostPolicy
from pipeline_assets.defs.retries import refusal
from pipeline_assets.defs.snapshots import (
    behind_snapshot,
    latest_materialization_metadata,
    latest_per_partition,
    materialization_history,
    partition_metadata,
)
from pipeline_assets.lib.drift import against_trailing_median
from pipeline_assets.lib.ops.charts import time_breakdown_png
from pipeline_assets.lib.ops.cost import MEASURED, bottleneck, headline_throughput, stage_report
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher


def report_waits(instance: DagsterInstance) -> str | None:
    """Why the report cannot be made yet (it reports on a data snapshot), or None."""
    if instance.get_latest_materialization_event(GOLD_SNAPSHOTS) is None:
        return "no data snapshot was cut yet (gold/snapshots)"
    return None


@asset(
    key=OPS_PIPELINE_REPORT,
    group_name="ops",
    deps=[
        BRONZE_RECORDS,
        SILVER_RECORDS,
        GOLD_TOKENIZER,
        GOLD_SNAPSHOTS,
        TRAINING_CHECKPOINT,
        EVALUATION_REPORT,
    ],
    kinds={"delta", "polars"},
    automation_condition=AutomationCondition.on_cron(
        "0 * * * *"
    ),  # hourly, once its stages have updated
    description="Per stage of the latest pass (every batch's bronze and silver, the newest "
    "snapshot's gold shards, training and evaluation): rows/s, MB/s, tokens/s, wall and CPU "
    "seconds, cost and $ per million tokens; the bottleneck.",
)
def pipeline_report(
    context: AssetExecutionContext,
    lake: LakeResource,
    cost_policy: CostPolicy,
    launcher: TorchrunLauncher,
) -> MaterializeResult:
    waits = report_waits(context.instance)
    if waits:
        raise refusal(f"nothing to report: {waits}")
    gold = latest_materialization_metadata(context.instance, GOLD_SNAPSHOTS, lambda m: True)
    snapshot = gold["data_snapshot"]
    measured = pl.DataFrame(measure_stages(context.instance, snapshot), schema=MEASURED)
    report = stage_report(
        measured, cost_policy.prices(), dataset_tokens=int(gold.get("tokens") or 0)
    )
    report_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    rows = report.join(headline_throughput(report), on="stage").with_columns(
        report_id=pl.lit(report_id), snapshot=pl.lit(snapshot)
    )
    lake.append("ops", "pipeline_report", validate(conform(rows, PipelineStage), PipelineStage))
    slowest = bottleneck(report)
    picture = time_breakdown_png(
        report["stage"].to_list(),
        report["wall_seconds"].to_list(),
        report["cost_usd"].to_list(),
        Path(launcher.scratch()) / "reports" / f"pipeline_report-{report_id}.png",
        f"where the time goes ({snapshot}); bottleneck: {slowest}",
    )
    total_cost = float(report["cost_usd"].sum())
    context.log.info(f"bottleneck: {slowest}; ${total_cost:.4f} for {snapshot}")
    return MaterializeResult(
        metadata={
            "report_id": report_id,
            "snapshot": snapshot,
            "bottleneck": slowest,
            "wall_seconds": round(float(report["wall_seconds"].sum()), 2),
            "cost_usd": round(total_cost, 6),
            "usd_per_million_tokens": round(float(report["usd_per_million_tokens"].sum()), 6),
            "stages": table_metadata(
                rows.select(
                    "stage",
                    "throughput",
                    "unit",
                    "wall_seconds",
                    "cpu_seconds",
                    "gpu_seconds",
                    "rows_per_second",
                    "mb_per_second",
                    "tokens_per_second",
                    "cost_usd",
                    "usd_per_million_tokens",
                    "share_of_wall",
                ).with_columns(pl.col(pl.Float64).round(4))
            ),
            "picture": MetadataValue.path(str(picture)),
        }
    )


def measure_stages(instance: DagsterInstance, snapshot: str) -> list[dict]:
    """What each stage's latest materializations recorded, summed over ingest batches."""
    measured = {  # what a stage's latest pass is, per stage
        "bronze": lambda key: latest_per_partition(materialization_history(instance, key)),
        "silver": lambda key: latest_per_partition(materialization_history(instance, key)),
        "gold/tokenizer": lambda key: [
            latest_materialization_metadata(instance, key, lambda m: True)
        ],
        "gold/sequences": lambda key: behind_snapshot(instance, snapshot).shards,
        "training": lambda key: [partition_metadata(instance, key, snapshot)],
        "evaluation": lambda key: [partition_metadata(instance, key, snapshot)],
    }
    stages = [_stage(stage, measured[stage.name](stage.asset)) for stage in PIPELINE_STAGES]
    return [stage for stage in stages if stage is not None]


def _stage(stage: MeasuredStage, materializations: list[dict | None]) -> dict | None:
    name, tokens = stage.name, stage.tokens
    found = [m for m in materializations if m]
    if not found:
        return None

    def total(field: str) -> float:
        return float(sum(m.get(field) or 0 for m in found))

    return {
        "stage": name,
        "rows": int(total("dagster/row_count")),
        "input_mb": total("input_mb"),
        "tokens": int(total(tokens)) if tokens else 0,
        "wall_seconds": total("wall_seconds"),
        "cpu_seconds": total("cpu_seconds"),
        "gpu_seconds": total("gpu_seconds"),
    }


@asset_check(
    asset=OPS_PIPELINE_REPORT,
    name="stage_throughput",
    description="Warns when a stage's throughput falls more than the threshold (default 30%) below "
    "the median of its earlier reports, naming the stage.",
)
def stage_throughput(
    context: AssetCheckExecutionContext, lake: LakeResource, cost_policy: CostPolicy
) -> AssetCheckResult:
    history = lake.read("ops", "pipeline_report")
    latest = history["report_id"].max()
    compared = against_trailing_median(
        history.rename({"report_id": "batch_id", "stage": "source"}),
        latest,
        "throughput",
        cost_policy.trailing_reports,
    ).rename({"source": "stage"})
    slower = compared.filter(pl.col("deviation") < -cost_policy.max_throughput_drop)
    description = (
        "; ".join(
            f"{r['stage']} at {r['current']:,.1f} against a median of {r['baseline']:,.1f} "
            f"({r['deviation']:+.0%})"
            for r in slower.iter_rows(named=True)
        )
        or "every stage within its usual throughput"
    )
    return AssetCheckResult(
        passed=slower.is_empty(),
        severity=AssetCheckSeverity.WARN,
        description=description,
        metadata={
            "slower_stages": MetadataValue.json(slower["stage"].to_list()),
            "compared": table_metadata(compared.with_columns(pl.col(pl.Float64).round(3))),
        },
    )
