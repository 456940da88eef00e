"""GRPO: group advantages worked by hand, the staleness boundary, the clipped surrogate's gradients
by autograd, and completion log-probabilities of a packed row against a log-softmax
gathered by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.dpo import document_logps
from pipeline_assets.trainer.grpo import (
    completion_logps,
    counted_tokens,
    group_advantages,
    grpo_loss,
    stale_mask,
    zero_spread_groups,
)
from pipeline_assets.trainer.model import Transformer

CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=32)
EPS = 1e-6


def test_advantages_are_worked_by_hand_and_zero_for_a_group_without_spread():
    # Group 7: [1, 3], mean 2, sample std sqrt(2). Group 2: [0, 0, 3], mean 1, sample std sqrt(3).
    # Group 5: all 0.9. Group 9: one completion. Ids are neither sorted nor contiguous.
    rewards = torch.tensor([1.0, 0.0, 0.9, 3.0, 0.0, 0.9, 3.0, 0.9, 4.0])
    group_ids = torch.tensor([7, 2, 5, 7, 2, 5, 2, 5, 9])
    root2, root3 = math.sqrt(2), math.sqrt(3)
    expected = torch.tensor(
        [
            -1 / (root2 + EPS),
            -1 / (root3 + EPS),
            0.0,
            1 / (root2 + EPS),
            -1 / (root3 + EPS),
            0.0,
            2 / (root3 + EPS),
            0.0,
            0.0,
        ]
    )

    advantages = group_advantages(rewards, group_ids)

    torch.testing.assert_close(advantages, expected)
    assert (advantages[[2, 5, 7, 8]] == 0).all()  # exactly, though 0.9 * 3 / 3 != 0.9 in float32
    assert zero_spread_groups(rewards, group_ids) == 2


def test_advantages_have_mean_zero_and_sample_std_one_in_every_group_with_spread():
    torch.manual_seed(0)
    group_ids = torch.arange(5).repeat_interleave(torch.tensor([2, 3, 4, 8, 16]))[
        torch.randperm(33)
    ]
    rewards = torch.randn(33, dtype=torch.float64) * 3 + 5

    advantages = group_advantages(rewards, group_ids, eps=0.0)

    for group in range(5):
        in_group = advantages[group_ids == group]
        torch.testing.assert_close(in_group.mean(), torch.tensor(0.0, dtype=torch.float64))
        torch.testing.assert_close(
            in_group.std(correction=1), torch.tensor(1.0, dtype=torch.float64)
        )
    assert zero_spread_groups(rewards, group_ids) == 0


def test_integer_rewards_give_float_advantages():
    advantages = group_advantages(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
    assert advantages.dtype == torch.float32
    half_root2 = math.sqrt(0.5)  # [0, 1]: mean 0.5, sample std sqrt(0.5)
    torch.testing.assert_close(
        advantages, torch.tensor([-0.5 / (half_root2 + EPS), 0.5 / (half_root2 + EPS), 0.0, 0.0])
    )
    assert zero_spread_groups(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1])) == 1


def test_stale_mask_keeps_a_lag_of_max_staleness_and_drops_one_more():
    versions = torch.tensor([10, 8, 7, 6, 5])  # lags 0, 2, 3, 4, 5
    assert stale_mask(versions, current_version=10, max_staleness=3).tolist() == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert stale_mask(versions, current_version=10, max_staleness=0).tolist() == [
        False,
        True,
        True,
        True,
        True,
    ]


def _tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(behaviour log-probabilities, advantages per token, mask), (2, 6) each, some tokens
    masked out."""
    generator = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(2, 6, generator=generator, dtype=torch.float64) * 3
    advantages = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    return behaviour, advantages, mask


def test_on_policy_the_ratio_is_one_nothing_clips_and_the_gradient_is_minus_the_advantage():
    behaviour, advantages, mask = _tokens()
    new = behaviour.clone().requires_grad_()

    loss_sum, stats = grpo_loss(new, behaviour, advantages, mask)
    loss_sum.backward()

    torch.testing.assert_close(loss_sum, -(advantages * mask).sum())
    torch.testing.assert_close(new.grad, torch.where(mask, -advantages, 0.0))
    assert stats["clipped"] == 0
    torch.testing.assert_close(stats["ratio"], mask.sum().to(stats["ratio"].dtype))
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(0.0, dtype=torch.float64))


@pytest.mark.parametrize(
    "ratio, advantage, clipped",
    [
        (1.5, 1.0, True),
        (1.5, -1.0, False),  # past 1 + eps: clipped only where A > 0 pushes it further up
        (0.5, -1.0, True),
        (0.5, 1.0, False),  # below 1 - eps: clipped only where A < 0 pushes it further down
        (1.1, 1.0, False),
        (0.9, -1.0, False),  # inside the clip range
    ],
)
def test_a_ratio_past_the_clip_range_has_no_gradient_only_in_the_direction_the_advantage_pushes(
    ratio, advantage, clipped
):
    behaviour = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    new = (behaviour + torch.tensor([[math.log(ratio), 0.0]], dtype=torch.float64)).requires_grad_()
    advantages = torch.tensor([[advantage, 1.0]], dtype=torch.float64)

    loss_sum, stats = grpo_loss(
        new, behaviour, advantages, torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2
    )
    loss_sum.backward()

    bound = min(max(ratio, 0.8), 1.2)
    torch.testing.assert_close(
        loss_sum,
        torch.tensor(-min(ratio * advantage, bound * advantage) - 1.0, dtype=torch.float64),
    )
    # d(-ratio * A)/d new = -ratio * A where the unclipped term is the minimum, 0 where the
    # clipped one is.
    expected = 0.0 if clipped else -ratio * advantage
    torch.testing.assert_close(new.grad, torch.tensor([[expected, -1.0]], dtype=torch.float64))
    assert stats["clipped"] == int(clipped)
    torch.testing.assert_close(
        stats["approx_kl"], torch.tensor(-math.log(ratio), dtype=torch.float64)
    )


