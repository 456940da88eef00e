"""The code location: every layer's assets, checks and sensors, with env-configured resources."""

from dagster import Definitions, in_process_executor, multiprocess_executor

from pipeline_assets.defs.automation import automation_sensor
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.evaluation.assets import evaluation_report
from pipeline_assets.defs.evaluation.dpo import evaluation_dpo_report
from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer
from pipeline_assets.defs.gold.manifest import gold_preference_snapshots, gold_snapshots
from pipeline_assets.defs.gold.preference import gold_preference_sequences
from pipeline_assets.defs.gold.reference import gold_reference_logps
from pipeline_assets.defs.gold.sensors import (
    preference_snapshot_cadence,
    preference_snapshot_job,
    snapshot_cadence,
    snapshot_job,
    snapshot_schedule,
)
from pipeline_assets.defs.landing.sensors import ingest_job, landing_sensor
from pipeline_assets.defs.ops.report import pipeline_report, stage_throughput
from pipeline_assets.defs.ops.retention import retention_job, retention_schedule
from pipeline_assets.defs.ops.schedules import nightly_retrain, retrain_job, run_failure_recorder
from pipeline_assets.defs.reference.assets import (
    base_model,
    base_model_watcher,
    eval_sets,
    eval_sets_watcher,
    observe_base_model_job,
    observe_eval_sets_job,
    observe_quality_models_job,
    quality_models,
    quality_models_watcher,
)
from pipeline_assets.defs.registry.assets import registry_model_version
from pipeline_assets.defs.registry.dpo import registry_dpo_model_version
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.defs.rl.prompt_bank import prompt_bank_checks, rl_prompt_bank
from pipeline_assets.defs.rl.run import rl_policy
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.defs.silver.sensors import silver_in_order, silver_job
from pipeline_assets.defs.training.assets import training_checkpoint
from pipeline_assets.defs.training.dpo import training_dpo_checkpoint
from pipeline_assets.defs.training.search import hparam_search
from pipeline_assets.resources.settings import Settings

# One process per run by default: on one machine a process per step costs seconds of imports each
# and gains little (training runs in torchrun's own processes). A cluster picks its executor.
EXECUTORS = {"in_process": in_process_executor, "multiprocess": multiprocess_executor}


def build_definitions(settings: Settings) -> Definitions:
    if settings.executor not in EXECUTORS:
        raise ValueError(f"PIPELINE_EXECUTOR={settings.executor!r}: one of {', '.join(EXECUTORS)}")
    return Definitions(
        assets=[
            eval_sets,
            base_model,
            quality_models,
            bronze,
            silver,
            gold_tokenizer,
            gold_sequences,
            gold_preference_sequences,
            gold_snapshots,
            gold_preference_snapshots,
            gold_reference_logps,
            hparam_search,
            training_checkpoint,
            training_dpo_checkpoint,
            evaluation_report,
            evaluation_dpo_report,
            registry_model_version,
            registry_dpo_model_version,
            rl_prompt_bank,
            rl_policy,
            pipeline_report,
        ],
        asset_checks=[
            *bronze_checks,
            *silver_checks,
            *prompt_bank_checks,
            stage_throughput,
        ],  # gold's are judged by the gold assets themselves
        sensors=[
            landing_sensor,
            silver_in_order,
            snapshot_cadence,
            preference_snapshot_cadence,
            automation_sensor,
            run_failure_recorder,
            eval_sets_watcher,
            base_model_watcher,
            quality_models_watcher,
        ],
        schedules=[snapshot_schedule, nightly_retrain, retention_schedule],
        jobs=[
            ingest_job,
            silver_job,
            snapshot_job,
            preference_snapshot_job,
            retrain_job,
            retention_job,
            observe_eval_sets_job,
            observe_base_model_job,
            observe_quality_models_job,
        ],
        resources=build_resources(settings),
        executor=EXECUTORS[settings.executor],
    )


defs = build_definitions(Settings.from_env())
