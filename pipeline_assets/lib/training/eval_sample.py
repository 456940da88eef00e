"""The validation sequences evaluation scores: a deterministic sample capped in tokens.

Scoring every validation token of a large snapshot costs as much as a slice of training, on every
evaluation and for every model compared. The sample takes sequences in a fixed pseudo-random order
of their ``sequence_index`` (a 64-bit mix, the same on every machine and library version) until
the next one would pass the cap; the candidate and the champion are scored on the same sample.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from pipeline_assets.lib.gold.manifest import Manifest

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def capped_sample(
    sequence_index: np.ndarray, real_tokens: np.ndarray, max_tokens: int
) -> np.ndarray:
    """The chosen ``sequence_index`` values, ascending: as many sequences as fit in ``max_tokens``
    real tokens in the mixed order (always at least one, so a tiny cap still scores something)."""
    order = np.argsort(_splitmix64(np.asarray(sequence_index, dtype=np.int64)), kind="stable")
    within = np.cumsum(np.asarray(real_tokens, dtype=np.int64)[order]) <= max_tokens
    within[:1] = True
    return np.sort(np.asarray(sequence_index)[order[within]])


def capped_validation(
    manifest: Manifest, scan: pl.LazyFrame, max_tokens: int, columns: list[str]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the snapshot's validation rows the capped sample takes, with ``columns`` and their global
    ``sequence_index``; every validation row's batch_id, split, sequence_index and real_tokens).
    Both are empty when the snapshot has no validation row."""
    sizes = manifest.in_order(
        scan.filter(pl.col("split") == "validation").select(
            "batch_id", "split", "sequence_index", "real_tokens"
        )
    ).collect()
    if sizes.is_empty():
        return sizes, sizes
    chosen = capped_sample(
        sizes["sequence_index"].to_numpy(), sizes["real_tokens"].to_numpy(), max_tokens
    )
    return manifest.split("validation").take(scan, chosen, columns), sizes


def _splitmix64(values: np.ndarray) -> np.ndarray:
    mixed = values.astype(np.uint64) + _MIX[0]
    mixed = (mixed ^ (mixed >> np.uint64(30))) * _MIX[1]
    mixed = (mixed ^ (mixed >> np.uint64(27))) * _MIX[2]
    return mixed ^ (mixed >> np.uint64(31))
