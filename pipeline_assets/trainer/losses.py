"""Next-token cross-entropy from the final hidden states and the output layer, a chunk of tokens at
a time: memory never holds the (tokens x vocabulary) logits of a whole batch.

Each chunk's logits live only inside ``torch.utils.checkpoint``: the forward pass keeps its hidden
states and the output weight (saved anyway), the backward pass recomputes the chunk's logits to
differentiate them. With a vocabulary of 150k and 16k tokens a micro-batch, the logits alone would
be 10 GB in fp32; a chunk of 1,024 tokens holds 0.6 GB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK_TOKENS = 1024


def next_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """(B, T-1): -log p(input_ids[:, t+1] | tokens <= t), from ``hidden`` (B, T, D), the output
    layer's ``weight`` (V, D) and ``bias``; in fp32 (fp64 for fp64 inputs), as
    ``model.token_losses`` computes them from whole logits."""
    batch, length = input_ids.shape
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    parts = []
    for start in range(0, targets.numel(), chunk_tokens):
        chunk = (
            states[start : start + chunk_tokens],
            weight,
            bias,
            targets[start : start + chunk_tokens],
        )
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_losses, *chunk, use_reentrant=False))
        else:
            parts.append(_chunk_losses(*chunk))
    if not parts:
        return hidden.new_zeros(batch, 0, dtype=_loss_dtype(hidden))
    # a tensor of its own, not a view: FSDP2 warns about a view returned from a sharded forward
    return torch.cat(parts).view(batch, length - 1).clone()


def _chunk_losses(
    states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(states, weight, bias)
    return F.cross_entropy(logits.to(_loss_dtype(logits)), targets, reduction="none")


def _loss_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)