def test_masked_tokens_contribute_nothing_whatever_they_hold():
    behaviour, advantages, mask = _tokens(seed=2)
    new = behaviour + 0.3 * torch.randn(
        2, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6], dtype=torch.float64)
    fill = garbage[torch.arange(12).view(2, 6) % 4]
    noisy = [torch.where(mask, values, fill) for values in (new, behaviour, advantages)]
    clean = new.clone().requires_grad_()
    noisy_new = noisy[0].clone().requires_grad_()

    clean_loss, clean_stats = grpo_loss(clean, behaviour, advantages, mask)
    noisy_loss, noisy_stats = grpo_loss(noisy_new, noisy[1], noisy[2], mask)
    (clean_loss + noisy_loss).backward()

    torch.testing.assert_close(noisy_loss, clean_loss)
    assert all(torch.equal(noisy_stats[name], clean_stats[name]) for name in clean_stats)
    torch.testing.assert_close(noisy_new.grad, clean.grad)
    assert (clean.grad[~mask] == 0).all()
    only_counted = grpo_loss(
        new[mask], behaviour[mask], advantages[mask], torch.ones(int(mask.sum()), dtype=bool)
    )
    torch.testing.assert_close(clean_loss, only_counted[0])


def test_completion_logps_of_a_packed_row_are_the_log_softmax_at_its_counted_targets():
    torch.manual_seed(4)
    model = Transformer(CONFIG).eval()
    # Document 1: prompt 11 12, completion 13 14. Document 2: prompt 21 22 23, completion 24 25; its
    # first token is loss-masked yet starts a document, so it is no target. Then a padding
    # tail of 2.
    batch = {
        "input_ids": torch.tensor([[11, 12, 13, 14, 21, 22, 23, 24, 25, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1]]),
    }
    counted = [2, 3, 7, 8]

    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"])
        logps = completion_logps(logits, **batch)

    log_softmax = torch.log_softmax(logits[0].double(), dim=-1)
    expected = torch.zeros(1, 11, dtype=torch.float64)
    for t in counted:
        expected[0, t] = log_softmax[t - 1, batch["input_ids"][0, t]]
    assert logps.shape == batch["input_ids"].shape and logps.dtype == torch.float32
    assert (
        torch.nonzero(counted_tokens(batch["loss_mask"], batch["position_ids"])[0])
        .flatten()
        .tolist()
        == counted
    )
    torch.testing.assert_close(logps.double(), expected, rtol=1e-5, atol=1e-5)
    # One definition of which targets count: per document, they sum to DPO's response
    # log-probability.
    per_document = torch.stack([logps[0, :4].sum(), logps[0, 4:9].sum()])
    torch.testing.assert_close(per_document, document_logps(logits, **batch))


def test_packed_completions_give_the_loss_and_gradients_of_one_completion_a_row():
    from pipeline_assets.trainer.grpo import pack_completions
    from pipeline_assets.trainer.sampling import Completion, completion_rows

    torch.manual_seed(3)
    model = Transformer(CONFIG)
    prompts = [[1, 5, 7], [1, 9], [1, 4, 4, 6, 2]]
    completions = [[11, 12, 13, 3], [14, 3], [15, 16, 3]]
    behaviour = [[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.2], [-1.5, -0.7, -0.9]]
    advantages = torch.tensor([0.7, -1.2, 0.4])

    def loss_and_grads(rows, per_token):
        model.zero_grad()
        logps = completion_logps(
            model(rows.input_ids, rows.position_ids),
            rows.input_ids,
            rows.loss_mask,
            rows.position_ids,
        )
        loss, _ = grpo_loss(logps, rows.behaviour_logps.float(), per_token.float(), rows.loss_mask)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    one_a_row = completion_rows(
        prompts,
        [Completion(i, c, b) for i, (c, b) in enumerate(zip(completions, behaviour))],
        pad_id=0,
    )
    padded = loss_and_grads(one_a_row, advantages[:, None].expand_as(one_a_row.behaviour_logps))
    packed_rows = pack_completions(
        prompts, completions, behaviour, advantages, seq_len=16, pad_id=0
    )
    assert packed_rows.input_ids.shape[0] < len(prompts), "documents share rows"
    packed = loss_and_grads(packed_rows, packed_rows.advantages)

    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    for name, gradient in padded[1].items():
        torch.testing.assert_close(packed[1][name], gradient, rtol=1e-4, atol=1e-6, msg=name)
