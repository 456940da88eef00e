"""Timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(work: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs: the least disturbed by whatever else the machine does."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)
