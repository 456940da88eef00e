"""The fast path for JSON lines: clean lines decoded in bulk, without Python work per field.

``split_clean_lines`` proves most lines of a file clean and returns their records, plus the numbers
of the lines it could not prove clean; the exact path (``landing_files``) decides those one by one,
so a rejected line gets exactly the reason code and detail it always had. A line is proven clean,
with the values the exact path would give it, when

- msgspec decodes it into the record's types: ``prompt`` and ``response`` strings; ``system`` and
  ``created_at`` strings or null; ``id`` a string, null, or an integer in orjson's range (beyond
  it orjson reads a float: ``wrong_type:id``); ``meta`` and unknown fields as raw JSON;
- ``meta``, when given and not null, is an object, and it and the unknown fields re-serialize
  through orjson (which checks their UTF-8) into ``meta`` and ``extra`` as the exact path writes
  them;
- ``prompt`` and ``response`` hold a character that ``str.strip`` keeps;
- ``created_at`` is null, or ``YYYY-MM-DDTHH:MM:SS[.f{1,6}]`` with ``Z`` or ``±HH:MM``, naming a
  real instant in the years 2 to 9998: the form polars and ``datetime.fromisoformat`` read alike;
- a field mapping, if any, renames unknown fields to distinct known ones (other mappings: every
  line takes the exact path).

msgspec refuses some lines orjson reads (its nesting limit is lower); those take the exact path,
which is correct, only slower.

A file's lines are decoded a run at a time (``LineBuffer``, one ``decode_lines`` call a run of
lines that each start with ``{`` and end with ``}``), not one call a line: a raw newline cannot be
inside a JSON string, and ``}`` then ``{`` across one cannot be inside a JSON value, so each such
line holds at least one whole value, and a run that decodes into as many values as it has lines
holds exactly one a line, each as that line alone decodes. Where a run is refused, its lines
before the refused one are decoded as a run and that line alone, as before.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

import msgspec
import numpy as np
import orjson
import polars as pl

from pipeline_assets.lib.landing.contract import KNOWN_FIELDS, PARSED_SCHEMA

_FIELD_KINDS = {
    "prompt": str,
    "response": str,
    "system": str | None,
    "id": str | int | None,
    "created_at": str | None,
    "meta": msgspec.Raw,
}
_ABSENT = msgspec.Raw()  # a raw field the line does not have: an empty buffer
_MAX_UNKNOWN_FIELDS = 32  # per file; a line bringing more takes the exact path
_ORJSON_INTS = (-(2**63), 2**64 - 1)  # orjson reads integers beyond these as floats
_KEYS_IN_ORDER = msgspec.json.Decoder(dict[str, msgspec.Raw])
# What msgspec raises for a line it refuses: DecodeError and ValidationError (ValueErrors), bad
# UTF-8 in a string (UnicodeDecodeError, a ValueError too), and RecursionError past its nesting
# limit.
_REFUSED = (ValueError, RecursionError)

# A character Python's str.strip() keeps: any but those str.isspace() is true for.
_NOT_SPACE = (
    "[^"
    + "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())
    + "]"
)
_TIMESTAMP = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])$"
)
# Within a day of the ends of datetime's years 1..9999, astimezone(utc) can overflow: exact path.
_TIMESTAMP_RANGE = (
    datetime(2, 1, 1, tzinfo=timezone.utc),
    datetime(9998, 12, 31, tzinfo=timezone.utc),
)
_PARSED_TIMESTAMP = (
    pl.col("created_at")
    .str.to_datetime("%Y-%m-%dT%H:%M:%S%.f%#z", time_unit="us", time_zone="UTC", strict=False)
    .alias("_created_at")
)
# Built once: building an expression with datetime literals takes about a millisecond.
_CLEAN = (
    pl.col("prompt").str.contains(_NOT_SPACE)
    & pl.col("response").str.contains(_NOT_SPACE)
    & (
        pl.col("created_at").is_null()
        | (
            pl.col("created_at").str.contains(_TIMESTAMP)
            & pl.col("_created_at").is_between(*_TIMESTAMP_RANGE)
        )
    )
).fill_null(False)


# The columns built from the decoded lines: created_at still text.
_DECODED_SCHEMA = {**PARSED_SCHEMA, "created_at": pl.String}


@dataclass(frozen=True)
class CleanLines:
    records: pl.DataFrame  # PARSED_SCHEMA: the lines proven clean, in line order
    other_lines: list[int]  # 1-based numbers of every other line, ascending


class LineBuffer(Sequence[bytes]):
    """The lines of a text as ``text.split(b"\\n")`` gives them, without copying them out: the text
    and where each line starts and ends. A last line with no newline is a line unless ``keep_tail``
    is false (a stream that broke off: the exact path quarantines what is left of it)."""

    def __init__(self, text: bytes, *, keep_tail: bool = True):
        self._text, self._codes = text, np.frombuffer(text, dtype=np.uint8)
        ends = np.flatnonzero(self._codes == ord("\n"))
        if keep_tail and len(text) and (len(ends) == 0 or ends[-1] != len(text) - 1):
            ends = np.append(ends, len(text))
        self._ends = ends
        self._starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else ends

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> bytes:  # type: ignore[override]  # an int: no slices
        return self._text[self._starts[index] : self._ends[index]]

    def offset(self, index: int) -> int:
        return int(self._starts[index])

    def line_at(self, offset: int) -> int:
        """The line holding the byte at ``offset`` (its newline included)."""
        return int(np.searchsorted(self._ends, offset, side="left"))

    def span(self, start: int, stop: int) -> memoryview:
        """Lines ``start`` to ``stop`` (exclusive) with the newlines between them."""
        return memoryview(self._text)[self._starts[start] : self._ends[stop - 1]]

    def object_runs(self) -> list[tuple[int, int]]:
        """Runs ``(start, stop)`` of consecutive lines that start with ``{`` and end with ``}`` (one
        ``\\r`` after it allowed, as the exact path strips it)."""
        if not len(self):
            return []
        starts, last = self._starts, self._ends - 1
        last = np.where(
            (last > starts) & (self._codes[np.maximum(last, 0)] == ord("\r")), last - 1, last
        )
        whole = last > starts  # at least two bytes, so both ends below are inside the line
        shaped = np.zeros(len(self) + 2, dtype=np.int8)
        shaped[1:-1] = (
            whole
            & (self._codes[np.where(whole, starts, 0)] == ord("{"))
            & (self._codes[np.where(whole, last, 0)] == ord("}"))
        )
        edges = np.flatnonzero(np.diff(shaped))  # a run starts where 0 -> 1 and stops where 1 -> 0
        return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def split_clean_lines(
    lines: Sequence[bytes], field_mapping: Mapping[str, str] | None = None
) -> CleanLines:
    """Records of the lines proven clean, and the numbers of the lines the exact path must decide.
    ``lines``: a ``LineBuffer`` (decoded a run at a time) or any sequence (a line at a time)."""
    mapping = dict(field_mapping or {})
    if not _mapping_is_supported(mapping):
        return CleanLines(PARSED_SCHEMA.to_frame(), list(range(1, len(lines) + 1)))
    decoded = _decode(lines, mapping)
    unsure: set[int] = set()  # positions in decoded.rows found unclean while building the columns
    if mapping:
        _apply_mapping(decoded, mapping, unsure)
    texts = {
        name: [getattr(row, name) for row in decoded.rows]
        for name in ("prompt", "response", "system")
    }
    frame = pl.DataFrame(
        {**texts, **_columns(decoded, lines, mapping, unsure)}, schema=_DECODED_SCHEMA
    )
    return _checked(frame, unsure, decoded.failed)


def split_clean_rows(
    frame: pl.DataFrame, field_mapping: Mapping[str, str] | None = None
) -> CleanLines | None:
    """``split_clean_lines`` for a Parquet file's rows; None when a known field's column is of a
    type only the exact path reads (a timestamp type for ``created_at``, say): then every row takes
    it.

    ``meta`` and unknown columns are written by orjson from the values the exact path sees."""
    mapping = dict(field_mapping or {})
    if not _mapping_is_supported(mapping):
        return None
    # Every row has every column, so a mapping applies to all rows or none: a column rename.
    frame = frame.rename(
        {theirs: ours for theirs, ours in mapping.items() if theirs in frame and ours not in frame}
    )
    known = {name: dtype for name, dtype in frame.schema.items() if name in KNOWN_FIELDS}
    if not {"prompt", "response"} <= set(known) or not all(
        _is_plain(n, t) for n, t in known.items()
    ):
        return None
    texts = {
        name: frame[name].to_list() if name in frame else [None] * frame.height
        for name in ("prompt", "response", "system")
    }
    unknown = [name for name in frame.columns if name not in KNOWN_FIELDS]
    extra = None
    if unknown:
        values = zip(*(frame[name].to_list() for name in unknown))
        extra = [orjson.dumps(dict(zip(unknown, row)), default=str).decode() for row in values]
    meta = None
    if "meta" in frame:
        meta = [
            None if value is None else orjson.dumps(value, default=str).decode()
            for value in frame["meta"].to_list()
        ]
    columns = {
        **texts,
        "source_line": range(1, frame.height + 1),
        "id": frame["id"].cast(pl.String) if "id" in frame else None,
        "created_at": frame["created_at"] if "created_at" in frame else None,
        "meta": meta,
        "extra": extra,
    }
    shaped = pl.DataFrame(
        {
            n: columns[n] if columns[n] is not None else [None] * frame.height
            for n in _DECODED_SCHEMA
        },
        schema=_DECODED_SCHEMA,
    )
    return _checked(shaped, set(), [])


def _is_plain(name: str, dtype: pl.DataType) -> bool:
    """A known field's column the fast path reads: text (or all null), integer ids, struct meta."""
    if name == "meta":
        return isinstance(dtype, pl.Struct) or dtype == pl.Null
    return dtype in (pl.String, pl.Null) or (name == "id" and dtype.is_integer())


