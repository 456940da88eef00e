"""Successive halving: many configurations trained briefly, the best third trained longer, and so
on.

Pure bookkeeping (which configurations, how many steps at each rung, who survives); the training
asset runs the trials. A trial continues from its own checkpoint at the next rung, and every trial
shares the longest learning-rate schedule, so reaching a rung late costs no more than reaching it
directly.
"""

from __future__ import annotations

import itertools
import math
import random


def grid(space: dict[str, list]) -> list[dict]:
    """Every combination of the values, in a stable order."""
    names = sorted(space)
    return [
        dict(zip(names, values, strict=True))
        for values in itertools.product(*(space[n] for n in names))
    ]


def sample_configurations(space: dict[str, list], n: int, seed: int) -> list[dict]:
    """``n`` distinct combinations chosen with ``seed`` (all of them when the grid is smaller)."""
    combinations = grid(space)
    if n >= len(combinations):
        return combinations
    return random.Random(seed).sample(combinations, n)


def rung_steps(min_steps: int, max_steps: int, eta: int) -> list[int]:
    """Budgets min, min*eta, ... up to max (the last rung is always max)."""
    if min_steps < 1 or max_steps < min_steps or eta < 2:
        raise ValueError("need 1 <= min_steps <= max_steps and eta >= 2")
    rungs = [min_steps]
    while rungs[-1] * eta < max_steps:
        rungs.append(rungs[-1] * eta)
    if rungs[-1] != max_steps:
        rungs.append(max_steps)
    return rungs


def survivors(losses: dict[int, float], eta: int) -> list[int]:
    """The best ceil(n / eta) trials by loss (ties broken by trial number); a failed trial (NaN)
    never survives."""
    finite = {trial: loss for trial, loss in losses.items() if math.isfinite(loss)}
    keep = max(1, math.ceil(len(losses) / eta))
    return sorted(sorted(finite, key=lambda trial: (finite[trial], trial))[:keep])


def full_grid_steps(n_trials: int, max_steps: int) -> int:
    return n_trials * max_steps
