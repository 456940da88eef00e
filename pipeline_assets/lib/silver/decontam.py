"""N-gram decontamination: drop training records that contain benchmark (eval set) items.

Words. A text is split into words with one rule, the same for eval items and records:

1. Unicode NFC (records are NFC already after ``normalize``; eval files may not be);
2. ``str.casefold()`` when ``DecontamConfig.lowercase`` (so "Straße" matches "STRASSE");
3. split on whitespace (any run of spaces, tabs, newlines);
4. strip leading and trailing punctuation from each word, where punctuation is every character
   that is not a letter, digit or underscore (Python's ``\\w``): quotes, brackets, backticks,
   dashes, ``.,;:!?``, symbols such as ``$%+*``. Characters inside a word stay, so
   ``os.path.join(`` -> ``os.path.join`` and ``"item."`` -> ``item``;
5. drop words that were all punctuation (a lone ``-`` or ``...``), so "a - b" reads as "a b".

Scripts written without spaces (Chinese, Japanese, Thai) come out as one long word per run of
text; this module is meant for space-separated languages.

Grams. Each eval text (an item's prompt, and its response, separately) is indexed by length:

* ``ngram`` words or more: every ``ngram``-word window;
* at least ``short_min_words`` but fewer than ``ngram`` words: the whole text as one gram, which
  a record matches when any of its fields contains it as a run of words. Short items are caught
  this way without a shorter n for everything else;
* fewer than ``short_min_words`` words: the whole text, matched only when it is a record field's
  whole text. A two-word answer such as "Paris" would otherwise flag every record that says it.

Lookup. Every word of the eval texts gets a number (a record's other words are -1), and every
gram is filed under the hash of its first ``min(ngram, short_min_words)`` words' numbers (the
anchor). A record field's anchors are hashed in C (``map(hash, zip(...))``) and checked against
the index with one ``isdisjoint``; only on a hit is the field scanned in Python, and a candidate
counts only when its words equal the record's words, so a hash collision cannot flag a record.
The hash of a tuple of ints is the same in every process, where a tuple of strings' is not
(PYTHONHASHSEED): an index built in the step's process finds the same grams in a Ray worker it
was sent to.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

import polars as pl

from pipeline_assets.lib.formats import SFT, TURNS

EVAL_COLUMNS = ("eval_set", "item_id", "prompt", "response")
# What silver's decontamination and evaluation say when the eval sets hold no item.
NO_EVAL_SETS = "no eval set items (add <set>.jsonl files under PIPELINE_EVAL_SETS_URI)"
EVAL_TEXT_FIELDS = ("prompt", "response")
EVIDENCE_COLUMNS = ("eval_set", "eval_item_id", "matched_ngram", "evidence")

# A word: from its first to its last word character (letter, digit, underscore), with no
# whitespace in between; what is around that is the punctuation stripped off.
_WORD = re.compile(r"\w(?:\S*\w)?")
_SLICE_ROWS = 50_000  # records turned into Python strings at a time


@dataclass(frozen=True)
class DecontamConfig:
    ngram: int = 13  # word n-gram size
    lowercase: bool = True  # compare case-insensitively (casefold); punctuation: module docstring
    fields: tuple[str, ...] = SFT.decontaminate  # record text that is checked, in this order
    # Eval texts shorter than ngram are still matched as contained spans down to this many words;
    # shorter ones only as a record field's whole text. 8-word spans rarely recur by chance.
    short_min_words: int = 8

    def __post_init__(self) -> None:
        if self.ngram < 1 or self.short_min_words < 1:
            raise ValueError("ngram and short_min_words must be at least 1")
        if not self.fields:
            raise ValueError("fields must name at least one record column")

    @property
    def anchor_words(self) -> int:
        return min(self.ngram, self.short_min_words)


def text_words(text: str | None, lowercase: bool = True) -> list[str]:
    """The words of ``text`` as compared here (rules in the module docstring)."""
    if not text:
        return []
    text = unicodedata.normalize("NFC", text)
    return _WORD.findall(text.casefold() if lowercase else text)


def _window_hashes(numbers: list[int], size: int) -> Iterator[int]:
    """hash(tuple) of every ``size``-word window of word numbers, in order, without a Python loop
    per window."""
    return map(hash, zip(*[numbers[k:] for k in range(size)], strict=False))


# --- Eval sets ------------------------------------------------------------------------------------


def read_eval_sets(folder: Path) -> pl.DataFrame:
    """All *.jsonl files in folder (by name) -> columns eval_set, item_id, prompt, response.

    Blank lines are skipped. A line that is not a JSON object with those four string fields
    raises ValueError naming the file and the line number.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"eval set folder {folder} does not exist")
    rows = [row for path in sorted(folder.glob("*.jsonl")) for row in _eval_file_rows(path)]
    columns = {c: [row[i] for row in rows] for i, c in enumerate(EVAL_COLUMNS)}
    return pl.DataFrame(columns, schema=dict.fromkeys(EVAL_COLUMNS, pl.String))


