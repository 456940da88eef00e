"""Heuristic quality gate for silver: Gopher- and FineWeb-style rules applied to the response.

Each rule compares one measured quantity of the response text (a ``q_<quantity>`` column) with a
threshold. A record is kept when it passes every rule; otherwise it is rejected with the first
failing rule (in ``RULES`` order), the measured value, the threshold and a JSON evidence string.
Thresholds can differ per source.

Only the response is judged: it is what the model learns to produce. The prompt is not used:
prompts are short questions by nature, so the word-count and repetition rules would misfire on
them, and a bad prompt with a good answer is still a useful example.

Input text is expected to be normalized (``lib/silver/normalize.py``): no whitespace but single
spaces and newlines. A "word" is a run of non-whitespace characters (punctuation and code included),
a "line" a non-empty text between newlines.

Everything is vectorized: one flat table holds every word of the frame (or every line), and
n-grams are 64-bit keys built from the hashes of neighbouring words, compared within their
response only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

import polars as pl

from pipeline_assets.lib.formats import SFT


@dataclass(frozen=True)
class QualityThresholds:
    """One threshold per rule; a ``min_*`` rule passes at ``value >= threshold``, a ``max_*`` rule
    at ``value <= threshold``."""

    # "ok", "idk", "see docs": a reply of a few words teaches nothing; a short real answer
    # ("Use os.replace, it is atomic.") has five or more. A source of terse answers overrides it.
    min_words: float = 5
    # Far beyond any response that fits a training sequence: catches runaway generations.
    max_words: float = 10_000
    # Gopher keeps 3..10 on web text. Math notation ("D x H x W") brings clean docstrings down
    # to 3.1, and identifiers and URLs (``os.path.join()``) up to 15; beyond that the text is a
    # blob (base64, hex, minified code), below it letter spam.
    min_mean_word_length: float = 2.5
    max_mean_word_length: float = 15
    # Words with no letter or digit ("####", "$$$", "=>"). Formulas in clean docstrings
    # (``x3 - x1 <= abs(x2)``) reach 0.21, so Gopher's 0.1 (for "#" and "..." alone) would cut
    # them; spam sits at 0.5 and above.
    max_symbol_word_ratio: float = 0.3
    # Gopher asks 80% of words to hold a letter; numbers and vectors ("[3, 1, 1]") take clean
    # docstrings down to 0.71, while number and symbol dumps have next to none.
    min_alpha_word_fraction: float = 0.6
    # Gopher's values: 30% of lines, 20% of line characters repeating an earlier line.
    max_duplicate_line_fraction: float = 0.3
    max_duplicate_line_char_fraction: float = 0.2
    # Gopher uses 0.20 and 0.15 on documents of hundreds to thousands of words. A response of
    # ~60 words crosses those with a single repeated phrase, and templated parameter lists
    # ("x0 : float or None The locked value for x0") repeat a lot more; degenerate loops of a
    # generator repeat most of their text (0.9 in the sample corpus).
    max_top_2gram_char_fraction: float = 0.3
    max_duplicate_5gram_char_fraction: float = 0.3


class _Rule(NamedTuple):
    name: str  # also the QualityThresholds field that holds its threshold
    quantity: str  # the q_* column it judges
    comparison: str  # what a passing value satisfies: ">=" or "<="


_RULE_SPECS = (
    _Rule("min_words", "q_words", ">="),
    _Rule("max_words", "q_words", "<="),
    _Rule("min_mean_word_length", "q_mean_word_length", ">="),
    _Rule("max_mean_word_length", "q_mean_word_length", "<="),
    _Rule("max_symbol_word_ratio", "q_symbol_word_ratio", "<="),
    _Rule("min_alpha_word_fraction", "q_alpha_word_fraction", ">="),
    _Rule("max_duplicate_line_fraction", "q_duplicate_line_fraction", "<="),
    _Rule("max_duplicate_line_char_fraction", "q_duplicate_line_char_fraction", "<="),
    _Rule("max_top_2gram_char_fraction", "q_top_2gram_char_fraction", "<="),
    _Rule("max_duplicate_5gram_char_fraction", "q_duplicate_5gram_char_fraction", "<="),
)
RULES: tuple[str, ...] = tuple(rule.name for rule in _RULE_SPECS)
QUANTITIES: tuple[str, ...] = tuple(dict.fromkeys(rule.quantity for rule in _RULE_SPECS))
REJECT_COLUMNS = ("stage", "rule_value", "rule_threshold", "evidence")
REJECT_REASON = "quality"  # a rejected row's stage: "quality:<its first failing rule>"
STAGE_PREFIX = f"{REJECT_REASON}:"

assert set(RULES) == {f.name for f in fields(QualityThresholds)}, "one threshold per rule"

_LETTER = r"[^\W\d_]"
_LETTER_OR_DIGIT = r"[^\W_]"

_ROW = "__quality_row"
_HASH_SEED = 0x5EED
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant; u64 arithmetic wraps, which is what we want


# --- Measured quantities ------------------------------------------------------------------------


def quality_values(frame: pl.DataFrame, judged: str = SFT.judged) -> pl.DataFrame:
    """``frame`` plus one Float64 ``q_<quantity>`` column per measured quantity of the ``judged``
    answer."""
    response = frame.get_column(judged)
    measured = pl.concat(
        [_word_quantities(_word_table(response), response.len()), _line_quantities(response)],
        how="horizontal",
    )
    return frame.with_columns(measured.select(QUANTITIES))


def _word_table(response: pl.Series) -> pl.DataFrame:
    """Every word of every response, one row each, in text order: its response's row number,
    length, hash, and whether it holds a letter, or a letter or digit.

    Normalized text has no whitespace but single spaces and newlines, so splitting on those is
    enough (and faster than a regex); "\n\n" leaves empty words, dropped here.
    """
    words = (
        _indexed(response)
        .select(_ROW, word=pl.col("answer").str.replace_all("\n", " ", literal=True))
        .with_columns(pl.col("word").str.split(" "))
        .explode("word")
        .filter(pl.col("word").str.len_bytes() > 0)
    )
    return words.select(
        _ROW,
        chars=pl.col("word").str.len_chars(),
        hash=pl.col("word").hash(_HASH_SEED),
        has_letter=pl.col("word").str.contains(_LETTER),
        has_letter_or_digit=pl.col("word").str.contains(_LETTER_OR_DIGIT),
    )


def _word_quantities(words: pl.DataFrame, rows: int) -> pl.DataFrame:
    """Word count, mean word length, symbol and alpha word shares, and the repetition measures:

    - top 2-gram: how much of the text the most repeated word 2-gram covers (its count times its
      characters, capped at 1). It is the 2-gram whose repeats cover the most characters (Gopher
      ranks by count; the two differ only in ties of count), and one seen once counts for nothing,
      so a short answer is not flagged for having few 2-grams.
    - duplicate 5-grams: the share of word characters inside a 5-gram that already occurred earlier
      in the text (what could be deleted; Gopher also counts the first occurrence).
    """
    words = _with_repeated_5grams(_with_ngram_keys(words))
    per_row = words.group_by(_ROW, maintain_order=True).agg(
        words=pl.len(),
        chars=pl.col("chars").sum(),
        alpha_words=pl.col("has_letter").sum(),
        symbol_words=(~pl.col("has_letter_or_digit")).sum(),
        repeated_5gram_chars=pl.col("chars").filter("in_repeated_5gram").sum(),
    )
    per_row = per_row.join(_top_bigram_chars(words), on=_ROW, how="left", maintain_order="left")
    return _per_input_row(
        rows,
        per_row,
        q_words=pl.col("words"),
        q_mean_word_length=_ratio(pl.col("chars"), pl.col("words")),
        q_symbol_word_ratio=_ratio(pl.col("symbol_words"), pl.col("words")),
        q_alpha_word_fraction=_ratio(pl.col("alpha_words"), pl.col("words")),
        q_top_2gram_char_fraction=_ratio(pl.col("top_bigram_chars"), pl.col("chars")).clip(
            upper_bound=1.0
        ),
        q_duplicate_5gram_char_fraction=_ratio(pl.col("repeated_5gram_chars"), pl.col("chars")),
    )


def _with_ngram_keys(words: pl.DataFrame) -> pl.DataFrame:
    """Adds, at each word, the keys of the 2-gram and 5-gram starting there (null where the
    response ends first) and the characters of the 2-gram."""
    return words.with_columns(
        bigram_key=pl.when(_ngram_fits(2)).then(_ngram_key(2)),
        bigram_chars=pl.col("chars") + pl.col("chars").shift(-1),
        fivegram_key=pl.when(_ngram_fits(5)).then(_ngram_key(5)),
    )


def _with_repeated_5grams(words: pl.DataFrame) -> pl.DataFrame:
    """Adds ``in_repeated_5gram``: the word lies in a 5-gram that occurred earlier in its response,
    that is, one such 5-gram starts at it or at one of the 4 words before (a 5-gram key exists
    only where all 5 words share a response, so a start never reaches into the next one)."""
    key = pl.col("fivegram_key")
    # Per response: many small hash tables are much faster than one large one.
    words = words.with_columns(
        starts_repeated_5gram=key.is_not_null() & ~key.is_first_distinct().over(_ROW)
    )
    starts = pl.col("starts_repeated_5gram")
    return words.with_columns(
        in_repeated_5gram=pl.any_horizontal(starts.shift(lag, fill_value=False) for lag in range(5))
    )


def _top_bigram_chars(words: pl.DataFrame) -> pl.DataFrame:
    """Per response with a repeated 2-gram: the most characters one 2-gram covers (count x size)."""
    key = pl.col("bigram_key")
    # Only about one 2-gram in eight repeats in prose: counting those alone is 4x faster.
    repeated = words.filter(key.is_not_null() & key.is_duplicated().over(_ROW))
    per_bigram = repeated.group_by(_ROW, "bigram_key").agg(
        covered=pl.len() * pl.col("bigram_chars").first()
    )
    return per_bigram.group_by(_ROW).agg(top_bigram_chars=pl.col("covered").max())


def _line_quantities(response: pl.Series) -> pl.DataFrame:
    """Share of non-empty lines, and of their characters, that repeat an earlier line verbatim."""
    lines = (
        _indexed(response)
        .select(_ROW, pl.col("answer").str.split("\n").alias("line"))
        .explode("line")
        .filter(pl.col("line").str.len_bytes() > 0)
        .with_columns(
            chars=pl.col("line").str.len_chars(),
            repeated=~pl.col("line").hash(_HASH_SEED).is_first_distinct().over(_ROW),
        )
    )
    per_row = lines.group_by(_ROW, maintain_order=True).agg(
        lines=pl.len(),
        repeated_lines=pl.col("repeated").sum(),
        chars=pl.col("chars").sum(),
        repeated_chars=pl.col("chars").filter("repeated").sum(),
    )
    return _per_input_row(
        response.len(),
        per_row,
        q_duplicate_line_fraction=_ratio(pl.col("repeated_lines"), pl.col("lines")),
        q_duplicate_line_char_fraction=_ratio(pl.col("repeated_chars"), pl.col("chars")),
    )


def _ratio(numerator: pl.Expr, denominator: pl.Expr) -> pl.Expr:
    """numerator / denominator, 0 where there is nothing to divide by (never NaN: NaN compares
    greater than every number in polars and would slip past a ``min_*`` rule)."""
    return pl.when(denominator > 0).then(numerator / denominator).otherwise(0.0)


def _indexed(response: pl.Series) -> pl.DataFrame:
    return response.to_frame("answer").with_row_index(_ROW)


def _ngram_fits(n: int) -> pl.Expr:
    """The n words starting here belong to the same response (the table is in row order)."""
    return (pl.col(_ROW).shift(-(n - 1)) == pl.col(_ROW)).fill_null(False)


def _ngram_key(n: int) -> pl.Expr:
    """A 64-bit key of the n words starting here; meaningful only where they fit. Keys are only
    ever compared within one response, where two different n-grams share one at odds of about
    one in 2^64."""
    key = pl.col("hash")
    for offset in range(1, n):
        key = key * _MIX + pl.col("hash").shift(-offset)
    return key


def _per_input_row(rows: int, per_row: pl.DataFrame, **quantities: pl.Expr) -> pl.DataFrame:
    """The quantities for every input row, in input order; 0 for a row with no words or lines."""
    every_row = pl.DataFrame({_ROW: pl.int_range(rows, dtype=pl.UInt32, eager=True)})
    return every_row.join(per_row, on=_ROW, how="left", maintain_order="left").select(
        value.fill_null(0).cast(pl.Float64).alias(q) for q, value in quantities.items()
    )


# --- The gate -----------------------------------------------------------------------------------

_Overrides = Mapping[str, QualityThresholds]


def quality_gate(
    frame: pl.DataFrame,
    thresholds: Mapping[str, QualityThresholds] | None = None,
    default: QualityThresholds = QualityThresholds(),
    judged: str = SFT.judged,
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Split ``frame`` into (kept, rejected, details) by the rules in ``RULES`` order, judging the
    ``judged`` answer (the record format's): a stage function (``lib.stages``).

    ``thresholds`` overrides the default per ``source``. Both outputs keep the input order and
    carry the q_* columns; ``rejected`` adds stage ("quality:<first failing rule>"), rule_value,
    rule_threshold and evidence (JSON). details: rejected_by_rule.
    """
    measured = quality_values(frame, judged).with_columns(_first_failure(thresholds or {}, default))
    failed = pl.col("stage").is_not_null()
    kept = measured.filter(~failed).drop(REJECT_COLUMNS)
    rejected = measured.filter(failed)
    return kept, rejected, {"rejected_by_rule": _by_rule(rejected)}


