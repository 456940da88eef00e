"""Tiny packed preference pairs and models for the DPO tests (also imported by
dpo_gradient_probe.py)."""

from __future__ import annotations

import polars as pl
import torch

from pipeline_assets.lib.gold.preference_packing import pack_pairs
from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.dpo import chosen_and_rejected, document_logps, dpo_loss
from pipeline_assets.trainer.model import Transformer
from pipeline_assets_tests.lib.gold.tokenized_pairs import random_pairs as any_vocabulary_pairs

SEQ_LEN, PAD_ID = 64, 0
CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=SEQ_LEN)
POLICY_SEED, REFERENCE_SEED = 0, 1
# (prefix, chosen, rejected) tokens: the first pair fills a row alone (60 tokens), the other three
# share one (20 + 18 + 20): the two ranks of the gradient test hold 3 pairs and 1.
TWO_ROW_SHAPES = [(10, 18, 22), (4, 5, 7), (3, 6, 6), (5, 4, 6)]


def random_pairs(shapes: list[tuple[int, int, int]], seed: int = 0) -> pl.DataFrame:
    """Pairs of the given (prefix, chosen, rejected) lengths, token ids within the tiny model's
    vocabulary."""
    return any_vocabulary_pairs(shapes, seed, vocab_size=CONFIG.vocab_size)


def two_rank_rows() -> pl.DataFrame:
    """The packed rows of TWO_ROW_SHAPES, the row of three pairs first."""
    rows = pack_pairs(random_pairs(TWO_ROW_SHAPES), SEQ_LEN, PAD_ID).rows
    return rows.sort(pl.col("pair_ids").list.len(), descending=True)


def batch_of(rows: pl.DataFrame) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor(rows["input_ids"].to_list(), dtype=torch.long),
        "loss_mask": torch.tensor(rows["loss_mask"].to_list(), dtype=torch.bool),
        "position_ids": torch.tensor(rows["position_ids"].to_list(), dtype=torch.long),
    }


def policy_and_reference(attention_kernel: str = "dense") -> tuple[Transformer, Transformer]:
    torch.manual_seed(POLICY_SEED)
    policy = Transformer(CONFIG, attention_kernel)
    torch.manual_seed(REFERENCE_SEED)
    return policy, Transformer(CONFIG, attention_kernel).eval()


def logps_of(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed response log-probabilities, one per pair of the batch."""
    logits = model(batch["input_ids"], batch["position_ids"])
    return chosen_and_rejected(document_logps(logits, **batch))


def batch_loss(
    policy, reference, batch: dict[str, torch.Tensor], global_pairs=None, world_size: int = 1
):
    """The DPO loss of a batch of packed rows: what one rank computes for its share."""
    with torch.no_grad():
        reference_chosen, reference_rejected = logps_of(reference, batch)
    policy_chosen, policy_rejected = logps_of(policy, batch)
    return dpo_loss(
        policy_chosen,
        policy_rejected,
        reference_chosen,
        reference_rejected,
        global_pairs=global_pairs,
        world_size=world_size,
    )
