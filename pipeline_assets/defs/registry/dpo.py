"""registry/dpo_model_version: register the DPO candidate as a version of `dpo-model`, alias it
`challenger`, and move `champion` only when the preference gate passes (the same mechanics as
registry/model_version)."""

import polars as pl
from dagster import (
    AssetCheckSpec,
    AssetExecutionContext,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from pipeline_assets.defs.automation import after_upstream_passes
from pipeline_assets.defs.base_models import REFERENCE_PREFIX
from pipeline_assets.defs.base_models import RUN_TAGS as BASE_MODEL_TAGS
from pipeline_assets.defs.keys import (
    EVALUATION_DPO_REPORT,
    MODEL_ARTIFACT_PATH,
    REGISTRY_DPO_MODEL_VERSION,
    SFT_SLICE,
    TRAINING_DPO_CHECKPOINT,
)
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.registry.assets import PROMOTION_GATE, judge_and_promote
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.snapshots import partition_metadata
from pipeline_assets.lib.training.promotion import (
    OVERALL,
    GateDecision,
    PreferenceScore,
    preference_gate,
)
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.mlflow_tracking import MlflowResource


@asset(
    key=REGISTRY_DPO_MODEL_VERSION,
    group_name="registry",
    deps=[EVALUATION_DPO_REPORT, TRAINING_DPO_CHECKPOINT],
    partitions_def=preference_snapshots,
    kinds={"mlflow"},
    automation_condition=after_upstream_passes(),
    retry_policy=TRANSIENT,  # MLflow's SQLite takes one writer at a time
    pool="model_registry",
    check_specs=[
        AssetCheckSpec(
            PROMOTION_GATE,
            asset=REGISTRY_DPO_MODEL_VERSION,
            blocking=True,
            description="The candidate's sft validation loss stays within the slice tolerance of "
            "the sft champion's, and it beats the DPO champion on held-out pairs (preference "
            "accuracy by the margin, or level accuracy and a wider mean reward margin) without any "
            "source losing more accuracy than the tolerance (a first model: beats chance). Only "
            "then does `champion` move.",
        )
    ],
    description="The DPO model as an MLflow registered model version of `dpo-model` (aliases, "
    "never stages), with the preference snapshot's Delta versions and the sft model it started "
    "from in its tags.",
)
def registry_dpo_model_version(
    context: AssetExecutionContext,
    lake: LakeResource,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
) -> MaterializeResult:
    partition = context.partition_key
    trained = partition_metadata(context.instance, TRAINING_DPO_CHECKPOINT, partition)
    evaluated = partition_metadata(context.instance, EVALUATION_DPO_REPORT, partition)
    report = lake.read(*EVALUATION_DPO_REPORT.path, where=pl.col("partition") == partition)
    if trained is None or evaluated is None or report is None or report.is_empty():
        raise Failure(
            allow_retries=False,
            description=f"{partition} has no DPO training run or evaluation/dpo_report yet",
        )
    scores = {role: _preference_scores(report, role) for role in ("candidate", "champion")}
    sft_losses = _sft_losses(report)
    name = registry_policy.dpo_model_name
    version = mlflow_tracking.registered_version(
        name,
        trained["mlflow_run_id"],
        MODEL_ARTIFACT_PATH,
        tags=_version_tags(context, trained, evaluated, scores),
    )

    def decide(champion: str | None) -> GateDecision:
        if (
            champion is not None and not scores["champion"]
        ):  # another tokenizer: never beaten automatically
            return GateDecision(
                False,
                f"champion v{champion} could not be scored on the same pairs (see "
                "evaluation/dpo_report): compare by hand and use `pipeline-assets promote`",
            )
        return preference_gate(
            scores["candidate"],
            scores["champion"] if champion is not None else None,
            sft_losses=sft_losses,
            margin=registry_policy.promotion_margin,
            slice_tolerance=registry_policy.slice_tolerance,
            sft_champion_behind=not trained["reference_model"].startswith(REFERENCE_PREFIX),
        )

    judged = judge_and_promote(
        context,
        lake,
        mlflow_tracking,
        name,
        version,
        evaluated.get("champion_at_evaluation"),
        decide,
    )
    return MaterializeResult(
        metadata={
            "model_name": name,
            "model_version": version,
            **judged.metadata(),
            "reference_model": trained.get("reference_model"),
            "mlflow_run": MetadataValue.url(mlflow_tracking.run_url(trained["mlflow_run_id"])),
            "candidate_preference_accuracy": scores["candidate"][OVERALL].accuracy,
            "candidate_mean_margin": scores["candidate"][OVERALL].mean_margin,
        },
        check_results=[judged.gate_result()],
    )


def _preference_scores(report: pl.DataFrame, role: str) -> dict[str, PreferenceScore]:
    rows = report.filter((pl.col("model") == role) & (pl.col("slice") != SFT_SLICE))
    return {
        row["slice"]: PreferenceScore(row["preference_accuracy"], row["mean_margin"])
        for row in rows.iter_rows(named=True)
    }


def _sft_losses(report: pl.DataFrame) -> tuple[float, float] | None:
    """(candidate's, sft champion's) sft validation loss, when the report compared them."""
    sft = dict(report.filter(pl.col("slice") == SFT_SLICE).select("model", "loss").iter_rows())
    return (sft["candidate"], sft["champion"]) if {"candidate", "champion"} <= sft.keys() else None


def _version_tags(
    context: AssetExecutionContext, trained: dict, evaluated: dict, scores: dict
) -> dict:
    """What lineage and retention read: the snapshot, the Delta versions behind it, the sft model it
    started from."""
    versions = {
        **(evaluated.get("upstream_delta_versions") or {}),
        **(trained.get("upstream_delta_versions") or {}),
    }
    return {
        "partition": context.partition_key,
        "reference_model": trained.get("reference_model"),
        "git_commit": trained.get("git_commit"),
        "dagster_run_id": context.run_id,
        **{f"delta.{table}": v for table, v in versions.items() if v is not None},
        **{tag: trained[tag] for tag in BASE_MODEL_TAGS if tag in trained},
        **{
            f"preference_accuracy.{name}": round(score.accuracy, 5)
            for name, score in scores["candidate"].items()
        },
    }