def _checked(frame: pl.DataFrame, unsure: set[int], failed: list[int]) -> CleanLines:
    """The rows that pass the vectorized checks as records; every other number for the exact
    path."""
    clean = _CLEAN if not unsure else _CLEAN & ~pl.int_range(pl.len()).is_in(sorted(unsure))
    checked = frame.with_columns(_PARSED_TIMESTAMP).with_columns(clean.alias("_clean"))
    as_records = [
        pl.col("_created_at").alias("created_at") if n == "created_at" else n for n in PARSED_SCHEMA
    ]
    if checked["_clean"].all():
        return CleanLines(checked.select(as_records), failed)
    records = checked.filter("_clean").select(as_records)
    unclean = checked.filter(~pl.col("_clean"))["source_line"].to_list()
    return CleanLines(records, sorted(failed + unclean))


def _mapping_is_supported(mapping: dict[str, str]) -> bool:
    """Mappings from unknown fields to distinct known ones; others are left to the exact path."""
    distinct = len(set(mapping.values())) == len(mapping)
    return distinct and all(
        theirs not in KNOWN_FIELDS and ours in KNOWN_FIELDS for theirs, ours in mapping.items()
    )


# --- Decoding -----------------------------------------------------------------------------------


@dataclass
class _Decoded:
    rows: list  # one struct per decoded line
    numbers: list[int]  # the 1-based line number of each row
    failed: list[int]  # lines msgspec could not decode into the record's types
    unknown: tuple[str, ...]  # the unknown field names the rows may hold, as attributes u0, u1, ...


