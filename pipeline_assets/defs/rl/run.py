"""rl/policy and rl/replay_buffer: one RL run (GRPO on rl/prompt_bank) launched through Dagster
Pipes, the learner under torchrun and PIPELINE_RL_ROLLOUT_WORKERS rollout processes beside it
(restarted when one dies), with the replay buffer's freshness and reward-signal checks judged on the
run's rows."""

import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    PipesSubprocessClient,
    multi_asset,
)

from pipeline_assets.contracts import ReplayBufferRow, polars_schema
from pipeline_assets.defs.dagster_private import DagsterPipesExecutionError
from pipeline_assets.defs.keys import (
    GOLD_TOKENIZER,
    REGISTRY_MODEL_VERSION,
    RL_POLICY,
    RL_PROMPT_BANK,
    RL_REPLAY_BUFFER,
)
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.retries import refusal
from pipeline_assets.defs.rl.policy import RlPolicy
from pipeline_assets.defs.rl.workers import RolloutWorkers
from pipeline_assets.lib.gold.base_model import BaseModelError, folder_encoder_spec
from pipeline_assets.lib.gold.encoder import EncoderSpec
from pipeline_assets.lib.ops.charts import reward_curve_png
from pipeline_assets.lib.rl.replay import StalenessPolicy, freshness, reward_signal
from pipeline_assets.lib.uris import redact
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.config import RlConfig
from pipeline_assets.trainer.policy_store import METRICS_FILE, PolicyStore

RL_MODULE = "pipeline_assets.trainer.rl"
FRESHNESS, REWARD_SIGNAL = "freshness", "reward_signal"


class RlRunConfig(Config):
    """What one materialization runs; the rest is RlPolicy's (PIPELINE_RL_*)."""

    # the bank's tasks to train on, comma-separated; empty: all (the tiny demo model learns "sort")
    tasks: str = ""
    updates: int = 0  # 0: PIPELINE_RL_UPDATES
    prompts_per_update: int = 32
    lr: float = 3e-4
    # an exported model folder to start from instead of the sft champion: the built-in model's
    # export with tokenizer_path, or a Hugging Face model folder with its tokenizer and template
    init_from: str = ""
    tokenizer_path: str = ""
    lagging_worker_lag: int = (
        0  # rollout worker 0 samples this many versions behind (a drill of the staleness limit)
    )
    wait_seconds: float = 120.0


@multi_asset(
    specs=[
        AssetSpec(
            RL_POLICY,
            group_name="rl",
            deps=[RL_PROMPT_BANK, REGISTRY_MODEL_VERSION, GOLD_TOKENIZER],
            kinds={"pytorch", "mlflow"},
            description="One GRPO run from the sft champion on rl/prompt_bank's training prompts: "
            "a learner under torchrun publishes policy version v+1 after each update through the "
            "checkpoint store, rollout workers sample groups with the newest version. Materialized "
            "by hand (or selected explicitly).",
        ),
        AssetSpec(
            RL_REPLAY_BUFFER,
            group_name="rl",
            kinds={"delta"},
            description="Append-only Delta table, one row per completion: the policy version that "
            "generated it, its tokens and behaviour log-probabilities, its reward and verifier "
            "detail, and its status (pending, consumed, dropped_stale) with the version that "
            "consumed it.",
        ),
    ],
    check_specs=[
        AssetCheckSpec(
            FRESHNESS,
            asset=RL_REPLAY_BUFFER,
            blocking=True,
            description="No consumed rollout lagged more than PIPELINE_RL_MAX_STALENESS versions, "
            "none was dropped as stale, none waited longer than PIPELINE_RL_MAX_PENDING_SECONDS: "
            "the policy did not train on (or wait for) stale trajectories.",
        ),
        AssetCheckSpec(
            REWARD_SIGNAL,
            asset=RL_REPLAY_BUFFER,
            blocking=False,
            description="At most 90% of the groups an update took gave all completions the same "
            "reward (such groups have no gradient).",
        ),
    ],
    pool="training",
)
def rl_policy(
    context: AssetExecutionContext,
    config: RlRunConfig,
    lake: LakeResource,
    landing: LandingResource,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    rl_policy: RlPolicy,
    pipes_subprocess_client: PipesSubprocessClient,
):
    run = f"rl-{context.run_id[:8]}"  # a retry of this Dagster run resumes it
    folder = Path(launcher.scratch()) / "rl" / run
    init_from, tokenizer_path, chat_template_path, started_from = _starting_policy(
        config, lake, mlflow_tracking, registry_policy, folder
    )
    mlflow_run = mlflow_tracking.open_run(
        name=f"rl {run}",
        tags={"started_from": started_from},
        reuse_key={"dagster_run_id": context.run_id, "partition": run},
    )
    rl_config = RlConfig(
        lake_uri=lake.uri,
        checkpoint_uri=launcher.checkpoint_uri,
        partition=run,
        tokenizer_path=tokenizer_path,
        chat_template_path=chat_template_path,
        init_from=init_from,
        tasks=config.tasks,
        updates=config.updates or rl_policy.updates,
        prompts_per_update=config.prompts_per_update,
        group_size=rl_policy.group_size,
        warm_start_max_steps=rl_policy.warm_start_max_steps,
        lr=config.lr,
        max_staleness=rl_policy.max_staleness,
        max_pending_seconds=rl_policy.max_pending_seconds,
        landing_uri=landing.uri,
        wait_seconds=config.wait_seconds,
        mlflow_run_id=mlflow_run,
        scratch_dir=launcher.scratch(),
    )
    command = launcher.command(rl_config.to_args(), nproc_per_node=1, module=RL_MODULE)
    context.log.info(
        f"launching the learner (rerun by hand to debug): {redact(shlex.join(command))}"
    )
    policies = PolicyStore(launcher.checkpoint_uri, run, launcher.scratch())
    workers = RolloutWorkers(
        lambda n: _worker_command(rl_config, n, config.lagging_worker_lag),
        rl_policy.rollout_workers,
        {**launcher.env(), "MLFLOW_TRACKING_URI": ""},
        folder / "workers",
        policies,
        context.log.warning,
    )
    try:
        with workers, mlflow_tracking.relay(mlflow_run, launcher.scratch()) as relayed:
            pipes_subprocess_client.run(
                context=context, command=command, env={**launcher.env(), **relayed}
            )
    except DagsterPipesExecutionError as exc:
        raise Failure(
            description=redact(
                f"the RL learner failed: {exc}; replay buffer: "
                f"{_freshness(lake, run, rl_policy).description}"
            )
        ) from None
    yield from _results(
        lake,
        launcher,
        run,
        rl_policy,
        policies,
        workers.restarts,
        mlflow_tracking,
        mlflow_run,
        started_from,
    )


