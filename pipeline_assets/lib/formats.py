"""Record formats: the one place that knows a record's shape.

A format names its landing fields and which text each stage reads: what normalization rewrites,
what exact and near dedup hash, which answers are signed apart and judged by the quality rules,
what decontamination checks against the eval sets, and the loss a model trains on it with. A source
declares its format in ``PIPELINE_SOURCE_FORMATS`` (``{"prefs": "preference"}``; ``sft`` unless
named). A format also names its bronze and silver tables: their assets, checks and sensors are made
for every format listed in ``FORMATS``. Adding a format is one description here, its contracts
(``contracts.FORMAT_CONTRACTS``), its rendering to tokens and its sample data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import polars as pl

SHARED_OPTIONAL = ("id", "created_at", "meta")  # every format's optional fields besides its text


@dataclass(frozen=True)
class RecordFormat:
    name: str
    required: tuple[str, ...]  # non-empty strings every record has
    optional_text: tuple[str, ...]  # strings a record may leave out (or null)
    optional_numbers: tuple[str, ...]  # numbers a record may leave out (or null)
    dedup: tuple[str, ...]  # joined, the text exact and near dedup compare
    answers: tuple[
        str, ...
    ]  # joined, signed apart: a near-duplicate's answers are near-duplicates too
    judged: str  # the answer the quality rules judge
    decontaminate: tuple[str, ...]  # checked against the eval sets, in this order
    split_key: str  # the column whose hash decides a record's train/validation side
    # the loss a model trains on it with: trainer/objective.py's "sft" (next token on the answer
    # after the prompt; such formats are packed into gold/sequences with sft records) or "dpo"
    objective: str
    bronze_table: str  # bronze/<bronze_table>: its records with provenance
    silver_table: str  # silver/<silver_table>: its curated records
    about: str  # what its records are, for the descriptions of its tables

    @property
    def text(self) -> tuple[str, ...]:
        """Every text field: what normalization rewrites and what a data stage's work is counted
        in."""
        return self.required + self.optional_text

    @property
    def known(self) -> frozenset[str]:
        """Every field the format names; any other lands verbatim in ``extra``."""
        return frozenset(
            self.required + self.optional_text + self.optional_numbers + SHARED_OPTIONAL
        )

    def looks_like(self, fields: set[str]) -> bool:
        """A record with these fields has every field this format requires."""
        return set(self.required) <= fields


SFT = RecordFormat(
    name="sft",
    required=("prompt", "response"),
    optional_text=("system",),
    optional_numbers=(),
    dedup=("prompt", "response"),
    answers=("response",),
    judged="response",
    decontaminate=("prompt", "response"),
    split_key="exact_hash",
    objective="sft",
    bronze_table="records",
    silver_table="records",
    about="sft records (prompt, response: the default format)",
)
# Several pairs for one prompt are legitimate, so all of one prompt's pairs share a side of the
# split.
PREFERENCE = RecordFormat(
    name="preference",
    required=("prompt", "chosen", "rejected"),
    optional_text=("system",),
    optional_numbers=("score_chosen", "score_rejected"),
    dedup=("prompt", "chosen", "rejected"),
    answers=("chosen", "rejected"),
    judged="chosen",
    decontaminate=("prompt", "chosen", "rejected"),
    split_key="prompt_hash",
    objective="dpo",
    bronze_table="preference_records",
    silver_table="preference_pairs",
    about="preference pairs (prompt, chosen, rejected)",
)
FORMATS = {f.name: f for f in (SFT, PREFERENCE)}


def all_text_fields() -> tuple[str, ...]:
    """Every format's text fields (read when called: a format added to ``FORMATS`` counts at
    once)."""
    return tuple(dict.fromkeys(name for f in FORMATS.values() for name in f.text))


def format_named(name: str) -> RecordFormat:
    """The format called ``name``; an unknown name fails, listing the formats there are."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown record format {name!r}; one of {', '.join(FORMATS)}") from None


def record_chars(columns: Iterable[str] = SFT.text) -> pl.Expr:
    """Characters of each record's text (prompt, response and system): the work a data stage
    does."""
    return pl.sum_horizontal(pl.col(c).str.len_chars().fill_null(0) for c in columns)


def text_chars(frame: pl.DataFrame) -> int:
    """Characters of every record's text in ``frame`` (the text fields of whichever format it
    holds), as ``record_chars`` counts them."""
    columns = [c for c in all_text_fields() if c in frame.columns]
    if frame.is_empty() or not columns:
        return 0
    return int(frame.select(record_chars(columns)).to_series().sum())