def _decode(lines: Sequence[bytes], mapping: dict[str, str]) -> _Decoded:
    """Decode every line with a typed struct; unknown fields met on the way are added to it."""
    decoding = _Decoding(
        tuple(mapping), frozenset(mapping.values())
    )  # a mapped field is read like an unknown one, then moved
    done = 0
    for start, stop in lines.object_runs() if isinstance(lines, LineBuffer) else []:
        decoding.alone(lines, done, start)
        for piece in range(start, stop, _RUN_LINES):
            decoding.run(lines, piece, min(piece + _RUN_LINES, stop))
        done = stop
    decoding.alone(lines, done, len(lines))
    return _Decoded(decoding.rows, decoding.numbers, decoding.failed, decoding.unknown)


class _Decoding:
    """Lines decoded so far, in line order, and the decoder for the unknown fields met so far."""

    def __init__(self, unknown: tuple[str, ...], mapped_to: frozenset[str]):
        self.unknown, self.mapped_to = unknown, mapped_to
        self.decoder = _decoder(unknown, mapped_to)
        self.rows: list = []  # one struct per decoded line
        self.numbers: list[int] = []  # its 1-based line number
        self.failed: list[int] = []

    def alone(self, lines: Sequence[bytes], start: int, stop: int) -> None:
        for index in range(start, stop):
            self.line(index, lines[index])

    def line(self, index: int, line: bytes) -> None:
        try:
            self._keep(index, self.decoder.decode(line))
            return
        except _REFUSED:
            pass
        found = _new_unknown_fields(line, self.unknown)
        if found:
            self.unknown += found
            self.decoder = _decoder(self.unknown, self.mapped_to)
            try:
                self._keep(index, self.decoder.decode(line))
                return
            except _REFUSED:
                pass
        self.failed.append(index + 1)

    def run(self, lines: LineBuffer, start: int, stop: int) -> None:
        """Lines ``start`` to ``stop``, each starting with ``{`` and ending with ``}``, a run at a
        time. Where a run is refused, the lines before the line it names are a run and that line is
        decided alone; where the refusal names no line, the run is halved."""
        then: list[
            tuple[int, bool]
        ] = []  # (stop to go on to, whether the line at ``start`` is decided alone first)
        while True:
            if start < stop:
                try:
                    values = self.decoder.decode_lines(lines.span(start, stop))
                except _REFUSED as refusal:
                    refused = _refused_line(refusal, lines, start, stop)
                    halve = refused is None and stop - start > 1
                    then.append((stop, not halve))
                    stop = (start + stop) // 2 if halve else (start if refused is None else refused)
                    continue
                if len(values) == stop - start:
                    self.rows += values
                    self.numbers += range(start + 1, stop + 1)
                else:  # cannot happen for such lines; a line at a time if it does
                    self.alone(lines, start, stop)
                start = stop
            if not then:
                return
            stop, alone = then.pop()
            if alone:
                self.line(start, lines[start])
                start += 1

    def _keep(self, index: int, row) -> None:
        self.rows.append(row)
        self.numbers.append(index + 1)


