"""The RL job learns: on the generated sort task, a tiny policy warm-started on the bank's training
prompts (it starts unable to do the task) and then trained by GRPO through the learner and a rollout
worker gains at least 0.2 of mean reward between its first and last ten updates within 60, and
answers at least half of the held-out prompts right by greedy decoding. Seeded, and on a fixed
schedule (``off_policy_steps`` 1: update u trains on the batch sampled with version u - 1), so the
learner sees the same batches however loaded the machine is; settings as measured in docs/rl.md,
"What was measured"."""

from __future__ import annotations

import json

from pipeline_assets.trainer.policy_store import PolicyStore
from pipeline_assets_tests.trainer.rl_setup import rl_inputs, start


def test_grpo_raises_reward_and_held_out_accuracy_on_the_sort_task(tmp_path):
    config = rl_inputs(
        tmp_path,
        bank_tasks=6000,
        dim=96,
        n_layers=3,
        tasks="sort",
        updates=60,
        prompts_per_update=32,
        group_size=8,
        eval_every=10,
        held_out_prompts=200,
        warm_start_accuracy=0.3,
        off_policy_steps=1,
    )
    learner, worker = (
        start(config, tmp_path / "learner.log"),
        start(config, tmp_path / "worker.log", worker=0),
    )
    assert learner.wait(timeout=600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    assert worker.wait(timeout=60) == 0

    log = (tmp_path / "learner.log").read_text()
    assert "warm start:" in log, (
        "the untrained policy could not sort: it was tuned on the training prompts first"
    )
    path = PolicyStore(config.checkpoint_uri, config.partition).store.local_folder(
        "rl_metrics.jsonl"
    )
    history = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(m["staleness_max"], m["dropped_stale"]) for m in history] == [(0, 0)] + [
        (1, 0)
    ] * 59, "every update after the first trained on a batch of the version before it"
    first = sum(m["reward_mean"] for m in history[:10]) / 10
    last = sum(m["reward_mean"] for m in history[-10:]) / 10
    assert last >= first + 0.2, (
        f"mean reward {first:.3f} over the first 10 updates, {last:.3f} over the last 10"
    )
    assert history[-1]["held_out_accuracy"] >= 0.5, history[-1]
