"""The quality gate: each rule on hand-made responses, the measures against a plain-Python
reference, per-source thresholds, accounting, and recall / false positives on the sample corpus."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import polars as pl
import pytest

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.silver.normalize import normalize_records
from pipeline_assets.lib.silver.quality import (
    QUANTITIES,
    REJECT_COLUMNS,
    RULES,
    QualityThresholds,
    quality_gate,
    quality_values,
)
from pipeline_assets.sample_data.corpus import write_sample_corpus

DEFAULT = QualityThresholds()
GOOD = (
    "A context manager opens the file on entry and closes it on exit, even when the block "
    "raises an exception, so no handle is left open.\n\n"
    "Use it whenever a resource must be released at a known point."
)
PHRASE = "configure the logging handler before starting worker threads"  # 8 words, 53 word chars
STEPS = "Step one.\nStep two.\nStep three.\nStep four.\nStep five."


def frame_of(*responses: str, sources: list[str] | None = None) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"r{i}" for i in range(len(responses))],
            "source": sources or ["annotate"] * len(responses),
            "prompt": ["How do I do this?"] * len(responses),
            "response": list(responses),
        },
        schema=dict.fromkeys(("record_id", "source", "prompt", "response"), pl.String),
    )


def word_chars(text: str) -> int:
    return sum(len(w) for w in text.split())


# (rule, a response that fails it and no rule before it, the value the gate must measure)
BAD_RESPONSES = [
    ("min_words", "Not sure, sorry.", 3.0),
    ("max_words", " ".join(f"token{i}" for i in range(10_001)), 10_001.0),
    ("min_mean_word_length", "a b c d e f g h i j", 1.0),
    ("max_mean_word_length", " ".join(["QmFzZTY0IGJsb2JzIGFyZSBub3QgYW5zd2Vycy4K"] * 5), 40.0),
    ("max_symbol_word_ratio", "Great answer !!! ### *** $$$ see the docs", 4 / 9),
    ("min_alpha_word_fraction", "Totals are 1234.5 2345.6 3456.7 4567.8 5678.9 6789.0 7.1", 2 / 9),
    (
        "max_duplicate_line_fraction",
        "Subscribe to my channel for more tips\n" * 3 + "It helps a lot with your code.",
        2 / 4,
    ),
    (
        # one repeated line among many distinct ones: few lines repeat, many characters do
        "max_duplicate_line_char_fraction",
        f"{PHRASE}.\n{STEPS}\n{PHRASE}.",
        (len(PHRASE) + 1) / (2 * (len(PHRASE) + 1) + len(STEPS.replace("\n", ""))),
    ),
    ("max_top_2gram_char_fraction", "very good very good very good indeed", 3 * 8 / 30),
    (
        # an 8-word phrase said three times: the last two (106 of 178 word characters) repeat
        # earlier 5-grams, while the most repeated 2-gram covers only 3 x 14 characters
        "max_duplicate_5gram_char_fraction",
        f"{PHRASE} first, {PHRASE} second, {PHRASE} third.",
        106 / 178,
    ),
]


def test_every_rule_has_a_bad_response_case_and_a_measured_quantity():
    assert [rule for rule, _, _ in BAD_RESPONSES] == list(RULES)
    assert quality_values(frame_of(GOOD)).columns == frame_of(GOOD).columns + list(QUANTITIES)


@pytest.mark.parametrize("rule, response, expected", BAD_RESPONSES, ids=RULES)
def test_each_rule_rejects_its_bad_response_and_keeps_a_good_one(rule, response, expected):
    kept, rejected, _ = quality_gate(frame_of(GOOD, response))

    assert kept["record_id"].to_list() == ["r0"]
    assert rejected["record_id"].to_list() == ["r1"]
    row = rejected.row(0, named=True)
    threshold = float(getattr(DEFAULT, rule))
    assert row["stage"] == f"quality:{rule}"
    assert row["rule_value"] == pytest.approx(expected)
    assert row["rule_threshold"] == threshold
    comparison = ">=" if rule.startswith("min_") else "<="
    assert json.loads(row["evidence"]) == {
        "rule": rule,
        "value": pytest.approx(expected),
        "threshold": threshold,
        "comparison": comparison,
    }


def test_the_duplicate_5gram_case_stays_under_the_2gram_threshold():
    values = quality_values(frame_of(BAD_RESPONSES[-1][1])).row(0, named=True)
    assert word_chars(BAD_RESPONSES[-1][1]) == 178
    assert values["q_top_2gram_char_fraction"] == pytest.approx(3 * 14 / 178)


# Technical prose with formulas, identifiers, a URL and numbers, like the clean sample corpus.
TECHNICAL = [
    "If ``lo <= x < hi`` the bisection stops when ``hi - lo <= tol * abs(x) + atol``; otherwise "
    "the interval is halved and ``f(lo) * f(mid) < 0`` picks the half that keeps the root.",
    "Pass ``timeout=30.0`` (seconds) to ``urllib.request.urlopen()``; see "
    "https://docs.python.org/3/library/urllib.request.html#urllib.request.urlopen for the "
    "accepted ``context`` arguments and the ``HTTPError`` raised on 4xx and 5xx codes.",
    "The shape is (n, m) or (n, m, 3): for a 640 x 480 RGB image that is 480 x 640 x 3 = 921600 "
    "values, stored as uint8 in [0, 255].",
]
GOPHER_WEB = QualityThresholds(
    min_mean_word_length=3,
    max_mean_word_length=10,
    max_symbol_word_ratio=0.1,
    min_alpha_word_fraction=0.8,
)


def test_technical_prose_with_code_tokens_passes_the_defaults_but_not_web_thresholds():
    kept, _, _ = quality_gate(frame_of(*TECHNICAL))
    assert kept.height == len(TECHNICAL)

    _, rejected, _ = quality_gate(frame_of(*TECHNICAL), default=GOPHER_WEB)
    assert rejected["stage"].to_list() == [
        "quality:max_symbol_word_ratio",  # 8 of 37 words are operators
        "quality:max_mean_word_length",  # 10.2: dotted names and a URL
        "quality:min_alpha_word_fraction",  # 0.69: numbers and shapes
    ]


def test_first_failing_rule_in_rules_order_wins():
    # All three fail min_alpha_word_fraction, and an earlier rule too: "!!! ### $$$" also fails
    # min_words and the symbol ratio, the number dump the symbol ratio (its "--" words), and the
    # digits the mean word length.
    _, rejected, _ = quality_gate(
        frame_of("!!! ### $$$", "12345 -- 67890 -- 13579 -- 24680 -- 11223 --", "1 2 3 4 5 6 7 8 9")
    )
    assert rejected["stage"].to_list() == [
        "quality:min_words",
        "quality:max_symbol_word_ratio",
        "quality:min_mean_word_length",
    ]
    values = rejected.select(QUANTITIES)
    assert values["q_alpha_word_fraction"].to_list() == [0.0, 0.0, 0.0]  # failed, but later


def test_per_source_override_changes_the_outcome_for_that_source_only():
    terse = "Yes, exactly."
    frame = frame_of(terse, terse, GOOD, GOOD, sources=["chat", "annotate", "chat", "annotate"])
    overrides = {
        "chat": QualityThresholds(min_words=2),
        "annotate": QualityThresholds(max_words=20),
    }

    kept, rejected, _ = quality_gate(frame, thresholds=overrides)

    assert kept["record_id"].to_list() == ["r0", "r2"]
    assert rejected["record_id"].to_list() == ["r1", "r3"]
    assert rejected["stage"].to_list() == ["quality:min_words", "quality:max_words"]
    assert rejected["rule_threshold"].to_list() == [5.0, 20.0]  # annotate keeps min_words=5
    _, by_default, _ = quality_gate(frame)
    assert by_default["record_id"].to_list() == ["r0", "r1"]


def test_sources_missing_from_the_overrides_use_the_default():
    frame = frame_of("Yes, exactly.", "Yes, exactly.", sources=["chat", "logs"])
    kept, rejected, _ = quality_gate(
        frame,
        thresholds={"chat": QualityThresholds(min_words=1)},
        default=QualityThresholds(min_words=3),
    )
    assert kept["source"].to_list() == ["chat"]
    assert rejected["rule_threshold"].to_list() == [3.0]


def test_outputs_keep_input_order_and_carry_their_values():
    responses = [GOOD, "ok", GOOD.upper(), "idk", GOOD.replace("file", "socket"), "no idea"]
    frame = frame_of(*responses)

    kept, rejected, details = quality_gate(frame)

    assert kept["record_id"].to_list() == ["r0", "r2", "r4"]
    assert rejected["record_id"].to_list() == ["r1", "r3", "r5"]
    assert kept.columns == frame.columns + list(QUANTITIES)
    assert rejected.columns == frame.columns + list(QUANTITIES) + list(REJECT_COLUMNS)
    assert all(kept[q].dtype == pl.Float64 for q in QUANTITIES)
    measured = quality_values(frame)
    assert kept.equals(measured.filter(pl.col("record_id").is_in(["r0", "r2", "r4"])))
    assert kept.row(0, named=True)["q_words"] == 38.0
    assert rejected["rule_value"].to_list() == [1.0, 1.0, 2.0]
    assert details == {
        "rejected_by_rule": {rule: 3 if rule == "min_words" else 0 for rule in RULES},
    }


def test_rejected_by_rule_adds_up_and_matches_the_stages():
    responses = [GOOD, *(response for _, response, _ in BAD_RESPONSES)] * 3
    kept, rejected, details = quality_gate(frame_of(*responses))

    assert (kept.height, rejected.height) == (3, 30)
    assert details["rejected_by_rule"] == {rule: 3 for rule in RULES}
    stages = Counter(rejected["stage"])
    assert {f"quality:{rule}": n for rule, n in details["rejected_by_rule"].items()} == stages


def test_empty_frame_gives_empty_outputs_with_the_right_schema():
    frame = frame_of()
    kept, rejected, details = quality_gate(frame)

    assert kept.height == rejected.height == 0
    assert kept.schema == pl.Schema({**frame.schema, **{q: pl.Float64 for q in QUANTITIES}})
    assert rejected.schema == pl.Schema(
        {
            **kept.schema,
            "stage": pl.String,
            "rule_value": pl.Float64,
            "rule_threshold": pl.Float64,
            "evidence": pl.String,
        }
    )
    assert details == {"rejected_by_rule": dict.fromkeys(RULES, 0)}


def test_the_gate_is_deterministic():
    frame = frame_of(*(response for _, response, _ in BAD_RESPONSES), GOOD)
    first, second = quality_gate(frame), quality_gate(frame)
    assert first[0].equals(second[0]) and first[1].equals(second[1]) and first[2] == second[2]


# --- The measures against a plain-Python reference ----------------------------------------------


def reference_values(text: str) -> dict[str, float]:
    """Each measure, the slow obvious way, as documented in lib/silver/quality.py."""
    words = text.split()
    chars = sum(map(len, words))
    lines = [line for line in text.split("\n") if line]
    seen_lines: set[str] = set()
    repeated_lines = []
    for line in lines:
        if line in seen_lines:
            repeated_lines.append(line)
        seen_lines.add(line)
    bigrams = Counter(zip(words, words[1:], strict=False))
    top_bigram = max((n * (len(a) + len(b)) for (a, b), n in bigrams.items() if n > 1), default=0)
    covered = [False] * len(words)
    seen_5grams: set[tuple[str, ...]] = set()
    for i in range(len(words) - 4):
        gram = tuple(words[i : i + 5])
        if gram in seen_5grams:
            covered[i : i + 5] = [True] * 5
        seen_5grams.add(gram)

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    def share_of_words(pattern: str, matching: bool = True) -> float:
        return ratio(sum(bool(re.search(pattern, w)) == matching for w in words), len(words))

    return {
        "q_words": float(len(words)),
        "q_mean_word_length": ratio(chars, len(words)),
        "q_symbol_word_ratio": share_of_words(r"[^\W_]", matching=False),  # no letter or digit
        "q_alpha_word_fraction": share_of_words(r"[^\W\d_]"),  # a letter
        "q_duplicate_line_fraction": ratio(len(repeated_lines), len(lines)),
        "q_duplicate_line_char_fraction": ratio(
            sum(map(len, repeated_lines)), sum(map(len, lines))
        ),
        "q_top_2gram_char_fraction": min(1.0, ratio(top_bigram, chars)),
        "q_duplicate_5gram_char_fraction": ratio(
            sum(len(w) for w, c in zip(words, covered, strict=True) if c), chars
        ),
    }


def random_response(rng: random.Random) -> str:
    """Normalized text from a small vocabulary, so that words, n-grams and lines repeat."""
    vocabulary = ["the", "cat", "sat", "on", "a", "mat", "--", "42", "x1", "==", "(see", "docs)."]
    words = vocabulary[: rng.randint(3, len(vocabulary))]
    lines = [
        " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        for _ in range(rng.randint(0, 6))
    ]
    text = "\n".join(line if rng.random() < 0.8 else "" for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def test_measures_match_the_plain_python_reference():
    rng = random.Random(7)
    # Neighbouring responses that would form repeated n-grams across their boundary must not.
    responses = [random_response(rng) for _ in range(400)] + ["a b c d", "e a b c d e", "", "x"]
    measured = quality_values(frame_of(*responses)).select(QUANTITIES).to_dicts()
    for response, values in zip(responses, measured, strict=True):
        expected = reference_values(response)
        assert values == {q: pytest.approx(expected[q]) for q in QUANTITIES}, response


# --- The sample corpus --------------------------------------------------------------------------

SAMPLE_RECORDS = 6000  # recall and false-positive rates match those at 20,000 records


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[pl.DataFrame, dict]:
    """The sample corpus's records as silver sees them (landing contract passed, normalized)."""
    out = tmp_path_factory.mktemp("landing")
    manifest = write_sample_corpus(out, records=SAMPLE_RECORDS)
    frames = [
        read_landing_file(entry["path"], (out / entry["path"]).read_bytes()).records.with_columns(
            source=pl.lit(entry["source"])
        )
        for entry in manifest["files"]
    ]
    frame, _, _ = normalize_records(pl.concat(frames).with_columns(record_id=pl.col("id")))
    return frame, manifest


def test_sample_corpus_low_quality_is_rejected_and_clean_records_are_kept(sample):
    frame, manifest = sample
    kept, rejected, _ = quality_gate(frame)

    rejected_ids = set(rejected["record_id"])
    low_quality = manifest["injected"]["low_quality"]
    kinds = ("too_short", "symbol_spam", "repeated_lines", "non_alpha")
    assert {entry["kind"] for entry in low_quality} == set(kinds)
    for kind in kinds:
        ids = [entry["id"] for entry in low_quality if entry["kind"] == kind]
        caught = sum(record_id in rejected_ids for record_id in ids)
        assert caught >= 0.95 * len(ids), f"{kind}: {caught} of {len(ids)} rejected"
    clean = set(manifest["clean_ids"])
    assert len(clean) > 5000
    assert len(clean & rejected_ids) <= 0.01 * len(clean)
    assert frame.height == kept.height + rejected.height