def policy_waits(mlflow_tracking: MlflowResource, registry_policy: RegistryPolicy) -> str | None:
    """Why an RL run with the default run config cannot start yet (no sft champion), or None."""
    if mlflow_tracking.version_by_alias(registry_policy.model_name, "champion") is not None:
        return None
    return (
        f"no {registry_policy.model_name} champion to start the RL run from: run the batch path "
        "first, or give init_from (with tokenizer_path for the built-in model's export)"
    )


def _starting_policy(
    config: RlRunConfig,
    lake: LakeResource,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    folder: Path,
) -> tuple[str, str, str, str]:
    """(exported model folder, tokenizer.json, chat template file or "", what it is): the run
    config's, else the sft champion (of either backend) with the gold/tokenizer version it was
    trained on."""
    if config.init_from or config.tokenizer_path:
        return _given_policy(config, folder)
    waits = policy_waits(mlflow_tracking, registry_policy)
    if waits:
        raise refusal(waits)
    champion = mlflow_tracking.version_by_alias(registry_policy.model_name, "champion")
    model_dir = mlflow_tracking.download_model(
        registry_policy.model_name, str(champion.version), folder / "init"
    )
    row = lake.read(*GOLD_TOKENIZER.path, version=int(champion.tags["delta.gold/tokenizer"]))
    tokenizer_path, template_path = _write_encoder(
        EncoderSpec.from_row(row.row(0, named=True)), folder
    )
    return (
        str(model_dir),
        tokenizer_path,
        template_path,
        f"{registry_policy.model_name}/{champion.version}",
    )


def _given_policy(config: RlRunConfig, folder: Path) -> tuple[str, str, str, str]:
    """The run config's export: a Hugging Face model folder encodes prompts with its own tokenizer
    and chat template (as gold encoded its training data); the built-in model's export with the
    tokenizer.json it was trained with, in the built-in chat format."""
    # imported here: hf_model imports torch, which loading the code location must not
    from pipeline_assets.trainer.hf_model import is_hf_folder

    if config.init_from and is_hf_folder(config.init_from):
        if config.tokenizer_path:
            raise Failure(
                allow_retries=False,
                description=f"init_from {config.init_from} is a Hugging Face model folder: its "
                "own tokenizer and chat template encode the prompts; leave tokenizer_path empty",
            )
        try:
            spec = folder_encoder_spec(config.init_from)
        except BaseModelError as error:
            raise Failure(allow_retries=False, description=str(error)) from None
        return config.init_from, *_write_encoder(spec, folder), config.init_from
    if not (config.init_from and config.tokenizer_path):
        raise Failure(
            allow_retries=False,
            description="init_from and tokenizer_path go together (tokenizer_path alone for the "
            "built-in model's export; a Hugging Face model folder brings its own)",
        )
    return config.init_from, config.tokenizer_path, "", config.init_from


