"""A decoder-only transformer small enough to read top to bottom.

RMSNorm before each sublayer, rotary positions, SwiGLU feed-forward, tied input and output
embeddings. Sequences arrive packed (several documents per row); ``position_ids`` restart at 0 at
each document, and attention is masked so that a token sees only earlier tokens of its own document.

Two attention kernels keep documents apart, with the same result: ``dense`` builds a (B, 1, T, T)
boolean mask for scaled_dot_product_attention; ``flex`` gives FlexAttention a block mask, so that a
fused kernel skips every block of scores outside a document (compiled, on CUDA).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.losses import next_token_losses as chunked_next_token_losses


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair: (max_seq_len, head_dim / 2)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x (B, H, T, D) by the angles of cos/sin
    (B, T, D/2)."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.type_as(x)


ATTENTION_KERNELS = ("dense", "flex")


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): the document of its row each token belongs to. A document starts wherever
    ``position_ids`` is 0 (the padding tail is one more document)."""
    return torch.cumsum(position_ids == 0, dim=-1)


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: query i may attend key j when j <= i and both lie in the same
    document."""
    document = document_ids(position_ids)
    same_document = document[:, :, None] == document[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same_document & causal)[:, None]


def document_causal_mask_mod(position_ids: torch.Tensor):
    """The same mask as FlexAttention's ``mask_mod``: a function of (batch, head, query, key)
    indexes."""
    document = document_ids(position_ids)

    def causal_within_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document[b, q_idx] == document[b, kv_idx])

    return causal_within_document


def document_block_mask(position_ids: torch.Tensor) -> BlockMask:
    """The mask as FlexAttention's block mask, built once per forward and shared by every layer."""
    batch, length = position_ids.shape
    build = _compiled(create_block_mask) if position_ids.is_cuda else create_block_mask
    return build(
        document_causal_mask_mod(position_ids),
        batch,
        None,
        length,
        length,
        device=position_ids.device,
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask
) -> torch.Tensor:
    """Masked attention of q, k, v (B, H, T, D): FlexAttention for a block mask, SDPA for a dense
    one."""
    if isinstance(mask, BlockMask):
        kernel = _compiled(flex_attention) if q.is_cuda else flex_attention
        return kernel(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@functools.cache
def _compiled(function):
    # Compiled on first use, and only on CUDA: uncompiled, flex_attention materializes every score
    # as the dense path does; on CPU, compiling costs 20 s or more and FlexAttention has no
    # backward.
    return torch.compile(function)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        batch, length, dim = x.shape
        q, k, v = (
            self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = attend(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, attention_kernel: str = "dense"):
        super().__init__()
        if config.dim % config.n_heads:
            raise ValueError(f"dim {config.dim} is not a multiple of n_heads {config.n_heads}")
        if attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"unknown attention kernel {attention_kernel!r}; choose "
                f"{' or '.join(ATTENTION_KERNELS)}"
            )
        self.config = config
        self.attention_kernel = attention_kernel
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.output.weight = self.embedding.weight
        cos, sin = rotary_tables(
            config.dim // config.n_heads, config.max_seq_len, config.rope_theta
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled down by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(parameter)
            else:
                std = (
                    residual_std
                    if name.endswith(("attention.out.weight", "ffn.down.weight"))
                    else 0.02
                )
                nn.init.normal_(parameter, mean=0.0, std=std)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    def save(self, folder: Path, about: dict) -> list[str]:
        """This model as ``LlamaForCausalLM`` (``export.save_exported``), its preset's config in
        pipeline.json beside ``about``."""
        from pipeline_assets.trainer.export import save_exported  # export imports this module

        state = {name: tensor.detach().cpu() for name, tensor in self.state_dict().items()}
        return save_exported(state, self.config, folder, about)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, next_token_losses: bool = False
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids and their in-document positions, both (B, T); with
        ``next_token_losses``, each token's next-token cross-entropy (B, T-1) instead, computed a
        chunk at a time (``trainer.losses``) without the whole logits ever in memory."""
        cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        flex = self.attention_kernel == "flex"
        mask = document_block_mask(position_ids) if flex else document_causal_mask(position_ids)
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        x = self.norm(x)
        if next_token_losses:
            return chunked_next_token_losses(x, self.output.weight, input_ids)
        return self.output(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 per weight plus attention's scores (PaLM,
    app. B)."""
    weights = (
        config.n_layers * (4 * config.dim**2 + 3 * config.dim * config.ffn_dim)
        + config.vocab_size * config.dim
    )
    attention = 12 * config.n_layers * config.dim * seq_len
    return 6 * weights + attention


def counted_targets(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1): target t+1 counts when its loss_mask is set and it does not start a new document
    (a model is never asked to predict across a document boundary)."""
    return loss_mask[:, 1:] & (position_ids[:, 1:] != 0)


def token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1): next-token cross-entropy of every target, in fp32."""
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none"
    )
    return losses.view(input_ids.shape[0], -1)


def loss_sum_and_count(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the counted targets, and how many there are."""
    return counted_loss_sum(token_losses(logits, input_ids), loss_mask, position_ids)


def counted_loss_sum(
    losses: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of per-target losses (B, T-1) over the counted targets, and how many there are."""
    counted = counted_targets(loss_mask, position_ids)
    return (losses * counted).sum(), counted.sum()
