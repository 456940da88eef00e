"""Population stability index (PSI) between a reference sample and a current one.

PSI = sum over bins of (current% - reference%) * ln(current% / reference%). Common reading:
below 0.1 stable, 0.1-0.25 a shift worth a look, above 0.25 a real change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_EPSILON = 1e-4  # stands in for an empty bin, so the logarithm stays finite


def psi_numeric(reference: Sequence[float], current: Sequence[float], bins: int = 10) -> float:
    """PSI over the reference's quantile bins (ties merged), open-ended at both ends."""
    reference, current = np.asarray(reference, dtype=float), np.asarray(current, dtype=float)
    if not len(reference) or not len(current):
        return 0.0
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1))[1:-1])
    expected = np.bincount(np.searchsorted(edges, reference, side="right"), minlength=len(edges) + 1)
    actual = np.bincount(np.searchsorted(edges, current, side="right"), minlength=len(edges) + 1)
    return _psi(expected / len(reference), actual / len(current))


def psi_categorical(reference: Sequence[str], current: Sequence[str]) -> float:
    """PSI over the categories seen in either sample (a new category counts fully)."""
    categories = sorted(set(reference) | set(current))
    if not categories or not len(reference) or not len(current):
        return 0.0
    position = {c: i for i, c in enumerate(categories)}
    expected = np.bincount([position[c] for c in reference], minlength=len(categories)) / len(reference)
    actual = np.bincount([position[c] for c in current], minlength=len(categories)) / len(current)
    return _psi(expected, actual)


def _psi(expected: np.ndarray, actual: np.ndarray) -> float:
    expected, actual = np.clip(expected, _EPSILON, None), np.clip(actual, _EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))
