"""The rule verifiers: right and wrong answers for each, the errors a bad verifier string raises,
and the ground-truth self-check the prompt bank blocks on."""

from __future__ import annotations

import pytest

from pipeline_assets.lib.rl.verifiers import (
    Verdict,
    check_verifier,
    ground_truth_passes,
    known_verifiers,
    verify,
)


def reward(verifier: str, ground_truth: str, completion: str) -> float:
    return verify(verifier, ground_truth, completion).reward


@pytest.mark.parametrize("completion", ["dcba", "  dcba\n", "\tdcba "])
def test_exact_match_ignores_whitespace_around_the_completion(completion):
    assert verify("exact_match", "dcba", completion) == Verdict(1.0, "expected 'dcba', got 'dcba'")


@pytest.mark.parametrize("completion", ["dcb", "dcbaa", "DCBA", "d c b a", "dcba.", ""])
def test_exact_match_refuses_anything_else(completion):
    assert reward("exact_match", "dcba", completion) == 0.0
    assert verify("exact_match", "1 2 3", "1 2 4").detail == "expected '1 2 3', got '1 2 4'"


@pytest.mark.parametrize(
    "completion", ["19", " 19 ", "019", "+19", "the answer is 19.", "19 and then 20", "19abc"]
)
def test_int_equal_takes_the_first_integer(completion):
    assert reward("int_equal", "19", completion) == 1.0


@pytest.mark.parametrize(
    ("completion", "detail"),
    [
        ("41", "expected 42, got 41"),
        ("-42", "expected 42, got -42"),
        ("7 + 35 = 42", "expected 42, got 7"),
        ("4.2", "expected 42, got 4"),
        ("no idea", "no integer in the completion"),
        ("", "no integer in the completion"),
        (
            "- 42",
            "expected 42, got 42",
        ),  # a sign apart from the digits is not the integer's: this one is right
    ],
)
def test_int_equal_verdicts(completion, detail):
    verdict = verify("int_equal", "42", completion)
    assert verdict.detail == detail
    assert verdict.reward == (1.0 if detail == "expected 42, got 42" else 0.0)


def test_int_equal_reads_signs_and_leading_zeros_as_numbers():
    assert reward("int_equal", "-5", "x = -5") == 1.0
    assert reward("int_equal", "-5", "5") == 0.0
    assert reward("int_equal", "0", "-0") == 1.0
    assert reward("int_equal", " +7 ", "007") == 1.0, "the ground truth is read as int() would"


def test_int_equal_survives_a_completion_of_thousands_of_digits():
    assert verify("int_equal", "1" * 5000, "1" * 5000).reward == 1.0
    assert verify("int_equal", "19", "9" * 5000).detail.startswith("expected 19, got 999")


def test_int_equal_with_a_ground_truth_that_is_no_integer_rewards_nothing():
    assert verify("int_equal", "nineteen", "19") == Verdict(
        0.0, "ground truth 'nineteen' is not an integer"
    )


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("yes", 1.0),
        (" Yes\n", 1.0),
        ("yes!", 0.0),
        ("oh yes", 0.0),
        ("yesno", 0.0),
        ("", 0.0),
    ],
)
def test_regex_must_match_the_whole_stripped_completion(completion, expected):
    assert reward("regex:[Yy]es", "yes", completion) == expected


def test_regex_anchors_hold_even_for_a_pattern_that_could_match_a_prefix():
    assert reward("regex:a|ab", "", "ab") == 1.0, (
        "fullmatch tries every alternative against the whole text"
    )
    assert reward("regex:[0-9]+", "", "12 34") == 0.0
    assert verify("regex:[0-9]+", "", "12x").detail == "'12x' does not match /[0-9]+/"


def test_regex_ignores_the_ground_truth_when_scoring():
    assert reward("regex:[0-9]+", "anything", "123") == 1.0


def test_the_pattern_is_everything_after_the_first_colon():
    assert reward("regex:a:b", "a:b", "a:b") == 1.0
    assert reward("regex:(?i)abc", "", "ABC") == 1.0


def test_an_unknown_verifier_is_named_with_the_known_ones():
    for bad in ("exactmatch", "regex", "exact_match:x", "", "EXACT_MATCH"):
        with pytest.raises(ValueError, match="unknown verifier") as raised:
            check_verifier(bad)
        assert repr(bad) in str(raised.value)
        assert "exact_match, int_equal, regex:<pattern>" in str(raised.value)
    with pytest.raises(ValueError, match="unknown verifier 'sympy_equal'"):
        verify("sympy_equal", "1", "1")


def test_a_bad_or_empty_regex_is_refused_naming_the_pattern():
    with pytest.raises(ValueError, match=r"'regex:\(ab' has a bad pattern"):
        check_verifier("regex:(ab")
    with pytest.raises(ValueError, match="empty pattern"):
        check_verifier("regex:")
    with pytest.raises(ValueError, match="bad pattern"):
        verify("regex:[", "", "x")


def test_every_known_verifier_checks():
    assert known_verifiers() == ("exact_match", "int_equal", "regex:<pattern>")
    for verifier in ("exact_match", "int_equal", "regex:[a-z]+"):
        check_verifier(verifier)


def test_a_ground_truth_passes_its_own_verifier_only_when_it_can_be_rewarded():
    assert ground_truth_passes("exact_match", "dcba")
    assert not ground_truth_passes("exact_match", " dcba"), (
        "a completion is stripped, so this could never match"
    )
    assert ground_truth_passes("int_equal", "-19")
    assert not ground_truth_passes("int_equal", "nineteen")
    assert ground_truth_passes("regex:[0-9]+", "123")
    assert not ground_truth_passes("regex:[0-9]+", "12a")
    with pytest.raises(ValueError, match="unknown verifier"):
        ground_truth_passes("nope", "1")


def test_a_verdict_is_frozen():
    with pytest.raises(AttributeError):
        verify("exact_match", "a", "a").reward = 0.0
