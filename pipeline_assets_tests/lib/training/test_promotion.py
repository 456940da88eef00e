"""The promotion gate's rule, on hand-made slice losses."""

from __future__ import annotations

import math

import pytest

from pipeline_assets.lib.training.promotion import (
    PreferenceScore,
    champion_moved,
    preference_gate,
    promotion_gate,
    rollback_target,
)

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
    decision = promotion_gate(
        {**CHAMPION, "overall": 1.995}, CHAMPION, vocab_size=8192, margin=0.005
    )
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


def test_a_fine_tune_that_does_not_beat_its_base_model_is_refused_by_name():
    base = {"overall": 1.50, "source:logs": 1.40}  # a pretrained model: far below ln(vocab)
    kept = promotion_gate(
        {"overall": 1.51, "source:logs": 1.41}, base, vocab_size=None, against="the base model"
    )
    assert not kept.passed and "against the base model's 1.5000" in kept.reason
    assert kept.numbers["judged_against"] == "the base model"
    better = promotion_gate(
        {"overall": 1.40, "source:logs": 1.39}, base, vocab_size=None, against="the base model"
    )
    assert better.passed and "on the base model's" in better.reason


def test_a_first_model_must_beat_the_uniform_baseline():
    assert promotion_gate({"overall": math.log(8192) - 0.01}, None, vocab_size=8192).passed
    refused = promotion_gate({"overall": math.log(8192) + 0.01}, None, vocab_size=8192)
    assert not refused.passed and refused.numbers["uniform_baseline_loss"] == pytest.approx(
        math.log(8192)
    )


def _entry(version: str, previous: str | None, kind: str = "promote") -> dict:
    return {"version": version, "previous": previous, "kind": kind}


def test_numbers_measured_against_the_current_champion_still_judge():
    assert champion_moved(seen="1", current="1", candidate="3") is None
    assert champion_moved(seen=None, current=None, candidate="1") is None
    assert champion_moved(seen="1", current="3", candidate="3") is None, (
        "a candidate already champion (a rerun)"
    )


def test_a_champion_that_moved_since_evaluation_refuses_with_both_versions():
    reason = champion_moved(seen="1", current="2", candidate="3")
    assert (
        reason is not None and "v1" in reason and "v2" in reason and "evaluation/report" in reason
    )
    assert "no champion" in champion_moved(seen=None, current="2", candidate="3")


def test_rollbacks_walk_back_through_the_champion_history():
    promotions = [_entry("1", None), _entry("2", "1"), _entry("3", "2")]
    assert rollback_target(promotions, current="3") == "2"
    once = promotions + [_entry("2", "3", "rollback")]
    assert rollback_target(once, current="2") == "1", (
        "a second rollback goes one further back, never to v3"
    )
    twice = once + [_entry("1", "2", "rollback")]
    assert rollback_target(twice, current="1") is None, "nothing before the first champion"


def test_a_rollback_after_a_hand_promotion_returns_to_the_version_it_replaced():
    history = [_entry("1", None), _entry("2", "1"), _entry("2", "2"), _entry("3", "2", "promote")]
    assert rollback_target(history, current="3") == "2"
    assert rollback_target(history + [_entry("2", "3", "rollback")], current="2") == "1"


def test_an_old_history_without_kinds_reads_its_rollbacks_by_who_made_them():
    history = [
        _entry("1", None),
        _entry("2", "1"),
        _entry("3", "2"),
        {"version": "2", "previous": "3", "by": "pipeline-assets rollback"},
    ]
    assert rollback_target(history, current="2") == "1"


def _scores(**slices: tuple[float, float]) -> dict[str, PreferenceScore]:
    return {
        name.replace("_", ":", 1) if name != "overall" else name: PreferenceScore(*values)
        for name, values in slices.items()
    }


