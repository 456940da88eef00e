"""How this batch compares with earlier ones: population stability index (PSI), trailing medians.

PSI = sum over bins of (current% - reference%) * ln(current% / reference%). Common reading:
below 0.1 stable, 0.1-0.25 a shift worth a look, above 0.25 a real change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

_EPSILON = 1e-4  # stands in for an empty bin, so the logarithm stays finite


def psi_numeric(reference: Sequence[float], current: Sequence[float], bins: int = 10) -> float:
    """PSI over the reference's quantile bins (ties merged), open-ended at both ends."""
    reference, current = np.asarray(reference, dtype=float), np.asarray(current, dtype=float)
    if not len(reference) or not len(current):
        return 0.0
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1))[1:-1])
    expected = np.bincount(
        np.searchsorted(edges, reference, side="right"), minlength=len(edges) + 1
    )
    actual = np.bincount(np.searchsorted(edges, current, side="right"), minlength=len(edges) + 1)
    return _psi(expected / len(reference), actual / len(current))


def psi_numeric_counts(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """``psi_numeric`` of two samples of small non-negative integers given as their bincounts (count
    of value v at index v): the same edges and the same result, in memory bounded by the largest
    value, not by the samples (a snapshot's document lengths, summed over its shards)."""
    reference, current = np.asarray(reference, dtype=np.int64), np.asarray(current, dtype=np.int64)
    n_reference, n_current = int(reference.sum()), int(current.sum())
    if not n_reference or not n_current:
        return 0.0
    cumulative = np.cumsum(reference)
    positions = np.linspace(0, 1, bins + 1)[1:-1] * (
        n_reference - 1
    )  # np.quantile's linear interpolation

    def sorted_value(i: np.ndarray) -> np.ndarray:  # the i-th smallest reference value
        return np.searchsorted(cumulative, i, side="right").astype(float)

    low, high = sorted_value(np.floor(positions)), sorted_value(np.ceil(positions))
    edges = np.unique(low + (positions - np.floor(positions)) * (high - low))

    def shares(counts: np.ndarray, total: int) -> np.ndarray:
        which = np.searchsorted(edges, np.arange(counts.size), side="right")
        return np.bincount(which, weights=counts, minlength=len(edges) + 1) / total

    return _psi(shares(reference, n_reference), shares(current, n_current))


def psi_categorical(reference: Sequence[str], current: Sequence[str]) -> float:
    """PSI over the categories seen in either sample (a new category counts fully)."""
    categories = sorted(set(reference) | set(current))
    if not categories or not len(reference) or not len(current):
        return 0.0
    position = {c: i for i, c in enumerate(categories)}
    expected = np.bincount([position[c] for c in reference], minlength=len(categories)) / len(
        reference
    )
    actual = np.bincount([position[c] for c in current], minlength=len(categories)) / len(current)
    return _psi(expected, actual)


def _psi(expected: np.ndarray, actual: np.ndarray) -> float:
    expected, actual = np.clip(expected, _EPSILON, None), np.clip(actual, _EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def against_trailing_median(
    history: pl.DataFrame, batch_id: str, value: str, trailing: int
) -> pl.DataFrame:
    """Per source: this batch's ``value`` beside the median of the ``trailing`` batches before it.

    Batch keys sort by arrival, so "before" is a string comparison. ``deviation`` is relative
    (0.25 = 25% above the median); null where a source has no history yet.
    """
    current = history.filter(pl.col("batch_id") == batch_id).select(
        "source", pl.col(value).alias("current")
    )
    baseline = (
        history.filter(pl.col("batch_id") < batch_id)
        .sort("batch_id")
        .group_by("source")
        .agg(
            baseline=pl.col(value).tail(trailing).median(),
            baseline_batches=pl.col(value).tail(trailing).len(),
        )
    )
    return (
        current.join(baseline, on="source", how="left")
        .with_columns(deviation=(pl.col("current") - pl.col("baseline")) / pl.col("baseline"))
        .sort("source")
    )
