"""The RL job's processes on CPU: a learner and rollout workers around rl/replay_buffer and the
policy versions in the checkpoint store. Versions increase, every rollout is taken once, a lagging
worker's rollouts are dropped as stale and fail the freshness judgement naming the lag, and a
SIGTERMed learner resumes from its newest version."""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime, timezone

import polars as pl

from pipeline_assets.lib.rl.replay import StalenessPolicy, freshness
from pipeline_assets.trainer.config import EXIT_PREEMPTED
from pipeline_assets.trainer.policy_store import PolicyStore
from pipeline_assets_tests.trainer.rl_setup import dropped_shares, rl_inputs, start

TIMEOUT = 240


def _metrics(config) -> list[dict]:
    path = PolicyStore(config.checkpoint_uri, config.partition).store.local_folder(
        "rl_metrics.jsonl"
    )
    return [json.loads(line) for line in path.read_text().splitlines()]


def _buffer(config) -> pl.DataFrame:
    return pl.read_delta(f"{config.lake_uri}/rl/replay_buffer")


def _wait_all(*processes) -> list[int]:
    return [process.wait(timeout=TIMEOUT) for process in processes]


def test_a_learner_and_its_worker_publish_versions_and_take_each_rollout_once(tmp_path):
    config = rl_inputs(tmp_path)
    codes = _wait_all(
        start(config, tmp_path / "learner.log"), start(config, tmp_path / "worker.log", worker=0)
    )

    assert codes == [0, 0], (tmp_path / "learner.log").read_text()[-3000:]
    policies = PolicyStore(config.checkpoint_uri, config.partition)
    assert policies.newest() == 3 and policies.done()
    metrics = _metrics(config)
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    assert {
        "reward_mean",
        "zero_spread_share",
        "staleness_max",
        "dropped_stale",
        "clip_fraction",
    } <= set(metrics[0])
    assert "held_out_accuracy" in metrics[1] and "held_out_accuracy" in metrics[2]
    rows = _buffer(config)
    assert rows["rollout_id"].n_unique() == rows.height
    consumed = rows.filter(pl.col("status") == "consumed")
    assert consumed.height >= 3 * config.prompts_per_update * config.group_size
    lag = consumed["consumed_by_version"] - consumed["policy_version"]
    assert lag.min() >= 0 and lag.max() <= config.max_staleness
    assert set(consumed["consumed_by_version"]) == {0, 1, 2}, (
        "each update consumed the rows it trained on"
    )


def test_a_lagging_worker_s_rollouts_are_dropped_and_freshness_fails_naming_the_lag(tmp_path):
    config = rl_inputs(tmp_path, updates=6, max_staleness=1)
    codes = _wait_all(
        start(config, tmp_path / "learner.log"),
        start(config, tmp_path / "w0.log", worker=0),
        start(config, tmp_path / "w1.log", worker=1, lag=3),
    )

    assert codes == [0, 0, 0], (tmp_path / "learner.log").read_text()[-3000:]
    rows = _buffer(config)
    dropped = rows.filter(pl.col("status") == "dropped_stale")
    shares = dropped_shares(rows)
    assert shares["worker-1"] > shares["worker-0"], f"the lagging worker loses the most: {shares}"
    assert ((dropped["consumed_by_version"] - dropped["policy_version"]) > 1).all(), (
        "every dropped rollout lagged beyond the limit"
    )
    assert sum(m["dropped_stale"] for m in _metrics(config)) == dropped.height
    judgement = freshness(rows, StalenessPolicy(1, 3600.0), datetime.now(timezone.utc))
    assert not judgement.passed and "dropped as stale, lagging up to" in judgement.description
    assert "(limit 1)" in judgement.description


def test_a_sigtermed_learner_resumes_from_its_newest_version(tmp_path):
    config = rl_inputs(tmp_path, updates=6)
    policies = PolicyStore(config.checkpoint_uri, config.partition)
    worker = start(config, tmp_path / "worker.log", worker=0)
    learner = start(config, tmp_path / "learner-1.log")
    deadline = time.monotonic() + TIMEOUT
    while (policies.newest() or 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=TIMEOUT) == EXIT_PREEMPTED, (
        tmp_path / "learner-1.log"
    ).read_text()[-3000:]
    stopped_at = policies.newest()
    assert 2 <= stopped_at < config.updates and not policies.done()

    resumed = start(config, tmp_path / "learner-2.log")
    assert _wait_all(resumed, worker) == [0, 0], (tmp_path / "learner-2.log").read_text()[-3000:]
    assert f"resumed from policy v{stopped_at}" in (tmp_path / "learner-2.log").read_text()
    versions = [m["policy_version"] for m in _metrics(config)]
    assert versions == list(range(1, config.updates + 1)), (
        "versions still increase: none repeated, none skipped"
    )
    rows = _buffer(config)
    assert rows["rollout_id"].n_unique() == rows.height
