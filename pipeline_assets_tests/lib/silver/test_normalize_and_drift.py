from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline_assets.lib.drift import psi_categorical, psi_numeric, psi_numeric_counts
from pipeline_assets.lib.silver.normalize import NormalizeConfig, normalize_records


def _frame(prompt: str) -> pl.DataFrame:
    return pl.DataFrame(
        {"prompt": [prompt], "response": ["same"], "system": [None]},
        schema_overrides={"system": pl.String},
    )


def test_normalize_nfc_controls_and_whitespace():
    frame = _frame("Cafe\u0301\x00 \t tab\r\nline  \n\n\n\nlast ")
    normalized, removed, changed = normalize_records(frame)
    assert normalized["prompt"][0] == "Caf\u00e9 tab\nline\n\nlast" and removed is None
    assert changed == {"prompt_changed": 1, "response_changed": 0, "system_changed": 0}


def test_normalize_steps_can_be_switched_off():
    frame = _frame("e\u0301\x07  x")
    untouched, _, _ = normalize_records(
        frame, NormalizeConfig(unicode_form=None, strip_control=False, collapse_whitespace=False)
    )
    assert untouched["prompt"][0] == "e\u0301\x07  x"
    nfkc, _, _ = normalize_records(_frame("\ufb01"), NormalizeConfig(unicode_form="NFKC"))
    assert nfkc["prompt"][0] == "fi"


def test_psi_is_near_zero_for_the_same_distribution_and_large_for_a_shift():
    rng = np.random.default_rng(0)
    reference = rng.normal(100, 20, 5000)
    assert psi_numeric(reference, rng.normal(100, 20, 5000)) < 0.02
    assert 0.1 < psi_numeric(reference, rng.normal(108, 20, 5000)) < 0.25  # PSI ~ (shift / sigma)^2
    assert psi_numeric(reference, rng.normal(160, 20, 5000)) > 0.25
    assert psi_numeric(reference, []) == 0.0


def test_categorical_psi_counts_a_new_category():
    reference = ["a"] * 50 + ["b"] * 50
    assert psi_categorical(reference, ["b"] * 50 + ["a"] * 50) == 0.0
    assert psi_categorical(reference, ["a"] * 40 + ["b"] * 40 + ["c"] * 20) > 0.25


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_psi_from_bincounts_equals_psi_of_the_samples(seed):
    rng = np.random.default_rng(seed)
    reference = rng.integers(1, 512, 3000)
    current = np.concatenate([rng.integers(1, 512, 1000), rng.integers(400, 512, 500 * seed + 1)])
    counts = [np.bincount(sample, minlength=513) for sample in (reference, current)]
    assert psi_numeric_counts(*counts) == pytest.approx(psi_numeric(reference, current), rel=1e-12)
    assert psi_numeric_counts(counts[0], counts[0]) == 0.0
    assert psi_numeric_counts(np.zeros(513), counts[1]) == 0.0
