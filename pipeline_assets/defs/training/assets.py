"""training/checkpoint: one torchrun FSDP2 job per data snapshot, launched through Dagster Pipes."""

import dataclasses
import hashlib
import json
import resource
import shlex
import tempfile
import time
from pathlib import Path
from typing import Optional

from dagster import (
    AssetExecutionContext,
    AssetSelection,
    AutomationCondition,
    Config,
    DagsterExecutionInterruptedError,
    Failure,
    MaterializeResult,
    MetadataValue,
    PipesSubprocessClient,
    RetryPolicy,
    asset,
)

from pipeline_assets.defs.automation import REFERENCE_SOURCES
from pipeline_assets.defs.base_models import run_tags, snapshot_base_model
from pipeline_assets.defs.dagster_private import DagsterPipesExecutionError
from pipeline_assets.defs.keys import (
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
    MODEL_ARTIFACT_PATH,
    REFERENCE_BASE_MODEL,
    TRAINING_CHECKPOINT,
    TRAINING_HPARAM_SEARCH,
)
from pipeline_assets.defs.partitions import data_snapshots, snapshot_number
from pipeline_assets.defs.retries import STOPPED_BY_A_SIGNAL
from pipeline_assets.defs.snapshots import partition_metadata, snapshot_versions
from pipeline_assets.defs.training.policy import TrainingPolicy
from pipeline_assets.lib.gold.base_model import BaseModel, copy_tokenizer_files
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.tokenizer import save_hf_tokenizer
from pipeline_assets.lib.training.provenance import git_commit
from pipeline_assets.lib.uris import join, redact
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.config import EXIT_PREEMPTED, TrainConfig
from pipeline_assets.trainer.storage import OWNER, CheckpointStore


class TrainingRunConfig(Config):
    """Overrides for one run; anything left empty comes from the training policy."""

    preset: Optional[str] = None
    steps: Optional[int] = None
    lr: Optional[float] = None
    warmup_steps: Optional[int] = None
    weight_decay: Optional[float] = None
    micro_batch_size: Optional[int] = None
    grad_accum_steps: Optional[int] = None
    seed: Optional[int] = None
    nproc_per_node: Optional[int] = None

    def hyperparameter_overrides(self) -> dict:
        return {
            k: v for k, v in self.model_dump().items() if v is not None and k != "nproc_per_node"
        }


def when_snapshot_added() -> AutomationCondition:
    """Train each new data snapshot once its blocking checks pass; older snapshots are not
    retrained."""
    return (
        AutomationCondition.on_missing().ignore(
            AssetSelection.assets(TRAINING_HPARAM_SEARCH) | REFERENCE_SOURCES
        )  # the search: optional, by hand
        & AutomationCondition.all_deps_blocking_checks_passed()
    )


@asset(
    key=TRAINING_CHECKPOINT,
    group_name="training",
    deps=[GOLD_SNAPSHOTS, GOLD_TOKENIZER, TRAINING_HPARAM_SEARCH, REFERENCE_BASE_MODEL],
    partitions_def=data_snapshots,
    pool="training",  # one job at a time by default: the instance's pool limit
    retry_policy=RetryPolicy(
        max_retries=2, delay=5
    ),  # a preempted job resumes from its newest checkpoint
    kinds={"pytorch", "mlflow"},
    automation_condition=when_snapshot_added(),
    description="A torchrun FSDP2 job on one data snapshot (its manifest's shards, Delta versions "
    "pinned), from the base model its tokenizer came from (PIPELINE_BASE_MODEL) or a preset from "
    "scratch: checkpoints, the exported Hugging Face model folder and an MLflow run.",
)
def training_checkpoint(
    context: AssetExecutionContext,
    config: TrainingRunConfig,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    training_policy: TrainingPolicy,
    mlflow_tracking: MlflowResource,
    pipes_subprocess_client: PipesSubprocessClient,
    base_model: BaseModelResource,
) -> MaterializeResult:
    partition = context.partition_key
    versions = snapshot_versions(context.instance, partition)
    searched = (partition_metadata(context.instance, TRAINING_HPARAM_SEARCH, partition) or {}).get(
        "best_config"
    )
    if searched:
        context.log.info(
            f"using training/hparam_search's best configuration for {partition}: {searched}"
        )
    train_config, model = train_config_for(
        partition, config, lake, launcher, training_policy, versions, base_model, searched
    )
    tokenizer = lake.read("gold", "tokenizer", version=versions["gold/tokenizer"])
    base_tags = run_tags(base_model.uri, model)
    trained = train_and_export(
        context,
        train_config,
        config.nproc_per_node,
        launcher,
        mlflow_tracking,
        pipes_subprocess_client,
        {f"delta.{name}": str(v) for name, v in versions.items()} | base_tags,
        EncoderSpec.from_row(tokenizer.row(0, named=True)),
        train_config.base_model,
    )
    return MaterializeResult(
        metadata={
            **trained,
            **base_tags,
            "upstream_delta_versions": MetadataValue.json(versions),
            "model": f"base model {base_model.uri} ({model.architecture})"
            if model
            else f"preset {train_config.preset}",
            "preset": train_config.preset,
            "hyperparameters_from_search": MetadataValue.json(searched or {}),
        }
    )


