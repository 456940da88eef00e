"""Prepare on the workers (issue 37): each task reads its share of a batch's bronze files itself,
runs ``prepare_block`` on it block by block and writes what it made as Parquet under a staging
folder; the step gets back only paths, row counts and counters, and reads only the keys.

A batch's rows are numbered in the order the step's own read gives them today, so silver's tables
keep today's row order: ``lake.read`` is polars' ``scan_delta``, which scans the pinned version's
``file_uris()`` in the order the Delta log lists them (not the order they were appended in). Each
file's first position is the sum of the row counts before it, from the files' statistics, with
no data read. (Which copy wins inside a batch does not depend on it: the dedup stages and the pair
cap order a batch's records by record id.)

A block's staged records and keys are two Parquet files named by the block's first position in
the batch, so a retried task overwrites its own files rather than adding to them. One pair a block
rather than a share: a share's blocks may not share a schema (a column all null in one block), and
``join_blocks`` concatenates them as they are, so a task holds one block at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import polars as pl
import pyarrow.fs as pafs
from deltalake import DeltaTable

from pipeline_assets.lib import uris
from pipeline_assets.lib.delta_files import data_files, table_filesystem
from pipeline_assets.lib.formats import FORMATS, RecordFormat, text_chars
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import (
    SIGNATURE_COLUMNS,
    STAGED_BAND_PREFIX,
    staged_band_key,
)
from pipeline_assets.lib.silver.near_edges import SIGNED_SCHEMA
from pipeline_assets.lib.silver.prepare import (
    KeyTally,
    Prepared,
    Started,
    finish_block,
    join_blocks,
    refuse_text,
    start_block,
    summed_counters,
)

BATCH_COLUMN = "batch_id"  # bronze's partition column
STAGED_BAND_COLUMNS = f"^{STAGED_BAND_PREFIX}[0-9]+$"  # every band's column, as a pattern
# as polars' scan_delta reads a table's files, so a share's rows have the types lake.read gives
DELTA_CASTS = pl.ScanCastOptions(
    integer_cast="upcast",
    float_cast=["upcast", "downcast"],
    datetime_cast=["nanosecond-downcast", "millisecond-upcast", "convert-timezone"],
    missing_struct_fields="insert",
    extra_struct_fields="ignore",
    categorical_to_string="allow",
)


@dataclass(frozen=True)
class BronzeFile:
    """One Parquet file of a batch's bronze partition at a pinned version, or a piece of one
    (``cut_files``)."""

    uri: str
    rows: int
    first_position: int  # its first row's position in the batch
    batch_id: str  # the partition's value (the file itself has no such column)
    skip: int = 0  # a piece: the file's rows before it


@dataclass(frozen=True)
class StagedBlock:
    records: str  # Parquet: the block's ``Prepared.staged``
    keys: str  # Parquet: the block's ``Prepared.keys``
    rows: int
    first_position: int
    counters: dict[str, dict]  # the block's stages before dedup, as the stage runner counted them
    record_counters: dict[str, dict] = field(default_factory=dict)  # as Prepared.record_counters
    input_chars: int = 0  # the block's bronze text, as ``text_chars`` counts it
    verdicts: dict[str, int] = field(default_factory=dict)  # as KeyTally.verdicts, of its keys


@dataclass(frozen=True)
class StagedShare:
    """What one prepare task hands back: plain values, no frames."""

    format_name: str
    blocks: tuple[StagedBlock, ...]
    layout: dict[str, tuple[str, ...]]  # as ``Prepared.layout``
    record_stages: tuple[str, ...]  # as ``Prepared.record_stages``

    @property
    def rows(self) -> int:
        return sum(block.rows for block in self.blocks)


def bronze_files(
    table_uri: str, version: int, batch_id: str, storage_options: dict | None = None
) -> list[BronzeFile]:
    """The batch's files of the bronze table at ``version``, in the order ``lake.read`` reads
    them, with their row counts and first positions (from the Delta log: no data read)."""
    table = DeltaTable(table_uri, version=version, storage_options=storage_options)
    if BATCH_COLUMN not in table.metadata().partition_columns:
        raise ValueError(f"{uris.redact(table_uri)} is not partitioned by {BATCH_COLUMN}")
    partition = f"partition.{BATCH_COLUMN}"
    files, position = [], 0
    for uri, action in data_files(table):
        if action[partition] != batch_id:
            continue
        rows = action["num_records"]
        if rows is None:  # written without statistics: the file's footer says
            rows = _footer_rows(uri, storage_options)
        files.append(BronzeFile(uri, rows, position, batch_id))
        position += rows
    return files


def bronze_schema(table_uri: str, version: int, storage_options: dict | None = None) -> pl.Schema:
    """The columns and types ``lake.read`` gives the table at ``version``."""
    table = DeltaTable(table_uri, version=version, storage_options=storage_options)
    return pl.scan_delta(table).collect_schema()


def _footer_rows(uri: str, storage_options: dict | None) -> int:
    scan = pl.scan_parquet(uri, storage_options=storage_options)
    return scan.select(pl.len()).collect().item()


def cut_files(files: Sequence[BronzeFile], rows_per_piece: int) -> list[BronzeFile]:
    """``files`` cut into pieces of at most ``rows_per_piece`` rows, in order: a batch written as
    one large file is still prepared by several tasks."""
    pieces = []
    for file in files:
        for skip in range(0, file.rows, rows_per_piece):
            rows = min(rows_per_piece, file.rows - skip)
            pieces.append(
                replace(
                    file,
                    rows=rows,
                    first_position=file.first_position + skip,
                    skip=file.skip + skip,
                )
            )
    return pieces


def group_files(files: Sequence[BronzeFile], rows_per_share: int) -> list[list[BronzeFile]]:
    """Consecutive files in shares of at least ``rows_per_share`` rows (the last may hold fewer);
    at least one share, empty when there are no files."""
    shares: list[list[BronzeFile]] = [[]]
    for file in files:
        if sum(f.rows for f in shares[-1]) >= rows_per_share:
            shares.append([])
        shares[-1].append(file)
    return shares


def prepare_files(
    files: Sequence[BronzeFile],
    config: SilverConfig,
    eval_index: EvalNgramIndex,
    fmt: RecordFormat,
    staging_dir: str,
    rows_per_block: int,
    schema: pl.Schema,
    storage_options: dict | None = None,
) -> StagedShare:
    """What one prepare task does: read ``files`` (consecutive files of one batch) a block of
    ``rows_per_block`` rows at a time, with the columns and types of ``schema`` (a column a file
    lacks: null), ``prepare_block`` each block at its position, and write its staged records and
    keys under ``staging_dir``. No files: one empty block at position 0."""
    fmt = FORMATS.get(fmt.name, fmt)  # pickling makes a copy; the stages compare formats with `is`
    blocks = [
        finish_file_block(started, staging_dir, storage_options)
        for started in start_file_blocks(
            files, config, eval_index, fmt, rows_per_block, schema, storage_options
        )
    ]
    return staged_share(blocks)


@dataclass(frozen=True)
class StartedBlock:
    """A block read from bronze files and started (``start_block``), where it stands in the
    batch and its bronze text's size."""

    started: Started
    first_position: int
    input_chars: int


