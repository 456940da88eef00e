"""Every resource of the code location, built from the settings."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import ConfigurableResource, EnvVar, PipesSubprocessClient
from dagster_aws.s3 import S3Resource

from pipeline_assets.defs.bronze.policy import IngestPolicy
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.ops.policy import CostPolicy, RetentionPolicy
from pipeline_assets.defs.registry.policy import RegistryPolicy
from pipeline_assets.defs.rl.overlay_policy import RlPolicy
from pipeline_assets.defs.silver.policy import SilverPolicy
from pipeline_assets.defs.training.policy import DpoPolicy, HparamSearchPolicy, TrainingPolicy
from pipeline_assets.engine import BlockEngine, KubeRayEngine, RayEngine
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.resources.settings import Settings


def _through_env(name: str, value: str) -> str:
    """``value`` as a resource's config: ``EnvVar(name)`` when it came from that variable, so
    Dagster shows the name, never the value (a URI with a password), in the UI, run config and
    events."""
    return EnvVar(name) if os.environ.get(name, "").strip() == value else value


def _block_engine(settings: Settings) -> BlockEngine:
    if settings.kuberay_config:
        return KubeRayEngine.from_file(settings.kuberay_config)
    return RayEngine(home=settings.home, min_rows=settings.ray_min_rows)


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
        "ingest_policy": IngestPolicy(
            max_quarantine_rate=settings.max_quarantine_rate,
            volume_tolerance=settings.volume_tolerance,
            freshness_sla_hours=settings.freshness_sla_hours,
        ),
        "eval_sets": EvalSetsResource(uri=settings.eval_sets_uri),
        "silver_policy": SilverPolicy(
            quality_thresholds=settings.quality_thresholds,
            max_pairs_per_prompt=settings.max_pairs_per_prompt,
            max_length_ratio=settings.max_length_ratio,
        ),
        "ray_engine": _block_engine(settings),
        "gold_policy": GoldPolicy(
            tokenizer_path=settings.tokenizer_path,
            seq_len=settings.seq_len,
            long_records=settings.long_records,
            vocab_size=settings.vocab_size,
            tokenizer_sample_chars=settings.tokenizer_sample_chars,
            validation_fraction=settings.validation_fraction,
            preference_validation_fraction=settings.preference_validation_fraction,
            search_fraction=settings.search_fraction,
            shuffle_seed=settings.shuffle_seed,
            snapshot_min_new_fraction=settings.snapshot_min_new_fraction,
        ),
        "launcher": TorchrunLauncher(
            checkpoint_uri=settings.checkpoint_uri,
            nproc_per_node=settings.train_nproc,
            threads_per_rank=settings.train_threads_per_rank,
            device=settings.train_device,
            scratch_dir=str(Path(settings.home) / "scratch"),
        ),
        "training_policy": TrainingPolicy(
            preset=settings.train_preset,
            steps=settings.train_steps,
            checkpoint_every_steps=settings.train_checkpoint_every,
        ),
        "dpo_policy": DpoPolicy(
            steps=settings.dpo_steps,
            lr=settings.dpo_lr,
            beta=settings.dpo_beta,
            checkpoint_every_steps=settings.train_checkpoint_every,
        ),
        "mlflow_tracking": MlflowResource(
            tracking_uri=_through_env("MLFLOW_TRACKING_URI", settings.mlflow_tracking_uri),
            artifact_root=settings.mlflow_artifact_root,
            experiment=settings.mlflow_experiment,
            ui_url=settings.mlflow_ui_url,
        ),
        "pipes_subprocess_client": PipesSubprocessClient(),
        "hparam_search_policy": HparamSearchPolicy(),
        "cost_policy": CostPolicy(
            core_hour_usd=settings.core_hour_usd,
            gpu_hour_usd=settings.gpu_hour_usd,
            spot_discount=settings.spot_discount,
        ),
        "registry_policy": RegistryPolicy(
            model_name=settings.model_name,
            dpo_model_name=settings.dpo_model_name,
            promotion_margin=settings.promotion_margin,
            slice_tolerance=settings.slice_tolerance,
            eval_max_tokens=settings.eval_max_tokens,
        ),
        "retention_policy": RetentionPolicy(days=settings.retention_days),
        "rl_policy": RlPolicy(
            bank_tasks=settings.rl_bank_tasks,
            bank_seed=settings.rl_bank_seed,
            held_out_fraction=settings.rl_held_out_fraction,
            group_size=settings.rl_group_size,
            rollout_workers=settings.rl_rollout_workers,
            max_staleness=settings.rl_max_staleness,
            max_pending_seconds=settings.rl_max_pending_seconds,
        ),
    }
