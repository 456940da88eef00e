"""Every resource of the code location, built from the settings."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import ConfigurableResource, EnvVar, PipesSubprocessClient
from dagster_aws.s3 import S3Resource

from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.bronze.policy import IngestPolicy
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.ops.policy import RetentionPolicy
from pipeline_assets.defs.policies import CostPolicy, RegistryPolicy, SilverPolicy
from pipeline_assets.defs.rl.policy import RlPolicy
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.defs.training.policy import DpoPolicy, HparamSearchPolicy, TrainingPolicy
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.engine import BlockEngine, KubeRayEngine, RayEngine
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.resources.quality_models import QualityModelsResource
from pipeline_assets.resources.settings import Settings, policy_from


def _through_env(name: str, value: str) -> str:
    """``value`` as a resource's config: ``EnvVar(name)`` when it came from that variable, so
    Dagster shows the name, never the value (a URI with a password), in the UI, run config and
    events."""
    return EnvVar(name) if os.environ.get(name, "").strip() == value else value


def _block_engine(settings: Settings) -> BlockEngine:
    if settings.kuberay_config:
        return KubeRayEngine.from_file(settings.kuberay_config)
    return RayEngine(home=settings.home, min_rows=settings.ray_min_rows)


def batch_gates() -> BatchGates:
    """Bronze's and silver's blocking checks: the gates a batch must pass to feed dedup and gold."""
    return BatchGates.of([*bronze_checks, *silver_checks])


def build_resources(settings: Settings | None = None) -> dict[str, ConfigurableResource]:
    settings = settings or Settings.from_env()
    return {
        "lake": LakeResource(uri=settings.lake_uri),
        "landing": LandingResource(
            uri=settings.landing_uri,
            field_mappings=settings.field_mappings,
            source_formats=settings.source_formats,
            s3=S3Resource(max_attempts=settings.s3_max_attempts - 1),
        ),  # it counts retries
        "ingest_policy": policy_from(IngestPolicy, settings),
        "eval_sets": EvalSetsResource(uri=settings.eval_sets_uri),
        "silver_policy": policy_from(SilverPolicy, settings),
        "quality_models": QualityModelsResource(
            models=settings.quality_models,
            cache_dir=str(Path(settings.home) / "cache" / "quality_models"),
        ),
        "batch_gates": batch_gates(),
        "ray_engine": _block_engine(settings),
        "gold_policy": policy_from(GoldPolicy, settings),
        "base_model": BaseModelResource(
            uri=settings.base_model, cache_dir=str(Path(settings.home) / "cache" / "base_model")
        ),
        "launcher": TorchrunLauncher(
            checkpoint_uri=settings.checkpoint_uri,
            nproc_per_node=settings.train_nproc,
            threads_per_rank=settings.train_threads_per_rank,
            device=settings.train_device,
            scratch_dir=str(Path(settings.home) / "scratch"),
        ),
        "training_policy": policy_from(TrainingPolicy, settings),
        "dpo_policy": policy_from(DpoPolicy, settings),
        "mlflow_tracking": MlflowResource(
            tracking_uri=_through_env("MLFLOW_TRACKING_URI", settings.mlflow_tracking_uri),
            artifact_root=settings.mlflow_artifact_root,
            experiment=settings.mlflow_experiment,
            ui_url=settings.mlflow_ui_url,
        ),
        "pipes_subprocess_client": PipesSubprocessClient(),
        "hparam_search_policy": policy_from(HparamSearchPolicy, settings),
        "cost_policy": policy_from(CostPolicy, settings),
        "registry_policy": policy_from(RegistryPolicy, settings),
        "retention_policy": policy_from(RetentionPolicy, settings),
        "rl_policy": policy_from(RlPolicy, settings),
    }
