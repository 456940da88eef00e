"""The promotion gate's rule, on hand-made slice losses."""

from __future__ import annotations

import math

import pytest

from pipeline_assets.lib.promotion import promotion_gate

CHAMPION = {"overall": 2.00, "source:annotate": 2.10, "source:logs": 1.90, "eval:trivia": 3.00}


def test_a_better_model_that_hurts_no_slice_is_promoted():
    candidate = {"overall": 1.95, "source:annotate": 2.05, "source:logs": 1.89, "eval:trivia": 2.99}
    decision = promotion_gate(candidate, CHAMPION, vocab_size=8192)
    assert decision.passed
    assert decision.numbers["relative_improvement"] == pytest.approx(0.025)
    assert decision.numbers["worst_slice"] == "eval:trivia"


def test_a_worse_model_is_refused():
    decision = promotion_gate({**CHAMPION, "overall": 2.02}, CHAMPION, vocab_size=8192)
    assert not decision.passed and "below the required 0.50%" in decision.reason


def test_an_improvement_below_the_margin_is_refused():
    decision = promotion_gate({**CHAMPION, "overall": 1.995}, CHAMPION, vocab_size=8192, margin=0.005)
    assert not decision.passed  # 0.25% better, 0.5% required


def test_a_better_model_that_regresses_one_slice_beyond_the_tolerance_is_refused():
    candidate = {"overall": 1.90, "source:annotate": 2.00, "source:logs": 1.96, "eval:trivia": 2.90}
    decision = promotion_gate(candidate, CHAMPION, vocab_size=8192, slice_tolerance=0.02)
    assert not decision.passed
    assert decision.numbers["worst_slice"] == "source:logs"
    assert decision.numbers["worst_slice_regression"] == pytest.approx(0.06 / 1.90)
    assert "source:logs" in decision.reason


def test_a_slice_regression_within_the_tolerance_is_allowed():
    candidate = {"overall": 1.90, "source:annotate": 2.00, "source:logs": 1.92, "eval:trivia": 2.90}
    assert promotion_gate(candidate, CHAMPION, vocab_size=8192, slice_tolerance=0.02).passed


def test_a_first_model_must_beat_the_uniform_baseline():
    assert promotion_gate({"overall": math.log(8192) - 0.01}, None, vocab_size=8192).passed
    refused = promotion_gate({"overall": math.log(8192) + 0.01}, None, vocab_size=8192)
    assert not refused.passed and refused.numbers["uniform_baseline_loss"] == pytest.approx(math.log(8192))
