"""rl/policy and rl/replay_buffer materialized with the project's resources (a learner under
torchrun through Dagster Pipes, two rollout workers): a worker killed mid-run is restarted and the
run completes with every rollout taken once; rollouts forced to lag 3 versions with a limit of 1 are
dropped and the blocking freshness check fails naming the lag; a Hugging Face model folder runs as
a policy with its own tokenizer and chat template."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import polars as pl
from dagster import PipesSubprocessClient, materialize

from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.rl.policy import RlPolicy
from pipeline_assets.defs.rl.run import rl_policy
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.policy_store import PolicyStore
from pipeline_assets_tests.trainer.rl_setup import dropped_shares, hf_rl_inputs, rl_inputs


def _resources(tmp_path, config, **policy) -> dict:
    return {
        "lake": LakeResource(uri=config.lake_uri),
        "landing": LandingResource(uri=str(tmp_path / "landing")),
        "launcher": TorchrunLauncher(
            checkpoint_uri=config.checkpoint_uri,
            scratch_dir=str(tmp_path / "scratch"),
            nproc_per_node=1,
            threads_per_rank=1,
        ),
        "mlflow_tracking": MlflowResource(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
            artifact_root=str(tmp_path / "mlartifacts"),
        ),
        "registry_policy": RegistryPolicy(),
        "rl_policy": RlPolicy(group_size=4, rollout_workers=2, **policy),
        "pipes_subprocess_client": PipesSubprocessClient(),
    }


def _run_config(config, **overrides) -> dict:
    values = {
        "updates": 6,
        "prompts_per_update": 4,
        "init_from": config.init_from,
        "tokenizer_path": config.tokenizer_path,
        "wait_seconds": 60,
        **overrides,
    }
    return {"ops": {"rl_policy": {"config": values}}}


def _kill_a_worker_once_a_version_is_out(scratch, checkpoint_uri, lake_uri) -> threading.Thread:
    """Once policy v2 is out, SIGKILL the worker that wrote the most rollouts so far: the other one,
    already running, carries on while it restarts, so both write rows whatever the machine's load
    (the busy worker can be the only one to have written by then)."""

    def kill() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = list(scratch.glob("rl/*/workers/workers.json"))
            if found:
                run = found[0].parent.parent.name
                if (PolicyStore(checkpoint_uri, run).newest() or 0) >= 2:
                    pids = json.loads(found[0].read_text())
                    os.killpg(pids[_busiest_worker(lake_uri, sorted(pids))], signal.SIGKILL)
                    return
            time.sleep(0.1)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _busiest_worker(lake_uri: str, workers: list[str]) -> str:
    written = pl.read_delta(f"{lake_uri}/rl/replay_buffer", columns=["worker"])["worker"]
    return max(workers, key=lambda worker: (written == f"worker-{worker}").sum())


def test_a_killed_rollout_worker_is_restarted_and_the_run_completes(tmp_path, instance):
    config = rl_inputs(tmp_path)
    killer = _kill_a_worker_once_a_version_is_out(
        tmp_path / "scratch", config.checkpoint_uri, config.lake_uri
    )

    result = materialize(
        [rl_policy],
        instance=instance,
        resources=_resources(tmp_path, config),
        run_config=_run_config(config),
        raise_on_error=False,
    )

    killer.join()
    assert result.success
    policy = result.asset_materializations_for_node("rl_policy")[0].metadata
    assert policy["rollout_worker_restarts"].value >= 1 and policy["policy_version"].value == 6
    rows = pl.read_delta(f"{config.lake_uri}/rl/replay_buffer")
    assert rows["rollout_id"].n_unique() == rows.height, "nothing written twice"
    consumed = rows.filter(pl.col("status") == "consumed")
    assert consumed["rollout_id"].n_unique() == consumed.height
    assert {"worker-0", "worker-1"} <= set(rows["worker"])
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["freshness"].passed, checks["freshness"].description
    assert policy["reward_curve"].value.endswith(".png")
    client = _resources(tmp_path, config)["mlflow_tracking"].client()
    run_id = policy["mlflow_run_id"].value
    for metric in (
        "rl/reward_mean",
        "rl/reward_std",
        "rl/zero_spread_share",
        "rl/staleness_max",
        "rl/dropped_stale",
    ):
        assert [m.step for m in client.get_metric_history(run_id, metric)] == list(range(1, 7)), (
            metric
        )
    # every 10 updates (RlConfig.eval_every) and at the last: a run of 6 measures it once,
    # at the end
    assert [m.step for m in client.get_metric_history(run_id, "rl/held_out_accuracy")] == [6]
    assert [a.path for a in client.list_artifacts(run_id, "rl")] == ["rl/reward_curve.png"]


def test_rollouts_forced_to_lag_fail_the_freshness_check_naming_the_lag(tmp_path, instance):
    config = rl_inputs(tmp_path)

    result = materialize(
        [rl_policy],
        instance=instance,
        resources=_resources(tmp_path, config, max_staleness=1),
        run_config=_run_config(config, lagging_worker_lag=3),
        raise_on_error=False,
    )

    rows = pl.read_delta(f"{config.lake_uri}/rl/replay_buffer")
    dropped = rows.filter(pl.col("status") == "dropped_stale")
    shares = dropped_shares(rows)
    assert dropped.height and shares["worker-0"] > shares["worker-1"], (
        f"worker 0 lags and loses the most; worker 1 keeps the run going: {shares}"
    )
    freshness = {c.check_name: c for c in result.get_asset_check_evaluations()}["freshness"]
    assert not freshness.passed and not result.success, "a blocking check"
    assert (
        "dropped as stale, lagging up to" in freshness.description
        and "(limit 1)" in freshness.description
    )


def test_a_hugging_face_model_folder_is_a_policy_with_its_own_tokenizer_and_template(
    tmp_path, instance
):
    config = hf_rl_inputs(tmp_path, bank_tasks=60)
    resources = _resources(tmp_path, config)
    resources["rl_policy"] = RlPolicy(group_size=4, rollout_workers=1, warm_start_max_steps=0)
    given = {"init_from": config.init_from, "tokenizer_path": "", "updates": 2}

    result = materialize(
        [rl_policy],
        instance=instance,
        resources=resources,
        run_config=_run_config(config, **given),
        raise_on_error=False,
    )

    assert result.success
    policy = result.asset_materializations_for_node("rl_policy")[0].metadata
    assert policy["policy_version"].value == 2
    newest = Path(policy["policy_uri"].value)
    assert json.loads((newest / "pipeline.json").read_text())["backend"] == "huggingface"
    assert json.loads((newest / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    rows = pl.read_delta(f"{config.lake_uri}/rl/replay_buffer")
    im_start = json.loads((Path(config.init_from) / "tokenizer.json").read_text())["added_tokens"]
    [im_start_id] = [t["id"] for t in im_start if t["content"] == "<|im_start|>"]
    assert all(ids[0] == im_start_id for ids in rows["prompt_token_ids"]), (
        "prompts are encoded in the model's ChatML template"
    )

    refused = materialize(
        [rl_policy],
        instance=instance,
        resources=resources,
        run_config=_run_config(config, **{**given, "tokenizer_path": config.tokenizer_path}),
        raise_on_error=False,
    )
    assert not refused.success
    [failure] = [e for e in refused.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "leave tokenizer_path empty" in failure.event_specific_data.error.message
