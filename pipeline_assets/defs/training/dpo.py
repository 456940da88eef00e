"""training/dpo_checkpoint: one torchrun FSDP2 DPO job per preference snapshot, from the sft
champion the reference pass used, launched through Dagster Pipes like training/checkpoint."""

from pathlib import Path

from dagster import (
    AssetExecutionContext,
    AutomationCondition,
    Failure,
    MaterializeResult,
    MetadataValue,
    PipesSubprocessClient,
    RetryPolicy,
    asset,
)

from pipeline_assets.defs.base_models import (
    REFERENCE_PREFIX,
    reference_name,
    run_tags,
    tokenizer_base_model,
)
from pipeline_assets.defs.keys import (
    GOLD_PREFERENCE_SNAPSHOTS,
    GOLD_REFERENCE_LOGPS,
    TRAINING_DPO_CHECKPOINT,
)
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.retries import refusal
from pipeline_assets.defs.snapshots import partition_metadata
from pipeline_assets.defs.training.assets import TrainingRunConfig, train_and_export
from pipeline_assets.defs.training.policy import DpoPolicy
from pipeline_assets.lib.gold.encoder import EncoderSpec
from pipeline_assets.lib.gold.manifest import PREFERENCE_SNAPSHOTS, read_manifest, snapshot_number
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.config import TrainConfig, starting_flags


@asset(
    key=TRAINING_DPO_CHECKPOINT,
    group_name="training",
    deps=[GOLD_PREFERENCE_SNAPSHOTS, GOLD_REFERENCE_LOGPS],
    partitions_def=preference_snapshots,
    pool="training",  # one job at a time by default, sft's and DPO's together
    retry_policy=RetryPolicy(
        max_retries=2, delay=5
    ),  # a preempted job resumes from its newest checkpoint
    kinds={"pytorch", "mlflow"},
    automation_condition=AutomationCondition.on_missing()
    & AutomationCondition.all_deps_blocking_checks_passed(),
    description="A torchrun FSDP2 DPO job on one preference snapshot (dpo-v<N>): it starts from "
    "the model the reference pass scored with (gold/reference_logps names it: the sft champion, "
    "else the base model), reads the "
    "stored reference log-probabilities beside the rows, and ends with checkpoints, the exported "
    "model and an MLflow run, like training/checkpoint.",
)
def training_dpo_checkpoint(
    context: AssetExecutionContext,
    config: TrainingRunConfig,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    dpo_policy: DpoPolicy,
    mlflow_tracking: MlflowResource,
    pipes_subprocess_client: PipesSubprocessClient,
    base_model: BaseModelResource,
) -> MaterializeResult:
    partition = context.partition_key
    reference = partition_metadata(context.instance, GOLD_REFERENCE_LOGPS, partition)
    if reference is None:
        raise Failure(
            allow_retries=False,
            description=f"gold/reference_logps has no materialization for {partition}: "
            "run the reference pass first",
        )
    number = snapshot_number(partition, PREFERENCE_SNAPSHOTS)
    started_from = _base_model_started_from(lake, number, reference["reference_model"], base_model)
    if started_from is not None:
        init_from = Path(started_from.path)
    else:
        model_name, version = reference["reference_model"].rsplit("/", 1)
        folder = (
            Path(launcher.scratch()) / "dpo" / partition / "init"
        )  # the trainer reads it; kept for a resume
        init_from = mlflow_tracking.download_model(model_name, version, folder)
    architecture = starting_flags(init_from)
    train_config = TrainConfig(
        lake_uri=lake.uri,
        snapshot=number,
        checkpoint_uri=launcher.checkpoint_uri,
        partition=partition,
        objective="dpo",
        init_from=str(init_from),
        reference_logps_version=int(reference["delta_version"]),
        device=launcher.device,
        scratch_dir=launcher.scratch(),
        **{**dpo_policy.hyperparameters(), **architecture, **config.hyperparameter_overrides()},
    )
    context.log.info(
        f"DPO on {partition} from {reference['reference_model']}, reference log-probabilities of "
        f"gold/reference_logps v{reference['delta_version']}"
    )
    versions = {"gold/reference_logps": int(reference["delta_version"])}
    base_tags = run_tags(base_model.uri, started_from)
    trained = train_and_export(
        context,
        train_config,
        config.nproc_per_node,
        launcher,
        mlflow_tracking,
        pipes_subprocess_client,
        {
            "reference_model": reference["reference_model"],
            **{f"delta.{k}": str(v) for k, v in versions.items()},
            **base_tags,
        },
        _snapshot_tokenizer(lake, train_config.snapshot),
        str(init_from),  # a chat template's files: the starting model's own
    )
    return MaterializeResult(
        metadata={
            **trained,
            "reference_model": reference["reference_model"],
            **base_tags,
            "upstream_delta_versions": MetadataValue.json(versions),
            "beta": train_config.beta,
        }
    )


def _snapshot_tokenizer(lake: LakeResource, number: int) -> EncoderSpec:
    """The gold/tokenizer version the preference snapshot's pairs were encoded with."""
    version = read_manifest(lake.uri, number, PREFERENCE_SNAPSHOTS).tokenizer_version
    return EncoderSpec.from_row(lake.read("gold", "tokenizer", version=version).row(0, named=True))


def _base_model_started_from(
    lake: LakeResource, number: int, reference_model: str, base_model: BaseModelResource
):
    """The base model DPO starts from when the reference pass scored with it (no sft champion):
    the one the snapshot's tokenizer came from, as PIPELINE_BASE_MODEL gives it now; else None."""
    if not reference_model.startswith(REFERENCE_PREFIX):
        return None
    version = read_manifest(lake.uri, number, PREFERENCE_SNAPSHOTS).tokenizer_version
    model = tokenizer_base_model(lake, version, base_model)
    if model is None or reference_name(model) != reference_model:
        raise refusal(
            f"the reference pass scored with {reference_model}, but the snapshot's base model is "
            f"{reference_name(model) if model else 'none'} now: materialize gold/reference_logps "
            "for this snapshot again"
        )
    return model