@dataclass(frozen=True)
class FinishedBlock:
    """What a finished block hands back: its staged files and counters, and its layout."""

    staged: StagedBlock
    format_name: str
    layout: dict[str, tuple[str, ...]]
    record_stages: tuple[str, ...]


def start_file_blocks(
    files: Sequence[BronzeFile],
    config: SilverConfig,
    eval_index: EvalNgramIndex,
    fmt: RecordFormat,
    rows_per_block: int,
    schema: pl.Schema,
    storage_options: dict | None = None,
    before_models: bool = False,
) -> list[StartedBlock]:
    """``files`` read a block of ``rows_per_block`` rows at a time and each block started: every
    stage after dedup, or with ``before_models`` those before the first model stage (the rest run
    on an actor pool before ``finish_file_block``)."""
    fmt = FORMATS.get(fmt.name, fmt)
    return [
        StartedBlock(
            start_block(block, config, eval_index, fmt, position, before_models),
            position,
            text_chars(block),
        )
        for block, position in _read_blocks(files, rows_per_block, schema, storage_options)
    ]


def finish_file_block(
    started: StartedBlock, staging_dir: str, storage_options: dict | None = None
) -> FinishedBlock:
    """A started block, its model stages run, finished and written under ``staging_dir``."""
    prepared = finish_block(started.started)
    staged = _write_block(
        prepared, staging_dir, started.first_position, started.input_chars, storage_options
    )
    return FinishedBlock(staged, prepared.fmt.name, prepared.layout, prepared.record_stages)


def staged_share(blocks: Sequence[FinishedBlock]) -> StagedShare:
    """One share of finished blocks (one format's, consecutive) as a ``StagedShare``."""
    first = blocks[0]
    if any((b.format_name, b.layout) != (first.format_name, first.layout) for b in blocks):
        raise ValueError("blocks of one share were prepared with different formats or stages")
    return StagedShare(
        first.format_name, tuple(b.staged for b in blocks), first.layout, first.record_stages
    )