def _new_unknown_fields(line: bytes, unknown: tuple[str, ...]) -> tuple[str, ...]:
    try:
        keys = _KEYS_IN_ORDER.decode(line)
    except _REFUSED:
        return ()
    found = tuple(key for key in keys if key not in KNOWN_FIELDS and key not in unknown)
    return found if len(unknown) + len(found) <= _MAX_UNKNOWN_FIELDS else ()


# Lines decoded in one call at most: a refused line costs decoding the lines before it in its run
# again, so short runs keep a file with many bad lines near the cost of a clean one, while a call
# still takes many lines (its own cost is about that of decoding one line).
_RUN_LINES = 64
_AT_VALUE = re.compile(r"at `\$\[(\d+)\]")  # a ValidationError names the value of the run
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")  # a DecodeError, the byte where it could not go on


def _refused_line(refusal: Exception, lines: LineBuffer, start: int, stop: int) -> int | None:
    """The line of ``start`` to ``stop`` where msgspec refused the run, when it says (a malformed
    line is named where the parser stopped, at or after the fault: the lines before it are tried
    again as a run, which finds an earlier fault); None when it does not."""
    message = str(refusal)
    if isinstance(refusal, msgspec.ValidationError) and (value := _AT_VALUE.search(message)):
        refused = start + int(value[1])
    elif isinstance(refusal, msgspec.DecodeError) and (byte := _AT_BYTE.search(message)):
        refused = lines.line_at(lines.offset(start) + int(byte[1]))
    elif isinstance(refusal, msgspec.DecodeError) and message == "Input data was truncated":
        refused = stop - 1
    elif isinstance(refusal, UnicodeDecodeError):  # its position is within a string: find the bytes
        try:
            str(lines.span(start, stop), "utf-8")
            return None
        except UnicodeDecodeError as bad:
            refused = lines.line_at(lines.offset(start) + bad.start)
    else:
        return None
    return refused if start <= refused < stop else None