def _eval_file_rows(path: Path) -> Iterator[tuple[str, ...]]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    yield _eval_row(line)
                except ValueError as exc:
                    raise ValueError(f"{path}: line {number}: {exc}") from None


def _eval_row(line: bytes) -> tuple[str, ...]:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for name in EVAL_COLUMNS:
        if not isinstance(obj.get(name), str):
            got = "missing" if name not in obj else type(obj[name]).__name__
            raise ValueError(f"field {name!r} must be a string ({got})")
    return tuple(obj[name] for name in EVAL_COLUMNS)


# --- The index ------------------------------------------------------------------------------------


class EvalText(NamedTuple):
    """One indexed eval text: an item's prompt or response, as words."""

    eval_set: str
    item_id: str
    words: tuple[str, ...]


class Contamination(NamedTuple):
    """The first indexed gram found in a record."""

    field: str  # the record column it was found in
    position: int  # word offset in that field
    ngram: str  # the matched words, joined by single spaces
    eval_set: str
    item_id: str

    def evidence(self) -> str:
        facts = {"eval_set": self.eval_set, "item_id": self.item_id, "ngram": self.ngram}
        return json.dumps({**facts, "field": self.field}, ensure_ascii=False)


class _GramTable:
    """Hash -> the grams filed under it. A gram is ``(text_number << 32) | start``.

    Most hashes hold one gram, kept as a bare int; a hash shared by several (the same anchor
    words continuing differently, or a hash collision) holds a tuple of them.
    """

    def __init__(self) -> None:
        self.refs: dict[int, int | tuple[int, ...]] = {}

    def add(self, key: int, ref: int) -> None:
        held = self.refs.get(key)
        self.refs[key] = ref if held is None else (*self.get(key), ref)

    def get(self, key: int) -> tuple[int, ...]:
        held = self.refs.get(key)
        if held is None:
            return ()
        return (held,) if type(held) is int else held