def _read_blocks(
    files: Sequence[BronzeFile], rows_per_block: int, schema: pl.Schema, storage_options
) -> Iterator[tuple[pl.DataFrame, int]]:
    """Each block of ``files`` and its first position in the batch (no files: one empty block)."""
    _check_consecutive(files)
    first = files[0].first_position if files else 0
    rows = sum(file.rows for file in files)
    scan = _scan(files, schema, storage_options)
    for start in range(0, max(rows, 1), rows_per_block):
        block = scan.slice(start, rows_per_block).collect()
        expected = min(rows_per_block, rows - start)
        if block.height != expected:
            raise ValueError(
                f"read {block.height} rows at {first + start}, the log says {expected}"
            )
        yield block, first + start


def _check_consecutive(files: Sequence[BronzeFile]) -> None:
    for before, after in zip(files, files[1:]):
        if after.first_position != before.first_position + before.rows:
            raise ValueError(f"{after.uri} does not follow {before.uri}: a share is consecutive")
        if after.batch_id != before.batch_id:
            raise ValueError("a share's files belong to one batch")


def _scan(
    files: Sequence[BronzeFile], schema: pl.Schema, storage_options: dict | None
) -> pl.LazyFrame:
    if not files:
        return pl.LazyFrame(schema=schema)
    in_files = pl.Schema({name: dtype for name, dtype in schema.items() if name != BATCH_COLUMN})
    scans = [
        pl.scan_parquet(
            file.uri,
            schema=in_files,
            missing_columns="insert",
            extra_columns="ignore",
            cast_options=DELTA_CASTS,
            storage_options=storage_options,
        ).slice(file.skip, file.rows)
        for file in files
    ]
    return (
        pl.concat(scans)
        .with_columns(pl.lit(files[0].batch_id, schema[BATCH_COLUMN]).alias(BATCH_COLUMN))
        .select(schema.names())
    )


def _write_block(
    prepared: Prepared,
    staging_dir: str,
    first_position: int,
    input_chars: int,
    storage_options: dict | None,
) -> StagedBlock:
    if not uris.is_s3(staging_dir):
        Path(staging_dir).mkdir(parents=True, exist_ok=True)
    paths = {
        kind: uris.join(staging_dir, f"{prepared.fmt.name}-{kind}-{first_position:012d}.parquet")
        for kind in ("records", "keys")
    }
    prepared.staged.write_parquet(paths["records"], storage_options=storage_options)
    prepared.keys.write_parquet(paths["keys"], storage_options=storage_options)
    return StagedBlock(
        paths["records"],
        paths["keys"],
        prepared.staged.height,
        first_position,
        prepared.counters,
        prepared.record_counters,
        input_chars,
        KeyTally.of(prepared.keys).verdicts,
    )


def read_keys(
    shares: Sequence[StagedShare],
    storage_options: dict | None = None,
    signatures: bool = True,
    record_ids: pl.Series | None = None,
) -> pl.DataFrame:
    """The shares' keys, in position order: all the decision reads (without ``signatures``, all
    but the signatures: ``stage_signatures`` stages those near dedup needs), the LSH band keys left
    to the band searches (``read_band``); with ``record_ids``, those records' only. Raises on a
    text column."""
    blocks = _blocks(shares)
    left_out = [STAGED_BAND_COLUMNS, *([] if signatures else SIGNATURE_COLUMNS)]
    wanted = pl.lit(True) if record_ids is None else pl.col("record_id").is_in(record_ids.implode())
    keys = pl.concat(
        [
            pl.scan_parquet(block.keys, storage_options=storage_options)
            .select(pl.exclude(left_out))
            .filter(wanted)
            .collect()
            for block in blocks
        ],
        how="diagonal_relaxed",
    )
    refuse_text(keys)
    return keys


def stage_signatures(
    shares: Sequence[StagedShare],
    record_ids: pl.Series,
    path: str,
    storage_options: dict | None = None,
) -> str | None:
    """The signatures of ``record_ids`` (SIGNED_SCHEMA) from the shares' staged keys, the rest of
    each file filtered out as it is read, written to ``path`` for near dedup's pair tasks; None
    when the shares hold none of them."""
    wanted = pl.col("record_id").is_in(record_ids.implode())
    signed = pl.concat(
        [
            pl.scan_parquet(block.keys, storage_options=storage_options)
            .filter(wanted)
            .select(
                "record_id",
                "batch_id",
                signature=SIGNATURE_COLUMNS[0],
                response_signature=SIGNATURE_COLUMNS[1],
            )
            .collect()
            for block in _blocks(shares)
        ]
    )
    if signed.is_empty():
        return None
    return write_signed(signed, path, storage_options)