DPO_CHAMPION = _scores(
    overall=(0.80, 1.0), source_annotate=(0.90, 1.2), source_rollouts=(0.70, 0.8)
)
SFT_KEPT = (2.01, 2.00)  # the candidate's sft validation loss against the sft champion's: +0.5%


def test_a_first_dpo_model_must_beat_chance_and_keep_the_sft_loss():
    assert preference_gate(_scores(overall=(0.6, 0.1)), None, sft_losses=SFT_KEPT).passed
    at_chance = preference_gate(_scores(overall=(0.5, 0.1)), None, sft_losses=SFT_KEPT)
    assert not at_chance.passed and "does not beat chance" in at_chance.reason
    forgot = preference_gate(
        _scores(overall=(0.95, 2.0)), None, sft_losses=(2.10, 2.00), slice_tolerance=0.02
    )
    assert not forgot.passed and "beyond the tolerance 2.00%" in forgot.reason
    assert forgot.numbers["sft_relative_change"] == pytest.approx(0.05)
    unknown = preference_gate(_scores(overall=(0.95, 2.0)), None, sft_losses=None)
    assert not unknown.passed and "pipeline-assets promote" in unknown.reason


def test_dpo_from_the_base_model_has_no_sft_loss_to_hold_but_must_beat_chance():
    base = {"sft_losses": None, "sft_champion_behind": False}
    passed = preference_gate(_scores(overall=(0.6, 0.1)), None, **base)
    assert passed.passed and "no sft champion behind it" in passed.reason
    at_chance = preference_gate(_scores(overall=(0.5, 0.1)), None, **base)
    assert not at_chance.passed and "does not beat chance" in at_chance.reason


def test_a_dpo_candidate_promotes_on_accuracy_or_on_margin_at_level_accuracy():
    more_accurate = _scores(
        overall=(0.85, 0.5), source_annotate=(0.90, 0.6), source_rollouts=(0.80, 0.4)
    )
    decision = preference_gate(more_accurate, DPO_CHAMPION, sft_losses=SFT_KEPT)
    assert decision.passed and decision.numbers["accuracy_gain"] == pytest.approx(0.05)
    level_wider = _scores(
        overall=(0.80, 1.5), source_annotate=(0.90, 1.6), source_rollouts=(0.70, 1.4)
    )
    decision = preference_gate(level_wider, DPO_CHAMPION, sft_losses=SFT_KEPT)
    assert decision.passed and decision.numbers["mean_margin_gain"] == pytest.approx(0.5)
    level_narrower = _scores(
        overall=(0.80, 0.9), source_annotate=(0.90, 1.0), source_rollouts=(0.70, 0.8)
    )
    refused = preference_gate(level_narrower, DPO_CHAMPION, sft_losses=SFT_KEPT)
    assert not refused.passed and "neither better" in refused.reason
    less_accurate_wider = _scores(
        overall=(0.75, 3.0), source_annotate=(0.85, 3.0), source_rollouts=(0.65, 3.0)
    )
    assert not preference_gate(less_accurate_wider, DPO_CHAMPION, sft_losses=SFT_KEPT).passed


def test_a_better_dpo_candidate_that_loses_one_source_or_the_sft_loss_is_refused():
    one_source_down = _scores(
        overall=(0.90, 1.2), source_annotate=(1.0, 1.5), source_rollouts=(0.60, 0.7)
    )
    refused = preference_gate(
        one_source_down, DPO_CHAMPION, sft_losses=SFT_KEPT, slice_tolerance=0.05
    )
    assert not refused.passed and "source:rollouts loses 0.100" in refused.reason
    assert refused.numbers["worst_slice"] == "source:rollouts"
    better = _scores(overall=(0.90, 1.2), source_annotate=(0.95, 1.5), source_rollouts=(0.85, 0.9))
    forgot = preference_gate(better, DPO_CHAMPION, sft_losses=(2.05, 2.00), slice_tolerance=0.02)
    assert not forgot.passed and "sft validation loss" in forgot.reason
