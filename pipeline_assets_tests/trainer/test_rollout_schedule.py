"""A rollout worker on a fixed schedule (``off_policy_steps``), learner and workers in this
process: the batch an update takes is drawn the same by any worker process, whatever ran before,
and it is sampled with the version the schedule names (on-policy: the update's own, waiting for
it; one step off: the one before, without waiting)."""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from pipeline_assets.trainer.rl import Learner
from pipeline_assets.trainer.rollout import RolloutWorker
from pipeline_assets_tests.trainer.rl_setup import rl_inputs

_DRAWN = ("prompt_id", "policy_version", "completion_token_ids", "behaviour_logps", "reward")


def _pending(learner: Learner) -> pl.DataFrame:
    rows = learner.table.read(learner.config.partition)
    return rows.filter(pl.col("status") == "pending").select(_DRAWN)


def test_each_update_s_batch_is_drawn_from_its_seed_and_its_scheduled_version(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # two learners in one process
    config = rl_inputs(tmp_path, off_policy_steps=1)
    learners = [Learner(replace(config, partition=run)) for run in ("rl-a", "rl-b")]
    for learner in learners:
        learner._start()
    for learner in learners:
        assert RolloutWorker(replace(learner.config, worker=0)).roll_once(0)
    first, second = (_pending(learner) for learner in learners)
    assert first.height == config.prompts_per_update * config.group_size
    assert first.equals(second), "two worker processes draw update 0's batch alike"

    learner = learners[0]
    consumed, _ = learner._wait_for_rollouts(0)
    assert consumed.height == first.height
    on_policy = RolloutWorker(replace(learner.config, worker=0, off_policy_steps=0))
    assert not on_policy.roll_once(1), "update 1's on-policy batch waits for version 1"
    one_step_off = RolloutWorker(replace(learner.config, worker=0))
    assert one_step_off.roll_once(1)
    assert _pending(learner)["policy_version"].unique().to_list() == [0]
    assert not _pending(learner).equals(first), "update 1's batch has a seed of its own"


def test_a_free_running_worker_draws_anew(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = rl_inputs(tmp_path, bank_tasks=100)
    learners = [Learner(replace(config, partition=run)) for run in ("rl-a", "rl-b")]
    for learner in learners:
        learner._start()
        assert RolloutWorker(replace(learner.config, worker=0)).roll_once(0)
    first, second = (_pending(learner)["prompt_id"].to_list() for learner in learners)
    assert first != second, "a restarted worker would otherwise redraw its predecessor's prompts"