def train_and_export(
    context: AssetExecutionContext,
    train_config: TrainConfig,
    nproc_per_node: int | None,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    pipes_subprocess_client: PipesSubprocessClient,
    tags: dict[str, str],
    tokenizer: EncoderSpec,
    tokenizer_folder: str = "",
) -> dict:
    """Run the trainer on ``train_config`` under torchrun through Pipes (resuming the partition's
    unfinished checkpoints), log its export with ``tokenizer``'s files (a Hugging Face model
    folder; a chat template's from ``tokenizer_folder``) to a new MLflow run, and return the
    materialization's metadata."""
    partition = train_config.partition
    store = launcher.store(partition)
    settings = _settings_fingerprint(train_config, nproc_per_node or launcher.nproc_per_node)
    resumed = _claim_checkpoints(context, store, settings)
    commit = git_commit()
    run_id = mlflow_tracking.open_run(
        name=f"train {partition}",
        tags={"git_commit": commit, **tags},
        reuse_key={"dagster_run_id": context.run_id, "partition": partition},
    )
    command = launcher.command([*train_config.to_args(), "--mlflow-run-id", run_id], nproc_per_node)
    context.log.info(
        f"launching (rerun by hand with the same arguments to debug): {redact(shlex.join(command))}"
    )
    started, children_cpu = time.perf_counter(), _children_cpu_seconds()
    try:
        with mlflow_tracking.relay(run_id, launcher.scratch()) as relayed:
            invocation = pipes_subprocess_client.run(
                context=context, command=command, env={**launcher.env(), **relayed}
            )
    except DagsterExecutionInterruptedError:
        # This process was asked to stop (Ctrl-C, SIGTERM to the command or to its run worker): the
        # trainer saved and exited; retrying here would only be stopped again. The next
        # materialization resumes from the saved step.
        raise Failure(
            description=f"{STOPPED_BY_A_SIGNAL}: the trainer saved its newest checkpoint and "
            "exited; materializing this partition again resumes from it",
            allow_retries=False,
        ) from None
    except (
        DagsterPipesExecutionError
    ) as exc:  # the trainer failed, or was preempted on its own (exit 143): retried
        raise Failure(description=redact(_failure_reason(str(exc), train_config))) from None
    reported = invocation.get_materialize_result().metadata or {}
    wall = time.perf_counter() - started
    export, problem = store.fetch_verified("final")
    if export is None:
        raise Failure(description=f"the trainer exited 0 but its export is not usable: {problem}")
    _log_model_folder(mlflow_tracking, run_id, export, tokenizer, tokenizer_folder)
    store.write_json(OWNER, {**store.read_json(OWNER), "finished": True})
    return {
        **reported,
        **({"resumed_from": resumed} if resumed else {}),
        "mlflow_run": MetadataValue.url(mlflow_tracking.run_url(run_id)),
        "mlflow_run_id": run_id,
        "loss_curve": MetadataValue.path(
            join(train_config.checkpoint_uri, partition, "final", "loss_curve.png")
        ),
        "git_commit": commit,
        "command": MetadataValue.text(redact(shlex.join(command))),
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(
            _children_cpu_seconds() - children_cpu, 2
        ),  # every rank, torchrun included
        "gpu_seconds": round(wall * reported["gpus"].value, 2) if "gpus" in reported else 0.0,
    }


