"""Parquet files written into a Delta table's folder by a worker, for another process to commit.

A worker (a Ray task, any process) calls ``write_share``: one Parquet file under the table's
partition folder, hive style as delta-rs lays it out, and the fields of the Delta ``add`` action
that will name it, statistics included. Nothing is visible to readers until a commit references
the file; the lake resource's ``commit_partition`` does that, once for all the workers' shares."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from urllib.parse import unquote

import polars as pl
import pyarrow as pa
import pyarrow.compute
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline_assets.lib import uris

LOG_FOLDER = "_delta_log"
# delta-rs keeps a string statistic to 64 bytes: a longer minimum is cut to a prefix (still a lower
# bound), a longer maximum to a prefix whose last character is raised by one (still an upper bound).
_STRING_STAT_BYTES = 64
_PARTITION_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def table_filesystem(table_uri: str, storage_options: dict[str, str] | None) -> pafs.FileSystem:
    """The table's folder as a pyarrow filesystem whose paths are relative to it: a local folder, or
    for ``s3://`` pyarrow's S3 client configured from the lake's deltalake storage options."""
    if not uris.is_s3(table_uri):
        return pafs.SubTreeFileSystem(str(Path(table_uri).resolve()), pafs.LocalFileSystem())
    bucket, key = uris.split_s3(table_uri)
    return pafs.SubTreeFileSystem(f"{bucket}/{key}", _s3(storage_options or {}))


def _s3(options: Mapping[str, str]) -> pafs.S3FileSystem:
    endpoint = options.get("AWS_ENDPOINT_URL")
    scheme, _, host = endpoint.partition("://") if endpoint else ("https", "", None)
    return pafs.S3FileSystem(
        access_key=options.get("AWS_ACCESS_KEY_ID"),
        secret_key=options.get("AWS_SECRET_ACCESS_KEY"),
        session_token=options.get("AWS_SESSION_TOKEN"),
        region=options.get("AWS_REGION", "us-east-1"),
        endpoint_override=host,
        scheme=scheme,
    )


def partition_folder(partitions: Mapping[str, str]) -> str:
    """``band=3/batch_id=b1``: the partition columns in the table's order, as delta-rs names the
    folders."""
    for column, value in partitions.items():
        if not set(value) <= _PARTITION_VALUE_CHARS:
            raise ValueError(f"{column} value {value!r} has characters outside [A-Za-z0-9._-]")
    return "/".join(f"{column}={value}" for column, value in partitions.items())


def write_share(
    table_uri: str,
    frame: pl.DataFrame,
    partitions: Mapping[str, str],
    file_name: str,
    storage_options: dict[str, str] | None = None,
    bounded_strings: Collection[str] | None = None,
) -> dict:
    """Write ``frame`` as one Parquet file ``<partition folder>/<file_name>`` of the table and
    return its ``add`` action's fields as a plain dict (it crosses a process boundary): the
    ``write_share_slices`` of one slice."""
    written = write_share_slices(
        table_uri, [frame], partitions, file_name, storage_options, bounded_strings
    )
    if written is None:
        raise ValueError(f"{file_name}: a share of no rows is no file")
    return written