def _threshold(rule: _Rule, overrides: _Overrides, default: QualityThresholds) -> pl.Expr:
    """The rule's threshold for each row, chosen by its source."""
    fallback = float(getattr(default, rule.name))
    if not overrides:
        return pl.lit(fallback, dtype=pl.Float64)
    per_source = {source: float(getattr(t, rule.name)) for source, t in overrides.items()}
    return pl.col("source").replace_strict(per_source, default=fallback, return_dtype=pl.Float64)


def _passes(rule: _Rule, overrides: _Overrides, default: QualityThresholds) -> pl.Expr:
    value, threshold = pl.col(rule.quantity), _threshold(rule, overrides, default)
    return value >= threshold if rule.comparison == ">=" else value <= threshold


def _first_failure(overrides: _Overrides, default: QualityThresholds) -> list[pl.Expr]:
    """stage, rule_value, rule_threshold and evidence of the first failing rule; nulls if none."""

    def at_first_failure(value_of: Callable[[_Rule], pl.Expr]) -> pl.Expr:
        return pl.coalesce(
            [pl.when(~_passes(r, overrides, default)).then(value_of(r)) for r in _RULE_SPECS]
        )

    rule = at_first_failure(lambda r: pl.lit(r.name))
    value = at_first_failure(lambda r: pl.col(r.quantity))
    threshold = at_first_failure(lambda r: _threshold(r, overrides, default))
    comparison = at_first_failure(lambda r: pl.lit(r.comparison))
    evidence = pl.struct(
        rule=rule, value=value, threshold=threshold, comparison=comparison
    ).struct.json_encode()
    return [
        (pl.lit(STAGE_PREFIX) + rule).alias("stage"),
        value.alias("rule_value"),
        threshold.alias("rule_threshold"),
        pl.when(rule.is_not_null()).then(evidence).cast(pl.String).alias("evidence"),
    ]


def _by_rule(rejected: pl.DataFrame) -> dict[str, int]:
    by_stage = dict(rejected.get_column("stage").value_counts().iter_rows())
    return {rule: int(by_stage.get(STAGE_PREFIX + rule, 0)) for rule in RULES}