def write_signed(signed: pl.DataFrame, path: str, storage_options: dict | None = None) -> str:
    """Signed nodes (SIGNED_SCHEMA) written where near dedup's pair tasks read them: ``path``.
    Entries of an index written before responses were signed have no response signature."""
    if not uris.is_s3(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    unsigned = [name for name in SIGNED_SCHEMA.names() if name not in signed.columns]
    signed.with_columns(pl.lit(None, pl.Binary).alias(name) for name in unsigned).select(
        SIGNED_SCHEMA.names()
    ).cast(dict(SIGNED_SCHEMA)).write_parquet(path, storage_options=storage_options)
    return path


def signed_files(folder: str, storage_options: dict | None = None) -> list[str]:
    """The files ``write_signed`` wrote into ``folder``, by name (none: no such folder)."""
    filesystem = table_filesystem(folder, storage_options)
    found = filesystem.get_file_info(pafs.FileSelector("", allow_not_found=True))
    return sorted(uris.join(folder, info.path) for info in found if info.is_file)


def read_signed(paths: Sequence[str], storage_options: dict | None = None) -> pl.DataFrame:
    """The signed nodes of the files ``write_signed`` wrote (SIGNED_SCHEMA)."""
    return pl.concat(
        [
            pl.DataFrame(schema=SIGNED_SCHEMA),
            *(pl.read_parquet(path, storage_options=storage_options) for path in paths),
        ]
    )


def read_band(
    shares: Sequence[StagedShare],
    band: int,
    reached: pl.Expr,
    storage_options: dict | None = None,
) -> pl.DataFrame:
    """One band's keys (record_id, exact_hash, band_key: ``staged_band_key``) of the shares'
    records that ``reached`` (an expression over the keys) selects, in position order."""
    return pl.concat(
        [
            pl.scan_parquet(block.keys, storage_options=storage_options)
            .filter(reached)
            .select("record_id", "exact_hash", band_key=staged_band_key(band))
            .collect()
            for block in _blocks(shares)
        ]
    )


def read_prepared(shares: Sequence[StagedShare], storage_options: dict | None = None) -> Prepared:
    """The shares' staged records and keys as one ``Prepared`` (what ``split`` cuts), in position
    order, the blocks' counters summed."""
    first = shares[0]
    fmt = FORMATS[first.format_name]
    return join_blocks(
        [
            Prepared(
                fmt,
                pl.read_parquet(block.records, storage_options=storage_options),
                pl.read_parquet(block.keys, storage_options=storage_options),
                first.layout,
                first.record_stages,
                block.counters,
                block.record_counters,
            )
            for block in _blocks(shares)
        ]
    )


def staged_counters(shares: Sequence[StagedShare]) -> dict[str, dict]:
    """The counters of the stages before dedup over the shares' blocks, as ``read_prepared`` sums
    them, with no record read: with the decision, ``split.stage_counters`` gives the batch's."""
    return summed_counters([block.counters for block in _blocks(shares)])


def staged_record_counters(shares: Sequence[StagedShare]) -> dict[str, dict]:
    """The counters of the stages after dedup over the shares' blocks (``Prepared.record_counters``:
    their seconds and model loads, on every record prepare gave them)."""
    return summed_counters([block.record_counters for block in _blocks(shares)])


def staged_tally(shares: Sequence[StagedShare]) -> KeyTally:
    """The shares' keys counted by their blocks, none read."""
    blocks = _blocks(shares)
    return KeyTally.summed(KeyTally(b.rows, b.verdicts) for b in blocks)


def share_positions(share: StagedShare) -> tuple[int, int]:
    """The positions ``share``'s records take in the batch: from its first up to past its last."""
    start = min((block.first_position for block in share.blocks), default=0)
    return start, start + share.rows


def _blocks(shares: Sequence[StagedShare]) -> list[StagedBlock]:
    """Every share's blocks in position order; shares of one format and stages, consecutive."""
    first = shares[0]
    for share in shares[1:]:
        if (share.format_name, share.layout) != (first.format_name, first.layout):
            raise ValueError("shares of one batch were prepared with different formats or stages")
    blocks = sorted((b for s in shares for b in s.blocks), key=lambda b: b.first_position)
    position = blocks[0].first_position if blocks else 0
    for block in blocks:
        if block.first_position != position:
            raise ValueError(f"staged blocks leave a gap or overlap at position {position}")
        position += block.rows
    return blocks