def _log_model_folder(
    mlflow_tracking: MlflowResource,
    run_id: str,
    export: Path,
    tokenizer: EncoderSpec,
    tokenizer_folder: str,
) -> None:
    """The trainer's export and the tokenizer's files, together one Hugging Face model folder in the
    run's artifacts (the tokenizer written apart: the verified export is left as it was). With a
    chat template, the tokenizer files and template of the model it started from
    (``tokenizer_folder``); else the built-in tokenizer's."""
    client = mlflow_tracking.client()
    client.log_artifacts(run_id, str(export), MODEL_ARTIFACT_PATH)
    with tempfile.TemporaryDirectory() as written:
        if tokenizer.chat_template is None:
            save_hf_tokenizer(tokenizer.tokenizer_json, Path(written))
        else:
            stops = chat_encoder(tokenizer).stop_ids
            copy_tokenizer_files(Path(tokenizer_folder), Path(written), stops)
        client.log_artifacts(run_id, written, MODEL_ARTIFACT_PATH)


def _children_cpu_seconds() -> float:
    """CPU time of the finished child processes (torchrun waits for its ranks, so theirs counts)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _claim_checkpoints(
    context: AssetExecutionContext, store: CheckpointStore, settings: str
) -> str | None:
    """A retry of this materialization resumes its checkpoints, and so does a new materialization of
    the partition whose previous one never finished with the same settings (its process was killed);
    otherwise the partition starts from step 0 (a finished one is not continued). Returns what was
    resumed ("step N of run R"), None for a fresh start or a retry."""
    root_run = context.dagster_run.root_run_id or context.run_id
    owner = store.read_json(OWNER)
    resumed = None
    if owner is not None and owner.get("root_run_id") != root_run:
        steps = store.complete_steps()
        if not owner.get("finished") and owner.get("settings") == settings and steps:
            resumed = f"step {steps[0]} of run {owner['root_run_id']}"
            context.log.info(
                f"resumed from {resumed}: that materialization of {context.partition_key} never "
                "finished, and its snapshot and settings are the same"
            )
        else:
            why = (
                "finished"
                if owner.get("finished")
                else ("trained with other settings" if steps else "no checkpoint")
            )
            context.log.info(
                f"clearing {store.uri}: its checkpoints belong to run {owner.get('root_run_id')} "
                f"({why})"
            )
            store.clear()
    store.write_json(OWNER, {"root_run_id": root_run, "settings": settings})
    return resumed


def _settings_fingerprint(config: TrainConfig, nproc_per_node: int) -> str:
    """What decides the trained weights, step by step (the MLflow run and the scratch folder do
    not)."""
    decisive = {**dataclasses.asdict(config), "nproc_per_node": nproc_per_node}
    for incidental in ("mlflow_run_id", "scratch_dir"):
        decisive.pop(incidental)
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def train_config_for(
    partition: str,
    config: TrainingRunConfig,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    policy: TrainingPolicy,
    versions: dict,
    base_model: BaseModelResource,
    searched: dict | None = None,
) -> tuple[TrainConfig, BaseModel | None]:
    """The policy's hyperparameters, then the search's best for this snapshot, then the run's
    config; and the base model the snapshot's tokenizer came from (None: a preset from scratch)."""
    tokenizer_version = versions["gold/tokenizer"]
    tokenizer = lake.read("gold", "tokenizer", version=tokenizer_version)
    if tokenizer is None:
        raise Failure(description="gold/tokenizer does not exist: materialize gold first")
    model = snapshot_base_model(tokenizer.row(0, named=True), tokenizer_version, base_model)
    hyperparameters = {
        **policy.hyperparameters(from_base_model=model is not None),
        **(searched or {}),
        **config.hyperparameter_overrides(),
    }
    return TrainConfig(
        lake_uri=lake.uri,
        snapshot=snapshot_number(partition),
        checkpoint_uri=launcher.checkpoint_uri,
        partition=partition,
        vocab_size=int(tokenizer["vocab_size"][0]),
        base_model=model.path if model else "",
        device=launcher.device,
        scratch_dir=launcher.scratch(),
        **hyperparameters,
    ), model


def _failure_reason(error: str, config: TrainConfig) -> str:
    if f"code {EXIT_PREEMPTED}" in error:
        return (
            f"the training job was stopped by SIGTERM after saving a checkpoint under "
            f"{join(config.checkpoint_uri, config.partition)}; a retry resumes from it"
        )
    return (
        f"the training job failed ({error}); each rank's error is in this run's logs. "
        "Rerun the logged torchrun command by hand to debug; completed checkpoints are kept and "
        "resumed from."
    )