@lru_cache(maxsize=256)
def _decoder(unknown: tuple[str, ...], mapped_to: frozenset[str]) -> msgspec.json.Decoder:
    """A decoder for lines with the known fields and these unknown ones (each optional, raw).

    A known field a mapping may fill is UNSET when absent, so that the mapping applies only where
    the line lacks the field, as in the exact path (``meta``, raw, is empty when absent).
    """
    fields = []
    for name, kind in _FIELD_KINDS.items():
        if name == "meta":
            fields.append((name, kind, _ABSENT))
        elif name in mapped_to:
            fields.append((name, kind | msgspec.UnsetType, msgspec.UNSET))
        elif name in ("prompt", "response"):
            fields.append((name, kind))
        else:
            fields.append((name, kind, None))
    fields += [(f"u{i}", msgspec.Raw, _ABSENT) for i in range(len(unknown))]
    record = msgspec.defstruct(
        "LandingLine",
        fields,
        rename={f"u{i}": key for i, key in enumerate(unknown)},
        forbid_unknown_fields=True,
        gc=False,
    )
    return msgspec.json.Decoder(record)


def _apply_mapping(decoded: _Decoded, mapping: dict[str, str], unsure: set[int]) -> None:
    """Move each mapped field to its known name in the rows that lack that name (in place)."""
    attrs = {theirs: f"u{decoded.unknown.index(theirs)}" for theirs in mapping}
    for position, row in enumerate(decoded.rows):
        for theirs, ours in mapping.items():
            current, raw = getattr(row, ours), getattr(row, attrs[theirs])
            if raw and (current is msgspec.UNSET or (ours == "meta" and not current)):
                try:
                    setattr(row, ours, msgspec.json.decode(bytes(raw), type=_FIELD_KINDS[ours]))
                except _REFUSED:
                    unsure.add(position)  # a wrong type: the exact path names it
                setattr(row, attrs[theirs], _ABSENT)  # moved: no longer an unknown field
        for ours in mapping.values():
            if getattr(row, ours) is msgspec.UNSET:
                if ours in ("prompt", "response"):
                    unsure.add(position)  # missing: the exact path names it
                setattr(row, ours, "" if ours in ("prompt", "response") else None)


# --- Columns ------------------------------------------------------------------------------------


class _NotClean(Exception):
    """A value the fast path cannot vouch for: its line takes the exact path."""


def _columns(
    decoded: _Decoded, lines: Sequence[bytes], mapping: dict[str, str], unsure: set[int]
) -> dict:
    """The record columns of the decoded rows but the texts; rows found unclean
    go to unsure."""
    rows = decoded.rows
    return {
        "source_line": decoded.numbers,
        "id": _id_texts([row.id for row in rows], unsure),
        "created_at": [row.created_at for row in rows],
        "meta": _distinct_texts([bytes(row.meta) for row in rows], _object_json, unsure),
        "extra": _extra_texts(decoded, lines, mapping, unsure),
    }


def _id_texts(ids: list, unsure: set[int]) -> list:
    if int not in set(map(type, ids)):
        return ids
    texts = []
    for position, value in enumerate(ids):
        if type(value) is int:
            if not _ORJSON_INTS[0] <= value <= _ORJSON_INTS[1]:
                unsure.add(position)
            value = str(value)
        texts.append(value)
    return texts


