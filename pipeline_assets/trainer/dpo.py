"""Direct Preference Optimization (Rafailov et al., 2023) on packed preference pairs.

The rows come from ``lib.gold.preference_packing``: documents alternate chosen, rejected, chosen,
... and each restarts its ``position_ids`` at 0. The policy and the frozen reference model score the
same rows; ``document_logps`` turns either's logits into one summed response log-probability per
document, ``chosen_and_rejected`` pairs documents 2k and 2k + 1, and ``dpo_loss`` is the sigmoid
loss ``-logsigmoid(beta * ((pc - rc) - (pr - rr)))`` with its reward metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline_assets.trainer.config import DEFAULT_BETA
from pipeline_assets.trainer.model import counted_targets


def document_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """(n_documents,): per document, the summed log-probability of its loss-masked tokens, documents
    in row order, row after row (``summed_document_logps`` of the logits' next-token
    log-probabilities)."""
    return summed_document_logps(_target_logps(logits, input_ids), loss_mask, position_ids)


def summed_document_logps(
    target_logps: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """(n_documents,) from ``target_logps`` (B, T-1), log p(token t+1 | tokens <= t): e.g. the
    negated per-token losses a model computes in chunks (``model(..., next_token_losses=True)``).

    A document starts wherever ``position_ids`` is 0; its first token is never a target (the shift
    stops at every boundary, as in the SFT loss). The padding tail, the last segment of a row with
    no loss-masked token, is not a document: a packed document always has response tokens.
    """
    segment, last_of_row = _segments(position_ids)
    n_segments = int(last_of_row[-1]) + 1 if last_of_row.numel() else 0
    counted = counted_targets(loss_mask.bool(), position_ids)
    token_logps = torch.where(counted, target_logps, 0.0)
    sums = token_logps.new_zeros(n_segments).index_add(
        0, segment[:, 1:].flatten(), token_logps.flatten()
    )
    loss_tokens = torch.zeros(n_segments, dtype=torch.long, device=target_logps.device).index_add(
        0, segment.flatten(), loss_mask.flatten().long()
    )
    is_padding = torch.zeros(n_segments, dtype=torch.bool, device=target_logps.device)
    is_padding[last_of_row] = loss_tokens[last_of_row] == 0
    return sums[~is_padding]


def chosen_and_rejected(logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document values in packed order -> (chosen, rejected), one entry per pair."""
    if logps.numel() % 2:
        raise ValueError(
            f"{logps.numel()} documents: packed pairs give an even number (chosen, rejected, ...)"
        )
    return logps[0::2], logps[1::2]


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = DEFAULT_BETA,
    global_pairs: int | torch.Tensor | None = None,
    world_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sigmoid DPO over this rank's pairs, normalised for data parallelism; returns (loss, metrics).

    ``global_pairs``: the pairs of the whole global batch, over every rank and micro-batch (None:
    this call's pairs, a single process). ``world_size``: the ranks FSDP averages gradients over.

    The global batch's loss is ``sum over all pairs / global_pairs``. FSDP2 averages each gradient
    over the ranks (divides their sum by world_size), so every rank returns its pairs' sum times
    ``world_size / global_pairs``: the average over ranks is then exactly the single-process loss,
    and so are its gradients, however unevenly the pairs are spread (a rank with 3 pairs weighs 3
    times one with 1). Dividing by the local pair count instead would weigh each rank equally. The
    returned loss, averaged over ranks (all_reduce AVG), is the global batch's loss to log.

    Metrics, means over this call's pairs (0 when it has none; ``pairs`` says how many to weigh them
    by): ``loss``, the sigmoid loss, unscaled; ``rewards/chosen`` and ``rewards/rejected``, the
    implicit rewards beta * (policy - reference); ``rewards/margins``, chosen minus rejected;
    ``rewards/accuracies``, the share of pairs whose chosen reward is strictly higher (a tie, as at
    the start where policy == reference, is no win).
    """
    if global_pairs is None:
        if world_size != 1:
            raise ValueError(
                "with world_size > 1, pass global_pairs: the pairs of the whole global batch"
            )
        global_pairs = policy_chosen.numel()
    chosen_rewards = beta * (policy_chosen - reference_chosen.detach())
    rejected_rewards = beta * (policy_rejected - reference_rejected.detach())
    margins = chosen_rewards - rejected_rewards
    losses = -F.logsigmoid(margins)
    scale = world_size / torch.as_tensor(global_pairs, device=losses.device).clamp(min=1)
    loss = losses.sum() * scale
    metrics = {
        "loss": _mean(losses),
        "rewards/chosen": _mean(chosen_rewards),
        "rewards/rejected": _mean(rejected_rewards),
        "rewards/margins": _mean(margins),
        "rewards/accuracies": _mean((margins > 0).to(margins.dtype)),
        "pairs": torch.tensor(margins.numel(), device=margins.device),
    }
    return loss, metrics


def _segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment of every token numbered across the batch, row-major; the last segment of each
    row)."""
    if position_ids.numel() and (position_ids[:, 0] != 0).any():
        raise ValueError("every row must start a document: position_ids[:, 0] == 0")
    within_row = torch.cumsum(position_ids == 0, dim=-1) - 1
    per_row = (
        within_row[:, -1] + 1
        if position_ids.numel()
        else position_ids.new_zeros(position_ids.shape[0])
    )
    first_of_row = torch.cumsum(per_row, dim=0) - per_row
    return within_row + first_of_row[:, None], first_of_row + per_row - 1


def _target_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1): log p(token t+1 | tokens <= t), in at least fp32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    batch, length = input_ids.shape
    targets = input_ids[:, 1:].flatten()
    return -F.cross_entropy(logits[:, :-1].flatten(0, 1).to(dtype), targets, reduction="none").view(
        batch, length - 1
    )


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.detach().mean() if values.numel() else values.new_zeros(())
