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


def best_of_alternating(
    work: Callable[[], object], baseline: Callable[[], object], repeats: int = 3
) -> tuple[float, float]:
    """The fastest of ``repeats`` runs of each, taken in turns: a machine whose speed drifts
    slows both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for side, run in zip(times, (work, baseline), strict=True):
            start = time.perf_counter()
            run()
            side.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])