def _distinct_texts(
    raws: list[bytes], to_text: Callable[[bytes], str | None], unsure: set[int]
) -> list:
    """``to_text`` of each raw value, computed once per distinct value (values repeat: annotators,
    sessions); a value it raises ``_NotClean`` for leaves its row unsure."""
    memo: dict[bytes, str | None] = {}
    refused = set()
    for raw in set(raws):
        try:
            memo[raw] = to_text(raw)
        except _NotClean:
            memo[raw] = None
            refused.add(raw)
    if refused:
        unsure.update(position for position, raw in enumerate(raws) if raw in refused)
    return [memo[raw] for raw in raws]


def _object_json(raw: bytes) -> str | None:
    """``meta`` as the exact path writes it: None when absent or null, else an object's JSON."""
    if not raw or raw == b"null":
        return None
    value = _parsed(raw)
    if not isinstance(value, dict):
        raise _NotClean()
    return _dumped(value)


def _extra_texts(
    decoded: _Decoded, lines: Sequence[bytes], mapping: dict[str, str], unsure: set[int]
) -> list:
    """``extra``: the unknown fields as one JSON object in the line's order, as the exact path
    writes it."""
    if not decoded.unknown:
        return [None] * len(decoded.rows)
    attrs = [f"u{i}" for i in range(len(decoded.unknown))]
    if len(attrs) == 1:  # the common case, one extra field a source adds: no order to keep
        raws = [bytes(getattr(row, attrs[0], _ABSENT)) for row in decoded.rows]
        return _one_field_texts(decoded.unknown[0], raws, unsure)
    texts = []
    for position, row in enumerate(decoded.rows):
        present = any(getattr(row, attr, _ABSENT) for attr in attrs)
        try:
            texts.append(
                _extra_in_line_order(lines[decoded.numbers[position] - 1], mapping)
                if present
                else None
            )
        except _NotClean:
            unsure.add(position)
            texts.append(None)
    return texts


def _one_field_texts(key: str, raws: list[bytes], unsure: set[int]) -> pl.Series:
    """``{key: value}`` for each raw value, as orjson writes it (None where absent). A string with
    no escape and no control character is written back exactly as it was read (orjson escapes only
    quotes, backslashes and control characters), so those are copied in polars, not parsed (session
    ids and the like: mostly distinct); other values are parsed and written once each."""
    key_json = orjson.dumps(key).decode()
    present = pl.Series(raws, dtype=pl.Binary)
    try:
        text = present.cast(pl.String)
    except pl.exceptions.ComputeError:  # a value is not UTF-8: every value is parsed
        text = pl.Series([None] * len(raws), dtype=pl.String)
    copied = (text.str.starts_with('"') & ~text.str.contains(r"[\\\x00-\x1f]")).fill_null(False)
    written = pl.select(
        pl.when(copied).then(pl.lit("{" + key_json + ":") + text + pl.lit("}"))
    ).to_series()
    parsed = (~copied & (present.bin.size() > 0)).arg_true().to_list()
    if not parsed:
        return written
    refused: set[int] = set()
    values = _distinct_texts(
        [raws[i] for i in parsed], lambda raw: _dumped({key: _parsed(raw)}), refused
    )
    unsure.update(parsed[i] for i in refused)
    return written.scatter(parsed, pl.Series(values, dtype=pl.String))


def _extra_in_line_order(line: bytes, mapping: dict[str, str]) -> str | None:
    try:
        values = _KEYS_IN_ORDER.decode(
            line
        )  # a dict, like orjson's: in order, a repeated key's last value
    except _REFUSED:
        raise _NotClean() from None
    for theirs, ours in mapping.items():
        if theirs in values and ours not in values:
            del values[theirs]
    unknown = {key: _parsed(bytes(raw)) for key, raw in values.items() if key not in KNOWN_FIELDS}
    return _dumped(unknown) if unknown else None


def _parsed(raw: bytes) -> object:
    """A raw value as orjson reads it (within its nesting limit: every value is then written, and
    orjson writes 255 levels where it reads 1024)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _NotClean() from None


def _dumped(value: object) -> str:
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:  # nested deeper than orjson writes: the exact path fails the same way
        raise _NotClean() from None
