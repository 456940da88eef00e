"""The capped validation sample evaluation scores."""

import numpy as np

from pipeline_assets.lib.training.eval_sample import capped_sample


def test_the_sample_fits_the_cap_is_deterministic_and_spread_over_the_split():
    rng = np.random.default_rng(3)
    index, tokens = np.arange(1000), rng.integers(50, 500, 1000)
    chosen = capped_sample(index, tokens, 20_000)
    assert tokens[chosen].sum() <= 20_000 < tokens[chosen].sum() + tokens.max()
    assert np.array_equal(chosen, capped_sample(index[::-1], tokens[::-1], 20_000)), (
        "the row order does not matter"
    )
    assert np.array_equal(chosen, np.sort(chosen))
    assert chosen.min() < 100 and chosen.max() > 900, (
        "a pseudo-random sample, not the first sequences"
    )


def test_a_larger_cap_keeps_the_smaller_sample_and_a_tiny_cap_still_scores_one():
    index, tokens = np.arange(200), np.full(200, 100)
    assert set(capped_sample(index, tokens, 3_000)) < set(capped_sample(index, tokens, 6_000))
    assert len(capped_sample(index, tokens, 1)) == 1
    assert np.array_equal(capped_sample(index, tokens, 10**9), index)
