"""The RL overlay on a Hugging Face policy (a tiny Qwen2, its own tokenizer and ChatML template),
learner and rollout worker in this process: the learner warm-starts it and publishes it in its
family's format, a worker samples with it, one GRPO update moves it, and the worker's next batch
comes from exactly the weights the learner published."""

from __future__ import annotations

import json
from dataclasses import replace

import polars as pl
import torch

from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.grpo import policy_logps
from pipeline_assets.trainer.hf_model import BACKEND, HuggingFaceLM
from pipeline_assets.trainer.policy_store import version_folder
from pipeline_assets.trainer.rl import Learner
from pipeline_assets.trainer.rollout import RolloutWorker
from pipeline_assets.trainer.sampling import Completion, completion_rows
from pipeline_assets_tests.trainer.rl_setup import hf_rl_inputs


def _weights(model: HuggingFaceLM) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _differ(one: dict, other: dict) -> bool:
    return any(not torch.equal(one[name], other[name]) for name in one)


def test_a_hugging_face_policy_is_updated_published_and_sampled_by_a_worker(tmp_path):
    # Two warm-start steps (an accuracy it cannot reach): the sft path on the policy too.
    config = hf_rl_inputs(tmp_path, bank_tasks=60, warm_start_accuracy=1.0, warm_start_max_steps=2)
    learner = Learner(config)
    started = _weights(load_exported(config.init_from)[0])
    version, model, optimizer = learner._start()
    assert version == 0 and isinstance(model, HuggingFaceLM)
    assert _differ(started, _weights(model)), "the warm start trained the policy"
    v0 = learner.policies.store.local_folder(version_folder(0))
    assert json.loads((v0 / "pipeline.json").read_text())["backend"] == BACKEND
    assert json.loads((v0 / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    worker = RolloutWorker(replace(config, worker=0))
    assert worker.roll_once(0)
    assert isinstance(worker.model, HuggingFaceLM)
    consumed, dropped = learner._wait_for_rollouts(0)
    assert consumed.height == config.prompts_per_update * config.group_size
    assert dropped.is_empty()
    # A random policy answers nothing right: half of each group is rewarded, so that the
    # update has advantages to follow.
    spread = consumed.sort("group_id", "rollout_id").with_columns(
        reward=(pl.int_range(pl.len()).over("group_id") % 2).cast(pl.Float64)
    )
    before = _weights(model)

    metrics = learner._update(model, optimizer, (spread, dropped), 0)
    learner.policies.publish(1, model, optimizer, {"partition": config.partition})

    assert _differ(before, _weights(model)), "the update moved the policy"
    assert metrics["groups"] == config.prompts_per_update and metrics["reward_std"] > 0
    assert worker.roll_once(1)
    assert worker.loaded == 1
    for name, tensor in _weights(model).items():
        assert torch.equal(worker.model.state_dict()[name], tensor), name
    rows = learner.table.read(config.partition).filter(pl.col("policy_version") == 1)
    assert rows.height == config.prompts_per_update * config.group_size
    prompts = rows["prompt_token_ids"].to_list()
    completions = [
        Completion(index, tokens, logps)
        for index, (tokens, logps) in enumerate(
            zip(rows["completion_token_ids"].to_list(), rows["behaviour_logps"].to_list())
        )
    ]
    batch = completion_rows(prompts, completions, pad_id=learner.encoder.pad_id)
    with torch.no_grad():
        learner_logps = policy_logps(
            model.eval(), batch.input_ids, batch.loss_mask, batch.position_ids
        )
    torch.testing.assert_close(
        learner_logps[batch.loss_mask],
        batch.behaviour_logps[batch.loss_mask],
        rtol=0,
        atol=1e-4,
        msg="the worker sampled from exactly the learner's published policy",
    )