def _write_encoder(spec: EncoderSpec, folder: Path) -> tuple[str, str]:
    """(tokenizer.json, the chat template file or "" for the built-in chat format) in ``folder``:
    what the learner and the workers build the policy's encoder from."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer_path.write_text(spec.tokenizer_json)
    template = spec.template_file_text()
    if template is None:
        return str(tokenizer_path), ""
    template_path = folder / "chat_template.json"
    template_path.write_text(template)
    return str(tokenizer_path), str(template_path)


def _worker_command(config: RlConfig, number: int, lagging_worker_lag: int) -> list[str]:
    lag = lagging_worker_lag if number == 0 else 0
    return [
        sys.executable,
        "-m",
        RL_MODULE,
        *config.to_args(),
        "--worker",
        str(number),
        "--lag",
        str(lag),
    ]


def _run_rows(lake: LakeResource, run: str) -> pl.DataFrame:
    rows = lake.read(*RL_REPLAY_BUFFER.path, where=pl.col("run") == run)
    return rows if rows is not None else pl.DataFrame(schema=polars_schema(ReplayBufferRow))


def _freshness(lake: LakeResource, run: str, rl_policy: RlPolicy):
    staleness = StalenessPolicy(rl_policy.max_staleness, rl_policy.max_pending_seconds)
    return freshness(_run_rows(lake, run), staleness, datetime.now(timezone.utc))


def _results(
    lake, launcher, run, rl_policy, policies, restarts, mlflow_tracking, mlflow_run, started_from
):
    history = [
        json.loads(line)
        for line in policies.store.local_folder(METRICS_FILE).read_text().splitlines()
    ]
    rows = _run_rows(lake, run)
    staleness = StalenessPolicy(rl_policy.max_staleness, rl_policy.max_pending_seconds)
    fresh = freshness(rows, staleness, datetime.now(timezone.utc))
    signal = reward_signal(rows)
    picture = reward_curve_png(
        history,
        Path(launcher.scratch()) / "reports" / run / "reward_curve.png",
        f"{run}: GRPO from {started_from}",
    )
    client = mlflow_tracking.client()
    if picture is not None:
        client.log_artifact(mlflow_run, str(picture), "rl")
    first, last = history[: min(10, len(history))], history[-min(10, len(history)) :]
    yield MaterializeResult(
        asset_key=RL_POLICY,
        metadata={
            "run": run,
            "started_from": started_from,
            "policy_version": history[-1]["policy_version"],
            "policy_uri": policies.store.folder_uri(f"policy-v{history[-1]['policy_version']}"),
            "reward_first_10": _mean(first, "reward_mean"),
            "reward_last_10": _mean(last, "reward_mean"),
            "held_out_accuracy": next(
                (r["held_out_accuracy"] for r in reversed(history) if "held_out_accuracy" in r),
                None,
            ),
            "rollout_worker_restarts": restarts,
            "mlflow_run": MetadataValue.url(mlflow_tracking.run_url(mlflow_run)),
            "mlflow_run_id": mlflow_run,
            **({"reward_curve": MetadataValue.path(str(picture))} if picture is not None else {}),
        },
    )
    yield MaterializeResult(
        asset_key=RL_REPLAY_BUFFER,
        metadata={
            "run": run,
            "rows": rows.height,
            "dagster/row_count": rows.height,
            "delta_version": lake.version(*RL_REPLAY_BUFFER.path),
            "rows_by_status": table_metadata(rows.group_by("status").len("rows").sort("status")),
            **{k: v for k, v in fresh.metrics.items() if isinstance(v, (int, float))},
        },
        check_results=[
            AssetCheckResult(
                asset_key=RL_REPLAY_BUFFER,
                check_name=FRESHNESS,
                passed=fresh.passed,
                severity=AssetCheckSeverity.ERROR,
                description=fresh.description,
                metadata=fresh.metrics,
            ),
            AssetCheckResult(
                asset_key=RL_REPLAY_BUFFER,
                check_name=REWARD_SIGNAL,
                passed=signal.passed,
                severity=AssetCheckSeverity.WARN,
                description=signal.description,
                metadata={
                    k: v for k, v in signal.metrics.items() if isinstance(v, (int, float, str))
                },
            ),
        ],
    )


def _mean(rows: list[dict], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 4) if rows else 0.0
