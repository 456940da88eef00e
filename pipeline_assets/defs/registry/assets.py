"""registry/model_version: register the candidate, alias it `challenger`, and move `champion` to it
only when the promotion gate passes."""

import json
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from pipeline_assets.defs.automation import after_upstream_passes
from pipeline_assets.defs.base_models import RUN_TAGS as BASE_MODEL_TAGS
from pipeline_assets.defs.keys import (
    EVALUATION_REPORT,
    MODEL_ARTIFACT_PATH,
    REGISTRY_MODEL_VERSION,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.policies import CostPolicy, RegistryPolicy
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.snapshots import (
    data_compute_behind,
    partition_metadata,
    snapshot_versions,
)
from pipeline_assets.lib.ops.cost import Compute, model_version_cost
from pipeline_assets.lib.training.promotion import (
    OVERALL,
    GateDecision,
    champion_moved,
    promotion_gate,
)
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.mlflow_tracking import MlflowResource

PROMOTION_GATE = "promotion_gate"


@asset(
    key=REGISTRY_MODEL_VERSION,
    group_name="registry",
    deps=[EVALUATION_REPORT, TRAINING_CHECKPOINT],
    partitions_def=data_snapshots,
    kinds={"mlflow"},
    automation_condition=after_upstream_passes(),
    retry_policy=TRANSIENT,  # MLflow's SQLite takes one writer at a time
    # with evaluation/report: one of them at a time (the instance's pool limit)
    pool="model_registry",
    check_specs=[
        AssetCheckSpec(
            PROMOTION_GATE,
            asset=REGISTRY_MODEL_VERSION,
            blocking=True,
            description="The candidate beats the champion by the margin overall and regresses no "
            "slice beyond the tolerance (a first fine-tune: beats its base model by the same "
            "rule; a first model from scratch: beats the uniform baseline). Only then "
            "does `champion` move.",
        )
    ],
    description="The trained model as an MLflow registered model version (aliases, never stages), "
    "with the snapshot's lineage in its tags.",
)
def registry_model_version(
    context: AssetExecutionContext,
    lake: LakeResource,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    cost_policy: CostPolicy,
) -> MaterializeResult:
    partition = context.partition_key
    versions = snapshot_versions(context.instance, partition)
    trained = partition_metadata(context.instance, TRAINING_CHECKPOINT, partition)
    report = lake.read("evaluation", "report", where=pl.col("partition") == partition)
    if trained is None or report is None or report.is_empty():
        raise Failure(
            allow_retries=False,
            description=f"{partition} has no training run or evaluation report yet",
        )
    losses = {
        role: dict(report.filter(pl.col("model") == role).select("slice", "loss").iter_rows())
        for role in ("candidate", "champion", "base_model")
    }
    name = registry_policy.model_name
    training = Compute(
        float(trained.get("cpu_seconds") or 0), float(trained.get("gpu_seconds") or 0)
    )
    cost = model_version_cost(
        training, data_compute_behind(context.instance, partition), cost_policy.prices()
    )
    version = mlflow_tracking.registered_version(
        name,
        trained["mlflow_run_id"],
        MODEL_ARTIFACT_PATH,
        tags={
            "cost_usd": json.dumps(cost, sort_keys=True),
            "partition": partition,
            "git_commit": trained.get("git_commit"),
            "dagster_run_id": context.run_id,
            **{f"delta.{table}": v for table, v in versions.items()},
            **{tag: trained[tag] for tag in BASE_MODEL_TAGS if tag in trained},
            **{
                f"loss.{slice_name}": round(loss, 5)
                for slice_name, loss in losses["candidate"].items()
            },
        },
    )
    evaluated = partition_metadata(context.instance, EVALUATION_REPORT, partition) or {}
    measured = evaluated.get("champion_at_evaluation", _scored_champion(report))
    judged = judge_and_promote(
        context,
        lake,
        mlflow_tracking,
        name,
        version,
        measured,
        lambda champion: _decide(losses, champion, lake, versions, registry_policy),
    )
    return MaterializeResult(
        metadata={
            "model_name": name,
            "model_version": version,
            **judged.metadata(),
            "mlflow_run": MetadataValue.url(mlflow_tracking.run_url(trained["mlflow_run_id"])),
            "candidate_loss": losses["candidate"][OVERALL],
            "cost_usd": cost["total_usd"],
            "cost": MetadataValue.json(cost),
        },
        check_results=[judged.gate_result()],
    )


def _scored_champion(report: pl.DataFrame) -> str | None:
    """The champion version the report scored (reports written before evaluation recorded the
    champion it saw)."""
    scored = report.filter(pl.col("model") == "champion")["model_version"].unique().to_list()
    return scored[0] if scored else None


def _decide(
    losses: dict, champion: str | None, lake: LakeResource, versions: dict, policy: RegistryPolicy
) -> GateDecision:
    if champion is not None and not losses["champion"]:
        # Scored on other tokens (another tokenizer): never beaten automatically; promote by hand.
        return GateDecision(
            False,
            f"champion v{champion} could not be scored on the same rows (see "
            "evaluation/report): compare by hand and use `pipeline-assets promote`",
        )
    if champion is None and losses["base_model"]:  # a first fine-tune: against its base model
        return promotion_gate(
            losses["candidate"],
            losses["base_model"],
            vocab_size=None,
            margin=policy.promotion_margin,
            slice_tolerance=policy.slice_tolerance,
            against="the base model",
        )
    vocab_size = None
    if champion is None:  # a first model is judged against the uniform baseline over the vocabulary
        vocab_size = int(
            lake.read("gold", "tokenizer", version=versions["gold/tokenizer"])["vocab_size"][0]
        )
    return promotion_gate(
        losses["candidate"],
        losses["champion"] if champion is not None else None,
        vocab_size=vocab_size,
        margin=policy.promotion_margin,
        slice_tolerance=policy.slice_tolerance,
    )


@dataclass(frozen=True)
class Judged:
    """A registered version after the promotion gate: the decision, and where `champion` points
    now."""

    version: str
    measured: str | None  # the champion the evaluation scored
    previous: str | None  # the champion when the gate ran
    decision: GateDecision

    @property
    def promoted(self) -> bool:
        return self.decision.passed and self.previous != self.version

    def metadata(self) -> dict:
        return {
            "champion_version": self.version if self.decision.passed else self.previous,
            "champion_at_evaluation": self.measured,
            "promoted": self.promoted,
            "gate": self.decision.reason,
        }

    def gate_result(self) -> AssetCheckResult:
        return AssetCheckResult(
            check_name=PROMOTION_GATE,
            passed=self.decision.passed,
            severity=AssetCheckSeverity.ERROR,
            description=self.decision.reason,
            metadata={
                k: MetadataValue.json(v) if isinstance(v, dict) else v
                for k, v in self.decision.numbers.items()
            },
        )


def judge_and_promote(
    context: AssetExecutionContext,
    lake: LakeResource,
    mlflow_tracking: MlflowResource,
    name: str,
    version: str,
    measured: str | None,
    decide: Callable[[str | None], GateDecision],
) -> Judged:
    """Alias ``version`` `challenger`; then, holding the registry's lock (the CLI takes it too),
    judge it with ``decide(champion)`` and move `champion` to it when the gate passes. Numbers
    measured against a champion other than the current one (``measured``) judge nothing: the gate
    refuses."""
    mlflow_tracking.set_alias(name, "challenger", version)
    with lake.lock("registry", name):
        current = mlflow_tracking.version_by_alias(name, "champion")
        previous = str(current.version) if current else None
        moved = champion_moved(seen=measured, current=previous, candidate=version)
        if moved:
            decision = GateDecision(
                False, moved, {"champion_at_evaluation": measured, "champion_now": previous}
            )
        elif previous == version:
            decision = GateDecision(True, f"v{version} is already the champion")
        else:
            decision = decide(previous)
        judged = Judged(version, measured, previous, decision)
        if judged.promoted:
            mlflow_tracking.move_champion(
                name, version, by=f"gate, dagster run {context.run_id}", reason=decision.reason
            )
    context.log.info(
        f"{name} v{version}: {'champion' if decision.passed else 'challenger only'}: "
        f"{decision.reason}"
    )
    return judged
