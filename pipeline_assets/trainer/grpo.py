"""Group Relative Policy Optimization (Shao et al., 2024): the policy update of the RL overlay.

Every prompt is sampled several times, a group of completions; ``group_advantages`` scores each
completion against its own group, ``(reward - group mean) / (group std + eps)``, so no value model
is needed. Completions come from a policy a few versions old: ``stale_mask`` names those too old to
learn from, and ``grpo_loss`` corrects the rest with PPO's clipped importance ratio between the
policy being trained and the behaviour policy that sampled them.

Token tensors here are shaped like ``input_ids`` (B, T): entry t is about token t, predicted from
the tokens before it. Rows are packed as for SFT and DPO: ``position_ids`` restart at 0 at every
document and ``loss_mask`` marks completion tokens; ``counted_tokens`` is ``model.counted_targets``
in that alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline_assets.lib.gold.packing import pack, packed_values, plan_best_fit_decreasing
from pipeline_assets.trainer.language_model import LanguageModel
from pipeline_assets.trainer.model import counted_targets, token_losses


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """(N,): per completion, ``(r - mean_g) / (std_g + eps)`` over the completions of its group g,
    std the sample one (divided by the group's size - 1, as TRL's and verl's GRPO). A group whose
    rewards all equal, a single completion included, has nothing to compare: each of its completions
    gets exactly 0."""
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    group, sizes, spread = _groups(rewards, group_ids)
    mean = rewards.new_zeros(sizes.numel()).index_add(0, group, rewards) / sizes
    centred = rewards - mean[group]
    std = (
        centred.new_zeros(sizes.numel()).index_add(0, group, centred**2) / (sizes - 1).clamp(min=1)
    ).sqrt()
    # Equal rewards can leave a rounding error in the mean (0.9 * 3 / 3 != 0.9 in fp32), which
    # divided by a std as small would be noise, not 0: a group without spread is found by min == max
    # instead.
    return torch.where(spread[group], centred / (std[group] + eps), 0.0)


def zero_spread_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> int:
    """How many groups have all their rewards equal, hence no advantage and no gradient."""
    return int((~_groups(rewards, group_ids)[2]).sum())


def stale_mask(
    policy_versions: torch.Tensor, current_version: int, max_staleness: int
) -> torch.Tensor:
    """Bool, shaped like ``policy_versions``: True where a completion was sampled more than
    ``max_staleness`` versions before ``current_version`` (``current - version > max_staleness``),
    too old to train on."""
    return current_version - policy_versions > max_staleness


def counted_tokens(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: ``counted_targets`` (B, T-1) moved onto the tokens it counts, column t - 1 to t:
    a token counts when loss-masked and not the first of its document; token 0 of a row never
    does."""
    targets = counted_targets(loss_mask.bool(), position_ids)
    return torch.cat([torch.zeros_like(targets[:, :1]), targets], dim=1)


def completion_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """(B, T), in fp32: ``log p(token t | tokens < t of its document)`` where ``counted_tokens``
    holds, 0 elsewhere. The negated ``token_losses``, shifted to sit on the token they predict."""
    return _on_counted_tokens(-token_losses(logits, input_ids), loss_mask, position_ids)


def policy_logps(
    model: LanguageModel,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """``completion_logps`` of the model's logits at temperature 1, from its chunked next-token
    losses: the (tokens x vocabulary) logits of the batch are never held at once."""
    losses = model(input_ids, position_ids, next_token_losses=True)
    return _on_counted_tokens(-losses, loss_mask, position_ids)


def _on_counted_tokens(
    target_logps: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-target log-probabilities (B, T-1) moved onto the token each predicts (B, T), 0 where
    ``counted_tokens`` does not hold."""
    logps = F.pad(target_logps, (1, 0))
    return torch.where(counted_tokens(loss_mask, position_ids), logps, 0.0)


def grpo_loss(
    new_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages_per_token: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, summed over the tokens where ``mask`` is set; returns (loss_sum,
    stats).

    Per token, ``ratio = exp(new - behaviour)`` and the loss is
    ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``: once the ratio has moved past the clip
    range in the direction A rewards, the token's gradient is 0. Only ``new_logps`` is
    differentiated. The caller divides the sum by the completion tokens of the whole global batch,
    as ``objective.py`` does with its units.

    ``stats``, detached sums over the counted tokens (divided by their number: means): ``clipped``,
    the tokens whose gradient the clip zeroes; ``ratio``; ``approx_kl``, ``behaviour - new``, the k1
    estimate of KL(behaviour || new).
    """
    mask = mask.bool()
    # Masked tokens get ratio 1 and A = 0 before any product, so their surrogate is 0: whatever sits
    # there (prompt, padding, even inf or nan) reaches neither the sum nor a gradient.
    log_ratio = torch.where(mask, new_logps - behaviour_logps.detach(), 0.0)
    ratio, advantages = log_ratio.exp(), torch.where(mask, advantages_per_token.detach(), 0.0)
    surrogate = torch.minimum(
        ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    )
    clipped = ((ratio > 1 + clip_eps) & (advantages > 0)) | (
        (ratio < 1 - clip_eps) & (advantages < 0)
    )
    stats = {
        "clipped": clipped.sum(),
        "ratio": torch.where(mask, ratio, 0.0).sum().detach(),
        "approx_kl": -log_ratio.sum().detach(),
    }
    return -surrogate.sum(), stats


def _groups(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each completion's group numbered 0.., each group's size, whether its rewards differ at
    all)."""
    _, group, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = sizes.numel()
    highest = rewards.new_zeros(n_groups).scatter_reduce(
        0, group, rewards, "amax", include_self=False
    )
    lowest = rewards.new_zeros(n_groups).scatter_reduce(
        0, group, rewards, "amin", include_self=False
    )
    return group, sizes, highest > lowest


@dataclass(frozen=True)
class PackedCompletions:
    """Prompt + completion documents packed into rows by the batch path's packer
    (``lib.gold.packing``, best-fit decreasing, positions restarting at every document):
    ``loss_mask`` on the completion tokens, and there each token's behaviour log-probability and its
    completion's advantage, in ``completion_logps``'s alignment (entry t is about token t)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logps: torch.Tensor
    advantages: torch.Tensor


def pack_completions(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    behaviour_logps: list[list[float]],
    advantages: torch.Tensor,
    seq_len: int,
    pad_id: int,
) -> PackedCompletions:
    """Completion ``i`` after prompt ``i``, every one a document, packed into rows of
    ``seq_len`` (at least the longest document: a completion cut in two would lose the prompt
    before its second piece), filled with ``pad_id`` (the encoder's)."""
    documents = [
        np.asarray(p + c, dtype=np.int64) for p, c in zip(prompt_ids, completion_ids, strict=True)
    ]
    masks = [
        np.r_[np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]
        for p, c in zip(prompt_ids, completion_ids)
    ]
    logps = [
        np.r_[np.zeros(len(p)), np.asarray(lp, dtype=np.float64)]
        for p, lp in zip(prompt_ids, behaviour_logps)
    ]
    per_token = [
        np.r_[np.zeros(len(p)), np.full(len(c), float(a))]
        for p, c, a in zip(prompt_ids, completion_ids, advantages.tolist())
    ]
    plan = plan_best_fit_decreasing(np.array([len(d) for d in documents]), seq_len)
    packed = pack(plan, documents, masks, seq_len, pad_id)
    return PackedCompletions(
        input_ids=torch.from_numpy(packed["input_ids"]).long(),
        position_ids=torch.from_numpy(packed["position_ids"]).long(),
        loss_mask=torch.from_numpy(packed["loss_mask"]).bool(),
        behaviour_logps=torch.from_numpy(packed_values(plan, logps, seq_len)),
        advantages=torch.from_numpy(packed_values(plan, per_token, seq_len)),
    )
