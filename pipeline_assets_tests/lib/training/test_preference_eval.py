"""Implicit reward margins, preference accuracy and per-source slices, on numbers
checked by hand."""

import polars as pl
import pytest

from pipeline_assets.lib.training.preference_eval import (
    pair_margins,
    preference_slices,
    within_tolerance,
)


def _rows() -> pl.DataFrame:
    # Row 1 packs pairs a and b (documents: a chosen, a rejected, b chosen, b rejected);
    # row 2 packs c.
    return pl.DataFrame(
        {
            "pair_ids": [["a", "b"], ["c"]],
            "policy_logps": [[-10.0, -14.0, -8.0, -6.0], [-5.0, -5.0]],
            "reference_logps": [[-11.0, -12.0, -9.0, -9.0], [-6.0, -4.0]],
        }
    )


def test_margins_are_beta_times_the_policy_gain_on_chosen_minus_the_gain_on_rejected():
    margins = pair_margins(_rows(), beta=0.5)
    # a: 0.5 * ((-10 + 11) - (-14 + 12)) = 0.5 * (1 + 2) = 1.5
    # b: 0.5 * ((-8 + 9) - (-6 + 9)) = 0.5 * (1 - 3) = -1.0
    # c: 0.5 * ((-5 + 6) - (-5 + 4)) = 0.5 * (1 + 1) = 1.0
    assert margins["pair_id"].to_list() == ["a", "b", "c"]
    assert margins["margin"].to_list() == pytest.approx([1.5, -1.0, 1.0])
    assert margins["chosen_reward"].to_list() == pytest.approx([0.5, 0.5, 0.5])
    assert margins["rejected_reward"].to_list() == pytest.approx([-1.0, 1.5, -0.5])


def test_accuracy_and_mean_margin_overall_and_per_source():
    margins = pl.DataFrame({"pair_id": ["a", "b", "c", "d"], "margin": [1.5, -1.0, 1.0, 0.0]})
    sources = pl.DataFrame(
        {"pair_id": ["a", "b", "c", "d", "unused"], "source": ["x", "x", "y", "y", "z"]}
    )
    slices = {
        row["slice"]: row for row in preference_slices(margins, sources).iter_rows(named=True)
    }
    assert list(slices) == ["overall", "source:x", "source:y"]
    assert slices["overall"]["pairs"] == 4
    assert slices["overall"]["preference_accuracy"] == pytest.approx(0.5), (
        "a tie (d) is not a preference"
    )
    assert slices["overall"]["mean_margin"] == pytest.approx(1.5 / 4)
    assert (slices["source:x"]["pairs"], slices["source:x"]["preference_accuracy"]) == (
        2,
        pytest.approx(0.5),
    )
    assert slices["source:x"]["mean_margin"] == pytest.approx(0.25)
    assert (slices["source:y"]["preference_accuracy"], slices["source:y"]["mean_margin"]) == (
        pytest.approx(0.5),
        0.5,
    )


def test_a_pair_without_a_source_and_a_row_without_two_documents_a_pair_are_refused():
    with pytest.raises(ValueError, match="1 pair\\(s\\) have no source, e.g. b"):
        preference_slices(
            pl.DataFrame({"pair_id": ["a", "b"], "margin": [1.0, 2.0]}),
            pl.DataFrame({"pair_id": ["a"], "source": ["x"]}),
        )
    broken = _rows().with_columns(policy_logps=pl.Series([[-1.0, -2.0, -3.0], [-1.0, -2.0]]))
    with pytest.raises(ValueError, match="2 pair\\(s\\) but 3 policy_logps"):
        pair_margins(broken, beta=0.1)
    with pytest.raises(ValueError, match="beta must be positive"):
        pair_margins(_rows(), beta=0.0)


def test_tolerance_is_relative_to_the_champion_loss():
    assert within_tolerance(2.03, 2.0, 0.02)
    assert not within_tolerance(2.05, 2.0, 0.02)
    assert within_tolerance(1.5, 2.0, 0.0), "better is always within"
