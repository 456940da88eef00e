"""Landing files -> accepted records + quarantined lines, with a reason code for every rejection.

Every unit read from a file (a JSONL line, a Parquet row, or the file itself when it cannot be
read) ends up in exactly one of the two outputs, so ``lines_read == accepted + quarantined``.

Reason codes: ``invalid_json``, ``not_an_object``, ``invalid_utf8``, ``blank_line``,
``truncated_file``, ``unreadable_file``, ``unsupported_format``, and per field
``missing_field:<f>``, ``wrong_type:<f>``, ``empty_field:<f>``, ``invalid_timestamp:<f>``, and
``too_deep:meta`` / ``too_deep:extra`` for values nested deeper than orjson writes. A conversation
whose turns are broken: ``missing_field:messages``, ``wrong_type:messages`` (not a list of turns, or
a turn that is not a role and a string content), ``empty_field:messages`` (no turn),
``unknown_role``, ``empty_turn``, ``no_assistant_turn``, ``ends_on_user_turn`` and
``ends_on_system_turn``; the detail names the turn by its index. A preference pair in TRL's
conversational shape whose turns are broken: ``empty_field:prompt``, ``wrong_type:prompt`` (or
``wrong_type:chosen`` / ``:rejected``), ``unknown_role``, ``empty_turn``,
``prompt_ends_on_assistant_turn`` / ``prompt_ends_on_system_turn``, ``not_one_turn:<answer>`` (an
answer list that does not hold exactly one turn), ``not_assistant:<answer>`` and ``system_twice``
(a ``system`` field beside a prompt that starts with a system turn).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

import orjson
import polars as pl
import zstandard

from pipeline_assets.lib.formats import SFT, RecordFormat
from pipeline_assets.lib.landing.contract import (
    QUARANTINE_SCHEMA,
    Rejected,
    parsed_schema,
    validate_landing_object,
    with_content_hash,
)
from pipeline_assets.lib.landing.fast_reader import LineBuffer, split_clean_lines, split_clean_rows

FORMATS = {
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
}

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileReadResult:
    records: pl.DataFrame  # landing_contract.record_schema of the file's record format
    quarantine: pl.DataFrame  # QUARANTINE_SCHEMA
    lines_read: int


def landing_format(name: str) -> str | None:
    """The landing format a file name declares, or None when it is not one we read."""
    for suffix, fmt in FORMATS.items():
        if name.endswith(suffix):
            return fmt
    return None


def read_landing_file(
    name: str,
    data: bytes,
    field_mapping: Mapping[str, str] | None = None,
    record_format: RecordFormat = SFT,
) -> FileReadResult:
    """Parse and validate one landing file's bytes as records of ``record_format``;
    ``field_mapping`` renames the source's fields.

    Clean JSON lines and Parquet rows of sft records take the fast path (``landing_fast``); every
    other line or row takes the exact one.
    """
    return _read(name, data, field_mapping, fast=record_format is SFT, record_format=record_format)


def read_landing_file_exact(
    name: str,
    data: bytes,
    field_mapping: Mapping[str, str] | None = None,
    record_format: RecordFormat = SFT,
) -> FileReadResult:
    """``read_landing_file`` with every line on the exact per-line path: the reference the fast path
    must match, record for record and reason for reason."""
    return _read(name, data, field_mapping, fast=False, record_format=record_format)


def _read(
    name: str,
    data: bytes,
    field_mapping: Mapping[str, str] | None,
    *,
    fast: bool,
    record_format: RecordFormat,
) -> FileReadResult:
    builder = _FrameBuilder(field_mapping or {}, record_format)
    fmt = landing_format(name)
    if fmt is None:
        builder.reject(0, "", "unsupported_format", f"{name}: not one of {', '.join(FORMATS)}")
    elif fmt == "parquet":
        _read_parquet(data, builder, fast=fast)
    else:
        _read_jsonl(fmt, data, builder, fast=fast)
    return builder.result()


def rejected_file(reason: str, detail: str, record_format: RecordFormat = SFT) -> FileReadResult:
    """A whole file set aside as one quarantined unit (line 0), e.g. one that is gone or changed."""
    builder = _FrameBuilder({}, record_format)
    builder.reject(0, "", reason, detail)
    return builder.result()


# --- JSON lines ---------------------------------------------------------------------------------


def _read_jsonl(fmt: str, data: bytes, builder: "_FrameBuilder", *, fast: bool) -> None:
    text, failure = _decompress(fmt, data)
    if failure is not None and failure[0] == "unreadable_file":
        builder.reject(0, "", *failure)
        return
    tail = text[text.rfind(b"\n") + 1 :]  # b"" when the text ends with a newline
    if fast:
        lines = LineBuffer(text, keep_tail=failure is None)
        clean = split_clean_lines(lines, builder.field_mapping)
        builder.add_records(clean.records)
        numbers = clean.other_lines
    else:
        lines = text.split(b"\n")
        lines.pop()
        if failure is None and tail:
            lines.append(tail)  # a last line without its newline
        numbers = range(1, len(lines) + 1)
    for number in numbers:
        builder.add_line(number, lines[number - 1])
    if failure is not None:
        # The stream broke off: complete lines were kept; what is left of the last one is
        # quarantined.
        builder.reject(len(lines) + 1, _as_text(tail), *failure)


def _decompress(fmt: str, data: bytes) -> tuple[bytes, tuple[str, str] | None]:
    """The decompressed bytes, and ``(reason, detail)`` when the stream is cut short or corrupt.

    On a broken stream the bytes decoded before the break are returned, so the complete lines
    before it are not lost.
    """
    if fmt == "jsonl":
        return data, None
    out = io.BytesIO()
    try:
        if fmt == "jsonl.gz":
            _gunzip_into(data, out)
        else:
            _unzstd_into(data, out)
    except EOFError as exc:
        return out.getvalue(), ("truncated_file", f"{fmt} stream is cut short: {exc}")
    except (OSError, zlib.error, zstandard.ZstdError) as exc:
        reason = "truncated_file" if out.tell() else "unreadable_file"
        return out.getvalue(), (reason, f"{fmt} stream is corrupt: {exc}")
    return out.getvalue(), None


def _gunzip_into(data: bytes, out: io.BytesIO) -> None:
    remaining = data
    while remaining:  # a .gz file may hold several members
        inflater = zlib.decompressobj(wbits=31)
        for start in range(0, len(remaining), _CHUNK):
            out.write(inflater.decompress(remaining[start : start + _CHUNK]))
            if inflater.eof:
                break
        if not inflater.eof:
            raise EOFError("gzip stream ended before its end-of-stream marker")
        remaining = (
            inflater.unused_data + remaining[start + _CHUNK :]
        )  # the next member may span later chunks


def _unzstd_into(data: bytes, out: io.BytesIO) -> None:
    remaining = data
    while remaining:  # a .zst file may hold several frames
        inflater = zstandard.ZstdDecompressor().decompressobj()
        out.write(inflater.decompress(remaining))
        if not inflater.eof:
            raise EOFError("zstd frame ended before its end")
        remaining = inflater.unused_data


# --- Parquet ------------------------------------------------------------------------------------


def _read_parquet(data: bytes, builder: "_FrameBuilder", *, fast: bool) -> None:
    try:
        frame = pl.read_parquet(io.BytesIO(data))
    except MemoryError:
        raise  # this machine's trouble, not the file's
    except Exception as exc:  # polars raises several types for a damaged file
        builder.reject(0, "", "unreadable_file", f"parquet: {exc}")
        return
    clean = split_clean_rows(frame, builder.field_mapping) if fast else None
    if clean is None:
        for number, row in enumerate(frame.iter_rows(named=True), start=1):
            builder.add_object(number, row, raw=None)
        return
    builder.add_records(clean.records)
    for number in clean.other_lines:
        builder.add_object(number, frame.row(number - 1, named=True), raw=None)


# --- Records ------------------------------------------------------------------------------------


class _FrameBuilder:
    """Collects accepted records column by column and rejected units row by row."""

    def __init__(self, field_mapping: Mapping[str, str], record_format: RecordFormat = SFT):
        self.field_mapping = dict(field_mapping)
        self.record_format = record_format
        self._schema = parsed_schema(record_format)
        self._columns: dict[str, list] = {name: [] for name in self._schema}
        self._rejected: dict[str, list] = {name: [] for name in QUARANTINE_SCHEMA}
        self._bulk: list[pl.DataFrame] = []
        self.lines_read = 0

    def add_records(self, records: pl.DataFrame) -> None:
        """Records already validated in bulk (PARSED_SCHEMA), one per line read."""
        self.lines_read += records.height
        self._bulk.append(records)

    def add_line(self, number: int, line: bytes) -> None:
        line = line.removesuffix(b"\r")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self.reject(number, _as_text(line), *_classify_unparseable(line, exc))
            return
        self.add_object(number, obj, raw=line)

    def add_object(self, number: int, obj: object, raw: bytes | None) -> None:
        try:
            values = validate_landing_object(obj, self.field_mapping, self.record_format)
        except Rejected as rejected:
            text = _as_text(raw) if raw is not None else _row_as_json(obj)
            self.reject(number, text, rejected.reason, rejected.detail)
            return
        self.lines_read += 1
        columns = self._columns
        columns["source_line"].append(number)
        for name, value in zip(list(self._schema)[1:], values, strict=True):
            columns[name].append(value)

    def reject(self, number: int, raw: str, reason: str, detail: str) -> None:
        self.lines_read += 1
        for name, value in zip(QUARANTINE_SCHEMA, (number, raw, reason, detail), strict=True):
            self._rejected[name].append(value)

    def result(self) -> FileReadResult:
        records = pl.DataFrame(self._columns, schema=self._schema)
        if self._bulk and records.is_empty():
            records = pl.concat(self._bulk)
        elif self._bulk:  # lines of both paths, each in line order: merged back into line order
            records = pl.concat(self._bulk).merge_sorted(records, key="source_line")
        return FileReadResult(
            records=with_content_hash(records.lazy(), self.record_format).collect(),
            quarantine=pl.DataFrame(self._rejected, schema=QUARANTINE_SCHEMA),
            lines_read=self.lines_read,
        )


def _classify_unparseable(line: bytes, exc: Exception) -> tuple[str, str]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as utf8_error:
        return (
            "invalid_utf8",
            f"bytes {utf8_error.start}-{utf8_error.end} are not UTF-8: {utf8_error.reason}",
        )
    if not text.strip():
        return "blank_line", "the line is empty"
    return "invalid_json", str(exc)


def _as_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _row_as_json(obj: object) -> str:
    return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def with_provenance(
    result: FileReadResult,
    *,
    source: str,
    source_file: str,
    file_ordinal: int,
    batch_id: str,
    ingested_at: datetime,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Stamp one file's records and quarantined lines with where and when they came in.

    ``record_id`` (32 characters) sorts in arrival order: the batch's registration second and the
    file's place in the batch (files sorted by path) in hex, then the line, zero-padded. It is
    stable across re-runs of a batch (the manifest fixes its files), unique across batches (batch
    keys never share a second), and it gives dedup's "smallest record_id" survivor its meaning: the
    first copy to arrive.
    """
    prefix = f"{batch_seconds(batch_id):010x}{file_ordinal:06x}"
    stamp = [
        pl.lit(source).alias("source"),
        pl.lit(source_file).alias("source_file"),
        pl.lit(batch_id).alias("batch_id"),
    ]
    records = result.records.with_columns(
        *stamp,
        record_id=pl.lit(prefix) + pl.col("source_line").cast(pl.String).str.zfill(16),
        ingested_at=pl.lit(ingested_at).cast(pl.Datetime("us", "UTC")),
    )
    return records, result.quarantine.with_columns(*stamp)


def batch_seconds(batch_id: str) -> int:
    """The registration time a batch key starts with, in seconds since the epoch."""
    stamp = datetime.strptime(batch_id.split("-", 1)[0], "%Y%m%dT%H%M%SZ")
    return int(stamp.replace(tzinfo=timezone.utc).timestamp())