class EvalNgramIndex:
    """The grams of every eval item's prompt and response, and where each came from.

    An identical gram in several items is kept once, for the first item in ``eval_items`` order
    (prompt before response), which is the item a match reports.
    """

    def __init__(self, config: DecontamConfig) -> None:
        self.config = config
        self.eval_sets: tuple[str, ...] = ()
        self._texts: list[EvalText] = []
        self._word_numbers: dict[str, int] = {}  # every word of the eval texts
        self._anchored = _GramTable()  # grams of at least anchor_words words
        self._whole_fields = _GramTable()  # texts shorter than anchor_words: whole-field matches
        self._gram_count = 0

    @classmethod
    def build(
        cls, eval_items: pl.DataFrame, config: DecontamConfig = DecontamConfig()
    ) -> EvalNgramIndex:
        missing = [c for c in EVAL_COLUMNS if c not in eval_items.columns]
        if missing:
            raise ValueError(f"eval items lack columns {missing}")
        index = cls(config)
        for eval_set, item_id, *texts in eval_items.select(EVAL_COLUMNS).iter_rows():
            for text in texts:
                # Interned: a word repeated across items is stored once.
                words = tuple(map(sys.intern, text_words(text, config.lowercase)))
                if words:
                    index._add_text(EvalText(eval_set, item_id, words))
        index.eval_sets = eval_set_names(eval_items)
        return index

    def __len__(self) -> int:
        """The number of distinct grams (n-grams, plus one per eval text shorter than n words)."""
        return self._gram_count

    def _add_text(self, text: EvalText) -> None:
        number = len(self._texts)
        self._texts.append(text)
        numbers, anchor = self._numbered(text.words), self.config.anchor_words
        if len(numbers) < anchor:
            self._add_gram(self._whole_fields, hash(tuple(numbers)), number << 32)
            return
        windows = max(1, len(numbers) - self.config.ngram + 1)  # a short text is one window
        for start, key in enumerate(_window_hashes(numbers, anchor)):
            if start == windows:
                break
            self._add_gram(self._anchored, key, (number << 32) | start)

    def _add_gram(self, table: _GramTable, key: int, ref: int) -> None:
        gram = self._gram_words(ref)
        if any(self._gram_words(held) == gram for held in table.get(key)):
            return
        table.add(key, ref)
        self._gram_count += 1

    def _numbered(self, words: Sequence[str]) -> list[int]:
        """The eval text's words as numbers, numbering the words not seen before."""
        numbers = self._word_numbers
        return [numbers.setdefault(word, len(numbers)) for word in words]

    def _numbers_of(self, words: list[str]) -> list[int]:
        """A record's words as numbers: -1 for a word no eval text has."""
        return list(map(self._word_numbers.get, words, repeat(-1)))

    def _gram_words(self, ref: int) -> tuple[str, ...]:
        words = self._texts[ref >> 32].words
        start = ref & 0xFFFFFFFF
        return words[start : start + self.config.ngram]

    # --- matching ---------------------------------------------------------------------------------

    def first_match(
        self, texts: Sequence[str | None], fields: Sequence[str] | None = None
    ) -> Contamination | None:
        """The first gram found in a record whose ``fields`` (default: ``config.fields``) values are
        ``texts``."""
        for field, text in zip(fields or self.config.fields, texts, strict=True):
            words = text_words(text, self.config.lowercase)
            found = self._first_in_words(words)
            if found is not None:
                position, ref = found
                eval_text = self._texts[ref >> 32]
                ngram = " ".join(self._gram_words(ref))
                return Contamination(field, position, ngram, eval_text.eval_set, eval_text.item_id)
        return None

    def _first_in_words(self, words: list[str]) -> tuple[int, int] | None:
        """(position, gram) of the first gram in ``words``, earliest position first."""
        anchor, numbers = self.config.anchor_words, self._numbers_of(words)
        if len(words) < anchor:
            return self._whole_field_match(words, numbers)
        table = self._anchored
        if table.refs.keys().isdisjoint(_window_hashes(numbers, anchor)):
            return None  # the common case: no anchor in common with any eval text
        for position, key in enumerate(_window_hashes(numbers, anchor)):
            for ref in table.get(key):
                gram = self._gram_words(ref)
                if tuple(words[position : position + len(gram)]) == gram:
                    return position, ref
        return None

    def _whole_field_match(self, words: list[str], numbers: list[int]) -> tuple[int, int] | None:
        as_tuple = tuple(words)
        for ref in self._whole_fields.get(hash(tuple(numbers))):
            if self._gram_words(ref) == as_tuple:
                return 0, ref
        return None


@dataclass(frozen=True)
class EvalItems:
    """The eval sets' items (``EVAL_COLUMNS``) and the settings to index them with, as silver's
    prepare tasks are given them: each worker process builds the index once a version of the items
    (``index``), so the step's process, deciding one batch after another, builds none."""

    items: pl.DataFrame
    config: DecontamConfig
    version: str  # the items' data version (the eval sets' fingerprint)

    def index(self) -> EvalNgramIndex:
        key = (self.version, self.config)
        if key not in _BUILT:
            _BUILT.clear()  # a process keeps the index of one version of the eval sets
            _BUILT[key] = EvalNgramIndex.build(self.items, self.config)
        return _BUILT[key]

    def names_only(self) -> EvalNgramIndex:
        """An index of no gram that knows the eval sets' names: for a share with no record, whose
        counters name every eval set (with 0), without building the index."""
        index = EvalNgramIndex(self.config)
        index.eval_sets = eval_set_names(self.items)
        return index