def write_share_slices(
    table_uri: str,
    slices: Iterable[pl.DataFrame],
    partitions: Mapping[str, str],
    file_name: str,
    storage_options: dict[str, str] | None = None,
    bounded_strings: Collection[str] | None = None,
) -> dict | None:
    """Write the rows of ``slices`` (frames of the same columns) as one Parquet file
    ``<partition folder>/<file_name>`` of the table, a slice at a time, and return its ``add``
    action's fields as a plain dict (it crosses a process boundary); None when they hold no row.

    ``bounded_strings``: the only string columns whose min and max go into the statistics (None:
    every one, as delta-rs writes them). A bound is the value's first 64 bytes, so a text column's
    would carry a record's text to whoever commits the file.

    ``partitions``: the table's partition columns (in its ``partition_by`` order) and this file's
    values; the frame may hold those columns (each must hold only that value) and they are not
    written, as delta-rs does not write them. ``file_name`` must be new to the table (a run id and a
    task number): a name an earlier version references would be overwritten under it."""
    if "/" in file_name or not file_name.endswith(".parquet"):
        raise ValueError(f"a share's file name is a plain *.parquet name, not {file_name!r}")
    path = "/".join(filter(None, [partition_folder(partitions), file_name]))
    filesystem = table_filesystem(table_uri, storage_options)
    collected: list[pq.FileMetaData] = []
    writer = None
    try:
        for frame in slices:
            if not frame.height:
                continue
            data = _file_columns(frame, partitions).to_arrow()
            if writer is None:
                if not uris.is_s3(table_uri):
                    Path(table_uri, partition_folder(partitions)).mkdir(parents=True, exist_ok=True)
                writer = pq.ParquetWriter(
                    path,
                    data.schema,
                    filesystem=filesystem,
                    compression="snappy",
                    metadata_collector=collected,
                )
            writer.write_table(data)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        return None
    return {
        "path": path,
        "size": filesystem.get_file_info(path).size,
        "partition_values": dict(partitions),
        "modification_time": int(time.time() * 1000),
        "data_change": True,
        "stats": json.dumps(file_statistics(collected[0], writer.schema, bounded_strings)),
    }


def _file_columns(frame: pl.DataFrame, partitions: Mapping[str, str]) -> pl.DataFrame:
    """``frame`` as its file holds it: without the partition columns (each must hold only its
    value; delta-rs does not write them) and without categoricals."""
    for column, value in partitions.items():  # cast: a band is an integer
        if column in frame.columns and frame[column].cast(pl.String).unique().to_list() != [value]:
            raise ValueError(f"every row of this share must have {column} = {value!r}")
    return _without_categoricals(frame.drop([c for c in partitions if c in frame.columns]))


def partition_values(table, column: str) -> set[str]:
    """The values the partition column ``column`` has in the ``deltalake.DeltaTable`` ``table``,
    from its log: no file is read."""
    return {part[column] for part in table.partitions()}


@dataclass(frozen=True)
class PinnedFiles:
    """Data files of some partitions of a Delta table at one version, named by a process that read
    the table's log once: a task scans them without reading the log itself, which would cost it
    time in proportion to the table's files (tens of milliseconds at 20,000). The partition
    columns, which the files do not hold, are added to their rows, and the columns come in the
    table's order, as ``pl.scan_delta`` gives them."""

    files: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (uri, (column, value) pairs)
    columns: tuple[str, ...]
    partition_types: tuple[tuple[str, pl.DataType], ...]
    storage_options: dict[str, str] | None = None

    def scan(self) -> pl.LazyFrame:
        if not self.files:
            raise ValueError("no file to scan")
        types = dict(self.partition_types)
        return pl.concat(
            [
                pl.scan_parquet(uri, storage_options=self.storage_options).with_columns(
                    pl.lit(value).cast(types[column]).alias(column) for column, value in values
                )
                for uri, values in self.files
            ],
            how="vertical",
        ).select(self.columns)


def data_files(table) -> list[tuple[str, dict]]:
    """Each data file of a ``deltalake.DeltaTable``, its URI with its add action (flattened:
    partition values and statistics), in the order the log lists them. Refused for a table whose
    files cannot be read alone (deletion vectors), or whose URIs and add actions are out of step."""
    name = uris.redact(table.table_uri)
    if "deletionVectors" in (table.protocol().reader_features or []):
        raise ValueError(f"{name}: deletion vectors; its files cannot be read alone")
    actions = pl.DataFrame(table.get_add_actions(flatten=True)).to_dicts()
    file_uris = table.file_uris()
    if len(file_uris) != len(actions):
        raise ValueError(f"{name}: {len(file_uris)} file URIs but {len(actions)} add actions")
    for uri, action in zip(file_uris, actions):
        if not uri.endswith(action["path"]):
            raise ValueError(f"{name}: file URI {uri} and add action {action['path']} out of step")
    return list(zip(file_uris, actions))


