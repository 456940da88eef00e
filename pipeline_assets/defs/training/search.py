"""training/hparam_search: successive halving over short torchrun trials, each a nested MLflow
run."""

import dataclasses
import json
import math
import os
import subprocess

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from pipeline_assets.contracts import HparamTrial, conform, polars_schema, validate
from pipeline_assets.defs.keys import (
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
    REFERENCE_BASE_MODEL,
    TRAINING_HPARAM_SEARCH,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.snapshots import snapshot_versions
from pipeline_assets.defs.training.assets import TrainingRunConfig, train_config_for
from pipeline_assets.defs.training.policy import HparamSearchPolicy, TrainingPolicy
from pipeline_assets.lib.gold.manifest import read_manifest
from pipeline_assets.lib.training.search import sample_configurations
from pipeline_assets.lib.uris import join
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.config import TrainConfig, exported_config
from pipeline_assets.trainer.search_driver import TrialResult, successive_halving


@asset(
    key=TRAINING_HPARAM_SEARCH,
    group_name="training",
    deps=[GOLD_SNAPSHOTS, GOLD_TOKENIZER, REFERENCE_BASE_MODEL],
    partitions_def=data_snapshots,
    pool="training",
    kinds={"delta", "pytorch", "mlflow"},
    description="Successive halving over the search space on one data snapshot: short torchrun "
    "trials, bad ones stopped early, each a nested MLflow run, selected by loss on gold's search "
    "split (the promotion gate keeps validation). Its best configuration feeds "
    "training/checkpoint. Run by hand: it costs several training runs.",
)
def hparam_search(
    context: AssetExecutionContext,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    training_policy: TrainingPolicy,
    hparam_search_policy: HparamSearchPolicy,
    mlflow_tracking: MlflowResource,
    base_model: BaseModelResource,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    partition, policy = context.partition_key, hparam_search_policy
    versions = snapshot_versions(context.instance, partition)
    base, model = train_config_for(
        partition, TrainingRunConfig(), lake, launcher, training_policy, versions, base_model
    )
    _require_search_rows(lake, base.snapshot, policy.nproc_per_node)
    launcher.store("search", root=join(launcher.checkpoint_uri, partition)).clear()
    space = policy.base_model_space if model else policy.space
    configurations = sample_configurations(space, policy.trials, policy.seed)
    parent = mlflow_tracking.open_run(
        name=f"hparam_search {partition}",
        tags={"search_space": json.dumps(space)},
        reuse_key={
            "dagster_run_id": context.run_id,
            "partition": partition,
            "kind": "hparam_search",
        },
    )
    trial_runs = {
        trial: _trial_run(mlflow_tracking, parent, partition, trial, configurations[trial])
        for trial in range(len(configurations))
    }

    def launch(config: TrainConfig, trial: int) -> float:
        return _run_trial(
            context,
            launcher,
            mlflow_tracking,
            dataclasses.replace(config, mlflow_run_id=trial_runs[trial]),
            policy.nproc_per_node,
        )

    def report(result: TrialResult) -> None:
        verdict = "continues" if result.continued else "stops here"
        context.log.info(
            f"rung {result.rung} ({result.steps} steps): trial {result.trial} "
            f"{result.hyperparameters} search loss {result.search_loss:.4f}: {verdict}"
        )
        if not result.continued:
            mlflow_tracking.client().set_tag(
                trial_runs[result.trial], "search.stopped_at_steps", result.steps
            )

    outcome = successive_halving(
        base,
        configurations,
        min_steps=policy.min_steps,
        max_steps=policy.max_steps,
        eta=policy.eta,
        launch=launch,
        on_result=report,
    )
    trials = _trials_frame(partition, outcome.results, trial_runs)
    commit = lake.replace_partition(
        "training", "hparam_search", trials, column="partition", value=partition
    )
    client = mlflow_tracking.client()
    client.log_metric(parent, "best_search_loss", outcome.best_search_loss)
    client.log_metric(parent, "steps_trained", outcome.steps_trained)
    client.set_tag(parent, "best_hyperparameters", json.dumps(outcome.best_hyperparameters))
    client.set_terminated(parent)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(HparamTrial),
                upstream_versions=versions,
                input_bytes=0,
                stopwatch=stopwatch,
            ),
            "best_config": MetadataValue.json(outcome.best_hyperparameters),
            "best_search_loss": outcome.best_search_loss,
            "steps_trained": outcome.steps_trained,
            "full_grid_steps": outcome.full_grid_steps,
            "steps_saved": round(1 - outcome.steps_trained / outcome.full_grid_steps, 3),
            "trials": table_metadata(trials.drop("partition", "mlflow_run_id")),
            "mlflow_run": MetadataValue.url(mlflow_tracking.run_url(parent)),
        }
    )


