"""Tokenized preference pairs of chosen shapes, for the packing and DPO tests (no torch)."""

from __future__ import annotations

import numpy as np
import polars as pl

PAIR_LISTS = ("prefix_ids", "chosen_ids", "rejected_ids")


def random_pairs(
    shapes: list[tuple[int, int, int]], seed: int = 0, vocab_size: int = 1000
) -> pl.DataFrame:
    """Pairs p00, p01, ... of the given (prefix, chosen, rejected) lengths, token ids
    1..vocab_size-1."""
    rng = np.random.default_rng(seed)
    rows = []
    for number, shape in enumerate(shapes):
        token_lists = (rng.integers(1, vocab_size, n).tolist() for n in shape)
        rows.append({"pair_id": f"p{number:02d}", **dict(zip(PAIR_LISTS, token_lists))})
    return pl.DataFrame(
        rows, schema={"pair_id": pl.String, **{name: pl.List(pl.Int64) for name in PAIR_LISTS}}
    )