class TableFiles:
    """A ``deltalake.DeltaTable``'s data files by partition, from its log (read once, here), to
    hand to tasks as ``PinnedFiles``."""

    def __init__(self, table, storage_options: dict[str, str] | None = None):
        self.partition_columns = table.metadata().partition_columns
        schema = pl.scan_delta(table).collect_schema()
        self.schema_columns = tuple(schema.names())
        self.partition_types = tuple((column, schema[column]) for column in self.partition_columns)
        self.storage_options = storage_options
        self.by_partition: dict[tuple[str, ...], list[str]] = {}
        for uri, action in data_files(table):
            values = tuple(str(action[f"partition.{column}"]) for column in self.partition_columns)
            self.by_partition.setdefault(values, []).append(uri)

    def of(self, partitions: Iterable[tuple[str, ...]]) -> PinnedFiles:
        """The files of ``partitions`` (each a value a partition column, in the table's order)."""
        return PinnedFiles(
            tuple(
                (uri, tuple(zip(self.partition_columns, values, strict=True)))
                for values in partitions
                for uri in self.by_partition.get(tuple(map(str, values)), [])
            ),
            self.schema_columns,
            self.partition_types,
            self.storage_options,
        )


def partition_slices(
    table, column: str, value: str, max_bytes: int, columns: list[str] | None = None
) -> Iterator[pl.DataFrame]:
    """The rows of the ``deltalake.DeltaTable`` ``table`` whose ``column`` is ``value``, at most
    ``max_bytes`` of them at a time (at least a row): never the partition whole, and as few rows at
    a time as its rows are wide. ``columns``: only these. pyarrow's readahead is off: it would
    decode batches and files ahead of the slice."""
    dataset = table.to_pyarrow_dataset(file_pruning_predicate=[(column, "=", value)])
    batches = dataset.to_batches(
        columns=columns,
        filter=pa.compute.field(column) == value,
        batch_size=_SLICE_READ_ROWS,
        batch_readahead=1,
        fragment_readahead=1,
    )
    for pieces in _by_bytes(batches, max_bytes):
        yield pl.from_arrow(pa.Table.from_batches(pieces))


_SLICE_READ_ROWS = 8_192  # rows decoded at a time while a slice is gathered