_BUILT: dict[tuple[str, DecontamConfig], EvalNgramIndex] = {}


def eval_set_names(eval_items: pl.DataFrame) -> tuple[str, ...]:
    return tuple(sorted(set(eval_items["eval_set"].drop_nulls().to_list())))


# --- Records --------------------------------------------------------------------------------------


def find_contamination(
    records: pl.DataFrame, index: EvalNgramIndex, fields: Sequence[str] | None = None
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Returns (kept, rejected, details): a stage function (``lib.stages``).

    rejected: the contaminated input rows plus eval_set, eval_item_id, matched_ngram (the gram's
    words joined by spaces) and evidence (JSON: eval_set, item_id, ngram, field). A record is
    contaminated if any gram of any checked field is in the index; the first one is reported (first
    field in config order, then first word position). Both frames keep the input order and every
    input column. ``fields``: the record format's text to check, in order (default: the index's
    ``config.fields``). details: rejected_by_eval_set.
    """
    fields = tuple(fields or index.config.fields)
    missing = [c for c in ("record_id", *fields) if c not in records.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    matches = list(_record_matches(records.select(fields), index, fields))
    is_contaminated = pl.Series("is_contaminated", [m is not None for m in matches], pl.Boolean)
    kept = records.filter(~is_contaminated)
    rejected = _rejected_rows(records.filter(is_contaminated), [m for m in matches if m])
    return kept, rejected, {"rejected_by_eval_set": _by_eval_set(rejected, index)}


def _record_matches(
    texts: pl.DataFrame, index: EvalNgramIndex, fields: Sequence[str]
) -> Iterator[Contamination | None]:
    # Slices bound the Python strings alive at once; matches are kept, the text is not.
    turns = any(texts.schema[c] == TURNS for c in fields)
    for chunk in texts.iter_slices(_SLICE_ROWS):
        columns = [_texts_of(chunk[c]) for c in fields]
        for values in zip(*columns, strict=True):
            yield (
                index.first_match(*_each_turn(fields, values))
                if turns
                else index.first_match(values, fields)
            )


def _texts_of(column: pl.Series) -> list:
    """A text column's values; a column of turns: each row's turn contents, as a list."""
    if column.dtype == TURNS:
        return column.list.eval(pl.element().struct.field("content")).to_list()
    return column.cast(pl.String).to_list()


def _each_turn(fields: Sequence[str], values: Sequence) -> tuple[list, list[str]]:
    """A record's texts and the fields they are reported under, a column of turns as one field a
    turn: ``messages[2]``."""
    texts, names = [], []
    for field, value in zip(fields, values, strict=True):
        if isinstance(value, list):
            texts += value
            names += [f"{field}[{i}]" for i in range(len(value))]
        else:
            texts.append(value)
            names.append(field)
    return texts, names


def _rejected_rows(rows: pl.DataFrame, matches: list[Contamination]) -> pl.DataFrame:
    return rows.with_columns(
        pl.Series("eval_set", [m.eval_set for m in matches], pl.String),
        pl.Series("eval_item_id", [m.item_id for m in matches], pl.String),
        pl.Series("matched_ngram", [m.ngram for m in matches], pl.String),
        pl.Series("evidence", [m.evidence() for m in matches], pl.String),
    )


def _by_eval_set(rejected: pl.DataFrame, index: EvalNgramIndex) -> dict[str, int]:
    by_eval_set = dict.fromkeys(index.eval_sets, 0)
    for eval_set, count in rejected["eval_set"].value_counts(sort=True).iter_rows():
        by_eval_set[eval_set] = count
    return dict(sorted(by_eval_set.items()))