def _require_search_rows(lake: LakeResource, snapshot: int, ranks: int) -> None:
    """Trials select on the search split: a snapshot without enough of it cannot be searched on."""
    manifest = read_manifest(lake.uri, snapshot)
    rows = manifest.sequences_by_split()["search"]
    if rows < ranks:
        raise Failure(
            allow_retries=False,
            description=f"{manifest.key} has {rows} search sequence(s), fewer "
            f"than the {ranks} trial rank(s): raise PIPELINE_SEARCH_FRACTION and cut a new "
            "snapshot",
        )


def _trial_run(
    mlflow_tracking: MlflowResource, parent: str, partition: str, trial: int, hyperparameters: dict
) -> str:
    run = mlflow_tracking.client().create_run(
        mlflow_tracking.experiment_id(),
        run_name=f"{partition} trial {trial}",
        tags={
            "mlflow.parentRunId": parent,
            "partition": partition,
            "search.trial": str(trial),
            "search.hyperparameters": json.dumps(hyperparameters),
        },
    )
    return run.info.run_id


def _run_trial(
    context: AssetExecutionContext,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    config: TrainConfig,
    nproc: int,
) -> float:
    with mlflow_tracking.relay(config.mlflow_run_id, launcher.scratch()) as relayed:
        done = subprocess.run(
            launcher.command(config.to_args(), nproc),
            env={**os.environ, **launcher.env(), **relayed},
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        context.log.warning(
            f"trial {config.partition} failed (exit {done.returncode}): {done.stderr[-2000:]}"
        )
        return math.nan
    export, problem = launcher.store(config.partition, root=config.checkpoint_uri).fetch_verified(
        "final"
    )
    if export is None:
        context.log.warning(f"trial {config.partition}: no usable export ({problem})")
        return math.nan
    about = exported_config(export)
    loss = about.get("search_loss")
    context.log.info(
        f"trial {config.partition}: search loss {loss} over {about.get('eval_sequences')} "
        f"{about.get('eval_split')} sequences"
    )
    return math.nan if loss is None else float(loss)


def _trials_frame(
    partition: str, results: list[TrialResult], trial_runs: dict[int, str]
) -> pl.DataFrame:
    frame = pl.DataFrame(
        [
            {
                "partition": partition,
                "trial": r.trial,
                "rung": r.rung,
                "steps": r.steps,
                "search_loss": None if math.isnan(r.search_loss) else r.search_loss,
                "hyperparameters": json.dumps(r.hyperparameters, sort_keys=True),
                "continued": r.continued,
                "mlflow_run_id": trial_runs[r.trial],
            }
            for r in results
        ],
        schema={
            "partition": pl.String,
            "trial": pl.Int64,
            "rung": pl.Int64,
            "steps": pl.Int64,
            "search_loss": pl.Float64,
            "hyperparameters": pl.String,
            "continued": pl.Boolean,
            "mlflow_run_id": pl.String,
        },
    )
    return validate(conform(frame, HparamTrial), HparamTrial)