def _by_bytes(batches: Iterable[pa.RecordBatch], max_bytes: int) -> Iterator[list[pa.RecordBatch]]:
    """Consecutive pieces of ``batches``, at most ``max_bytes`` together (a row at least)."""
    held, size = [], 0
    for batch in batches:
        rows = max(1, batch.num_rows * max_bytes // max(batch.nbytes, 1))
        for start in range(0, batch.num_rows, rows):
            piece = batch.slice(start, rows)
            if held and size + piece.nbytes > max_bytes:
                yield held
                held, size = [], 0
            held.append(piece)
            size += piece.nbytes
    if held:
        yield held


def _without_categoricals(frame: pl.DataFrame) -> pl.DataFrame:
    """Top-level categoricals as text (the table stores them as strings)."""
    return frame.with_columns(
        pl.col(name).cast(pl.String)
        for name, dtype in frame.schema.items()
        if isinstance(dtype, (pl.Categorical, pl.Enum))
    )


def file_statistics(
    metadata: pq.FileMetaData, schema: pa.Schema, bounded_strings: Collection[str] | None = None
) -> dict:
    """Delta's ``stats`` of one Parquet file (numRecords, minValues, maxValues, nullCount) from its
    footer, as delta-rs writes them: struct fields nested, no statistics for lists, maps and
    binary; min and max of a string column only if it is in ``bounded_strings`` (None: all)."""
    leaves = _leaf_statistics(metadata)
    if bounded_strings is not None:
        leaves = {
            path: (None, None, nulls)
            if isinstance(low, str) and path not in bounded_strings
            else (low, high, nulls)
            for path, (low, high, nulls) in leaves.items()
        }
    stats = {"numRecords": metadata.num_rows, "minValues": {}, "maxValues": {}, "nullCount": {}}
    for field in schema:
        _add_field(stats, field, (field.name,), leaves)
    return stats


def _leaf_statistics(metadata: pq.FileMetaData) -> dict[str, tuple]:
    """Column path -> (min, max, null count) over every row group; min and max None when a row
    group has none."""
    found: dict[str, tuple] = {}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            column = row_group.column(index)
            statistics = column.statistics
            has_bounds = statistics is not None and statistics.has_min_max
            low, high = (statistics.min, statistics.max) if has_bounds else (None, None)
            nulls = statistics.null_count if statistics is not None else None
            if column.path_in_schema in found:
                old_low, old_high, old_nulls = found[column.path_in_schema]
                low = None if None in (low, old_low) else min(low, old_low)
                high = None if None in (high, old_high) else max(high, old_high)
                nulls = None if None in (nulls, old_nulls) else nulls + old_nulls
            found[column.path_in_schema] = (low, high, nulls)
    return found


def _add_field(stats: dict, field: pa.Field, path: tuple[str, ...], leaves: dict) -> None:
    kind = field.type
    if pa.types.is_struct(kind):
        for child in kind:
            _add_field(stats, child, (*path, child.name), leaves)
        return
    if _has_no_statistics(kind) or ".".join(path) not in leaves:
        return
    low, high, nulls = leaves[".".join(path)]
    if nulls is not None:
        _put(stats["nullCount"], path, nulls)
    low, high = _stat_value(kind, low, upper=False), _stat_value(kind, high, upper=True)
    if low is not None and high is not None:
        _put(stats["minValues"], path, low)
        _put(stats["maxValues"], path, high)


def _has_no_statistics(kind: pa.DataType) -> bool:
    return (
        pa.types.is_list(kind)
        or pa.types.is_large_list(kind)
        or pa.types.is_fixed_size_list(kind)
        or pa.types.is_list_view(kind)
        or pa.types.is_map(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_binary_view(kind)
        or pa.types.is_fixed_size_binary(kind)
    )


def _stat_value(kind: pa.DataType, value, *, upper: bool):
    """A Parquet statistic as Delta's JSON writes it, or None where there is none to give."""
    if value is None:
        return None
    if isinstance(value, str):
        return _string_bound(value, upper=upper)
    if isinstance(value, bool | int):
        return value
    if isinstance(value, float | Decimal):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, datetime):
        if pa.types.is_timestamp(kind) and kind.tz is not None:
            return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
        millis = value.microsecond // 1000
        return value.strftime("%Y-%m-%d %H:%M:%S") + (f".{millis:03d}" if millis else "")
    if isinstance(value, date):
        return value.isoformat()
    return None


def _string_bound(value: str, *, upper: bool) -> str | None:
    encoded = value.encode()
    if len(encoded) <= _STRING_STAT_BYTES:
        return value
    prefix = encoded[:_STRING_STAT_BYTES].decode(errors="ignore")
    if not upper:
        return prefix
    while prefix:
        last = ord(prefix[-1]) + 1
        if last <= 0x10FFFF and not 0xD800 <= last <= 0xDFFF:
            return prefix[:-1] + chr(last)
        prefix = prefix[:-1]
    return None


def _put(target: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        target = target.setdefault(name, {})
    target[path[-1]] = value


def referenced_paths(commits: Iterable[str], checkpoints: Iterable[pa.Table]) -> set[str]:
    """Every data file a version of the table reads or read: the ``add`` and ``remove`` paths of the
    log's JSON commits (each a text of one action a line) and of its checkpoint (whose removes are
    files older versions still read)."""
    found: set[str] = set()
    for text in commits:
        for line in text.splitlines():
            action = json.loads(line) if line.strip() else {}
            for kind in ("add", "remove"):
                if kind in action:
                    found.add(unquote(action[kind]["path"]))
    for checkpoint in checkpoints:
        for kind in ("add", "remove"):
            if kind in checkpoint.column_names:
                paths = checkpoint[kind].combine_chunks().field("path").to_pylist()
                found.update(unquote(path) for path in paths if path is not None)
    return found
