"""Successive halving's bookkeeping: budgets, survivors, sampling."""

from __future__ import annotations

import math

import pytest

from pipeline_assets.lib.training.search import grid, rung_steps, sample_configurations, survivors


def test_rungs_grow_by_eta_and_end_at_the_maximum():
    assert rung_steps(10, 90, 3) == [10, 30, 90]
    assert rung_steps(10, 100, 3) == [10, 30, 90, 100]
    assert rung_steps(5, 5, 2) == [5]
    with pytest.raises(ValueError):
        rung_steps(10, 5, 3)


def test_survivors_are_the_best_third_and_failures_never_survive():
    losses = {0: 2.0, 1: 1.5, 2: math.nan, 3: 1.7, 4: 3.0, 5: 1.6}
    assert survivors(losses, eta=3) == [1, 5]
    assert survivors({0: math.nan, 1: 2.0}, eta=3) == [1]


def test_sampling_is_seeded_distinct_and_takes_the_whole_grid_when_small():
    space = {"lr": [1e-3, 3e-3, 1e-2], "width": [64, 128]}
    assert len(grid(space)) == 6
    picked = sample_configurations(space, 4, seed=1)
    assert (
        picked == sample_configurations(space, 4, seed=1)
        and len({tuple(p.items()) for p in picked}) == 4
    )
    assert picked != sample_configurations(space, 4, seed=2)
    assert sample_configurations(space, 10, seed=1) == grid(space)
