"""The lake: every Delta table, read and written through one resource."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from botocore.exceptions import ClientError
from dagster import ConfigurableResource
from deltalake import DeltaTable, WriterProperties, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import TableNotFoundError
from deltalake.transaction import (
    AddAction,
    CommitProperties,
    Transaction,
    create_table_with_add_actions,
)
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.delta_files import (
    LOG_FOLDER,
    partition_folder,
    referenced_paths,
    table_filesystem,
)
from pipeline_assets.lib.locks import FileLock, S3Lease
from pipeline_assets.lib.ops.retention import STAGING_DEPTH, Removed, abandoned_staging


@dataclass(frozen=True)
class DeltaCommit:
    """What a write produced: the table version, where it lives, and how long it took."""

    uri: str
    version: int
    rows: int
    bytes_in_memory: int
    wall_seconds: float
    cpu_seconds: float


STAGING_FOLDER = "_staging"  # under the lake; no Delta table is named so
_PARTITION_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class LakeResource(ConfigurableResource):
    """Delta tables at ``<uri>/<layer>/<name>``, on a local path or ``s3://``."""

    uri: str = Field(description="root of the lake: a local path or s3://bucket/prefix")
    lock_timeout_seconds: float = Field(
        default=300.0, description="how long a writer waits for a table's lock"
    )
    lease_seconds: float = Field(
        default=60.0,
        description="s3:// lake: a lock whose holder died is taken over this long after its last "
        "renewal",
    )

    def table_uri(self, layer: str, name: str) -> str:
        return uris.join(self.uri, layer, name)

    def storage_options(self) -> dict[str, str] | None:
        return uris.delta_storage_options(self.uri)

    def staging_uri(self, *parts: str) -> str:
        """``<lake>/_staging/<stage>/<batch>/<run>``: files workers write for a step to commit."""
        return uris.join(self.uri, STAGING_FOLDER, *parts)

    def remove_abandoned_staging(self, *, keep_after: float) -> tuple[list[str], Removed]:
        """Delete the staging run folders whose newest file is older than ``keep_after`` (epoch
        seconds): runs that died before their commit and whose batch was never run again (a
        committed run removes its own). Returns the folders, relative to the staging root, and
        what was deleted."""
        filesystem = table_filesystem(self.staging_uri(), self.storage_options())
        if filesystem.get_file_info("").type == pafs.FileType.NotFound:
            return [], Removed()
        files = [
            info
            for info in filesystem.get_file_info(pafs.FileSelector("", recursive=True))
            if info.type == pafs.FileType.File
        ]
        folders = abandoned_staging(((f.path, f.mtime.timestamp()) for f in files), keep_after)
        doomed = [f for f in files if "/".join(f.path.split("/")[:STAGING_DEPTH]) in folders]
        removed = self._delete_files([self.staging_uri(f.path) for f in doomed])
        for folder in folders:
            if not uris.is_s3(self.uri):
                shutil.rmtree(self.staging_uri(folder), ignore_errors=True)
        return folders, removed

    def lock(self, layer: str, name: str) -> FileLock | S3Lease:
        """One process at a time in a read-modify-write of a table (Delta appends never conflict):
        ``<lake>/<layer>/_<name>.lock``, released when its holder exits or dies."""
        lock_uri = uris.join(self.uri, layer, f"_{name}.lock")
        if not uris.is_s3(lock_uri):
            return FileLock(lock_uri, timeout=self.lock_timeout_seconds)
        return S3Lease(
            self._s3_client(),
            lock_uri,
            timeout=self.lock_timeout_seconds,
            ttl_seconds=self.lease_seconds,
        )

    def table(self, layer: str, name: str, version: int | None = None) -> DeltaTable | None:
        try:
            return DeltaTable(
                self.table_uri(layer, name), version=version, storage_options=self.storage_options()
            )
        except TableNotFoundError:
            return None

    def version(self, layer: str, name: str) -> int | None:
        table = self.table(layer, name)
        return None if table is None else table.version()

    def scan(self, layer: str, name: str, version: int | None = None) -> pl.LazyFrame | None:
        """A lazy scan (partition pruning applies to filters), or None while the table does not
        exist."""
        table = self.table(layer, name, version)
        return None if table is None else pl.scan_delta(table)

    def read(
        self, layer: str, name: str, *, version: int | None = None, where: pl.Expr | None = None
    ) -> pl.DataFrame | None:
        scan = self.scan(layer, name, version)
        if scan is None:
            return None
        return (scan if where is None else scan.filter(where)).collect()

    def replace_partition(
        self,
        layer: str,
        name: str,
        frame: pl.DataFrame,
        *,
        column: str,
        value: str,
        add_columns: bool = False,
        rows_per_group: int | None = None,
        partition_by: tuple[str, ...] = (),
    ) -> DeltaCommit:
        """Atomically replace every row whose ``column`` equals ``value`` (Delta's replaceWhere).

        ``add_columns``: columns the table lacks are added (null in its older rows), for a table
        written before its contract gained a nullable column. ``rows_per_group``: as in
        ``overwrite``. ``partition_by``: the table's partition columns, when more than
        ``column``."""
        _check_partition(layer, name, frame, column, value)
        return self._write(
            layer,
            name,
            frame,
            mode="overwrite",
            partition_by=list(partition_by or [column]),
            predicate=f"{column} = '{value}'",
            **({"schema_mode": "merge"} if add_columns else {}),
            **_row_groups(rows_per_group),
        )

    def replace_partition_streaming(
        self,
        layer: str,
        name: str,
        frames: Iterable[pl.DataFrame],
        schema: pl.Schema,
        *,
        column: str,
        value: str,
        rows_per_group: int,
    ) -> DeltaCommit:
        """``replace_partition`` of the rows of ``frames`` (each of ``schema``), written as they
        come. delta-rs encodes a row group once it holds ``rows_per_group`` rows (by default only at
        the end, a million rows): a few frames' worth lets the encoding of one overlap the making of
        the next. Nothing is committed unless every frame was made; an exception raised while making
        one is raised here."""
        checked = (_check_partition(layer, name, frame, column, value) for frame in frames)
        return self._write_frames(
            layer,
            name,
            checked,
            schema,
            mode="overwrite",
            partition_by=[column],
            predicate=f"{column} = '{value}'",
            **_row_groups(rows_per_group),
        )

    def append(self, layer: str, name: str, frame: pl.DataFrame) -> DeltaCommit:
        return self._write(layer, name, frame, mode="append")

    def overwrite(
        self,
        layer: str,
        name: str,
        frame: pl.DataFrame,
        rows_per_group: int | None = None,
        add_columns: bool = False,
    ) -> DeltaCommit:
        """A new version holding only ``frame``; earlier versions stay readable by time travel.
        ``rows_per_group``: the Parquet row-group size, for tables read a range of rows at a
        time. ``add_columns``: columns the table lacks are added, for a table written before its
        contract gained a nullable column."""
        return self._write(
            layer,
            name,
            frame,
            mode="overwrite",
            **({"schema_mode": "merge"} if add_columns else {}),
            **_row_groups(rows_per_group),
        )

    def commit_partition(
        self,
        layer: str,
        name: str,
        shares: Sequence[Mapping],
        schema: pl.Schema,
        *,
        column: str,
        value: str,
        app_id: str,
        version: int,
        partition_by: tuple[str, ...] = (),
        add_columns: bool = False,
    ) -> DeltaCommit:
        """One Delta commit replacing the partition ``column = value`` with exactly the files of
        ``shares`` (what ``lib.delta_files.write_share`` returned in the workers), carrying the
        application transaction ``(app_id, version)``.

        A retried commit happens once: when the table's ``transaction_version(app_id)`` is already
        ``version`` or more, nothing is committed and the version that carried it is returned. The
        first commit creates the table. ``schema``: the table's columns, partition columns
        included. ``add_columns`` and ``partition_by`` as in ``replace_partition``. ``rows`` is
        the shares' records; ``bytes_in_memory`` their files' bytes (their frames were never in
        this process)."""
        started = (time.perf_counter(), time.process_time())
        table_uri = self.table_uri(layer, name)
        rows = sum(json.loads(share["stats"])["numRecords"] for share in shares)
        size = sum(share["size"] for share in shares)
        table = self.table(layer, name)
        carried = None if table is None else table.transaction_version(app_id)
        if carried is not None and carried >= version:
            committed = _version_carrying(table, app_id, version)
            return DeltaCommit(table_uri, committed, rows, size, *_elapsed(started))
        columns = tuple(partition_by or (column,))
        for share in shares:
            if share["partition_values"].get(column) != value:
                raise ValueError(f"a share outside {column} = {value!r}: {share['path']}")
        actions = [AddAction(**{field: share[field] for field in _ADD_FIELDS}) for share in shares]
        commit_properties = CommitProperties(
            custom_metadata={_APP_TRANSACTION: f"{app_id}@{version}"},
            app_transactions=[Transaction(app_id, version)],
        )
        if table is None:
            create_table_with_add_actions(
                table_uri,
                _delta_schema(schema),
                actions,
                partition_by=list(columns),
                storage_options=self.storage_options(),
                commit_properties=commit_properties,
            )
        else:
            table.create_write_transaction(
                actions,
                mode="overwrite",
                schema=_commit_schema(table, schema, add_columns, f"{layer}/{name}"),
                partition_by=list(columns),
                partition_filters=[(column, "=", value)],
                commit_properties=commit_properties,
            )
        return self._committed(table_uri, rows, size, started)

    def remove_uncommitted(
        self,
        layer: str,
        name: str,
        column: str | None = None,
        value: str | None = None,
        *,
        keep_after: float,
    ) -> Removed:
        """Delete the Parquet files under the partition folders of ``column = value`` (every
        partition when ``column`` is None) that no version of the table references: files workers
        wrote for a commit that never came (the step died between ``write_share`` and
        ``commit_partition``). Files modified at or after ``keep_after`` (epoch seconds) stay: a
        run under way may be about to commit them. The retention job calls it on every table
        (``defs/ops/retention.py``), as Delta's vacuum leaves such files."""
        table = self.table(layer, name)
        if table is None:
            return Removed()
        table_uri = self.table_uri(layer, name)
        filesystem = table_filesystem(table_uri, self.storage_options())
        referenced = self._referenced_paths(filesystem)
        segment = None if column is None else partition_folder({column: value or ""})
        doomed = [
            uris.join(table_uri, info.path)
            for info in filesystem.get_file_info(pafs.FileSelector("", recursive=True))
            if info.type == pafs.FileType.File
            and info.path.endswith(".parquet")
            and not info.path.startswith((LOG_FOLDER, "_"))
            and (segment is None or segment in info.path.split("/"))
            and info.path not in referenced
            and info.mtime.timestamp() < keep_after
        ]
        return self._delete_files(doomed)

    def _referenced_paths(self, filesystem: pafs.FileSystem) -> set[str]:
        """Every file a version of the table still in its log reads or read."""
        log = filesystem.get_file_info(pafs.FileSelector(LOG_FOLDER))
        commits = [info.path for info in log if info.path.endswith(".json")]
        checkpoints = [info.path for info in log if ".checkpoint" in info.path.rsplit("/", 1)[-1]]
        return referenced_paths(
            (filesystem.open_input_stream(path).read().decode() for path in commits),
            (pq.read_table(path, filesystem=filesystem) for path in checkpoints),
        )

    def tables(self) -> list[tuple[str, str]]:
        """Every Delta table of the lake, as (layer, name)."""
        if not uris.is_s3(self.uri):
            return sorted(
                (log.parent.parent.name, log.parent.name)
                for log in Path(self.uri).glob("*/*/_delta_log")
            )
        bucket, prefix = uris.split_s3(self.uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        pages = (
            self._s3_client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=prefix)
        )
        found = set()
        for page in pages:
            for item in page.get("Contents", []):
                parts = item["Key"][len(prefix) :].split("/")
                if len(parts) > 3 and parts[2] == "_delta_log":
                    found.add((parts[0], parts[1]))
        return sorted(found)

    def vacuum(
        self, layer: str, name: str, retention_hours: float, keep_versions: list[int]
    ) -> Removed:
        """Delete the files no version newer than ``retention_hours`` and none of ``keep_versions``
        reads. Delta's vacuum picks them; they are deleted here, so that the table gains no version
        (a ``gold-v<N>`` snapshot stays the table's newest version until the next one is cut)."""
        table = self.table(layer, name)
        if table is None:
            return Removed()
        doomed = table.vacuum(
            retention_hours=int(retention_hours),
            dry_run=True,
            enforce_retention_duration=False,
            keep_versions=keep_versions,
        )
        table_uri = self.table_uri(layer, name)
        paths = [
            path if path.startswith(("/", uris.S3_PREFIX)) else uris.join(table_uri, path)
            for path in doomed
        ]
        return self._delete_files(paths)

    def _delete_files(self, paths: list[str]) -> Removed:
        """Delete these files; a file already gone counts for nothing."""
        removed = Removed()
        for path in paths:
            if not uris.is_s3(path):
                local = Path(path)
                if local.is_file():
                    removed += Removed(1, local.stat().st_size)
                    local.unlink()
                continue
            bucket, key = uris.split_s3(path)
            client = self._s3_client()
            try:
                size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
            except ClientError:
                continue  # already gone
            client.delete_object(Bucket=bucket, Key=key)
            removed += Removed(1, size)
        return removed

    def _s3_client(self):
        import boto3  # only S3 lakes need it

        return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)

    def _write(self, layer: str, name: str, frame: pl.DataFrame, **options) -> DeltaCommit:
        table_uri = self.table_uri(layer, name)
        started = (time.perf_counter(), time.process_time())
        write_deltalake(
            table_uri,
            frame.to_arrow(compat_level=_arrow_layout(frame.schema)),
            storage_options=self.storage_options(),
            **options,
        )
        return self._committed(table_uri, frame.height, frame.estimated_size(), started)

    def _write_frames(
        self, layer: str, name: str, frames: Iterable[pl.DataFrame], schema: pl.Schema, **options
    ) -> DeltaCommit:
        table_uri = self.table_uri(layer, name)
        started = (time.perf_counter(), time.process_time())
        compat = _arrow_layout(schema)
        arrow_schema = schema.to_frame().to_arrow(compat_level=compat).schema
        written = {"rows": 0, "bytes": 0}
        failed: list[BaseException] = []

        def batches():
            try:
                for frame in frames:
                    written["rows"] += frame.height
                    written["bytes"] += frame.estimated_size()
                    yield from frame.to_arrow(compat_level=compat).cast(arrow_schema).to_batches()
            except BaseException as exc:  # delta-rs reports it as its own error, without the type
                failed.append(exc)
                raise

        existed = self.table(layer, name) is not None
        try:
            write_deltalake(
                table_uri,
                pa.RecordBatchReader.from_batches(arrow_schema, batches()),
                storage_options=self.storage_options(),
                **options,
            )
        except Exception:
            if not existed:
                _remove_logless_folder(table_uri)
            if failed:
                raise failed[0] from None
            raise
        return self._committed(table_uri, written["rows"], written["bytes"], started)

    def _committed(
        self, table_uri: str, rows: int, bytes_in_memory: int, started: tuple[float, float]
    ) -> DeltaCommit:
        """The write just committed: the table's new version, and the write's wall and CPU seconds
        since ``started``."""
        version = DeltaTable(table_uri, storage_options=self.storage_options()).version()
        return DeltaCommit(table_uri, version, rows, bytes_in_memory, *_elapsed(started))


_ADD_FIELDS = ("path", "size", "partition_values", "modification_time", "data_change", "stats")
# the commit-info key naming the application transaction a commit carried
_APP_TRANSACTION = "pipeline.app_transaction"


def _elapsed(started: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = started
    return time.perf_counter() - wall, time.process_time() - cpu


def _version_carrying(table: DeltaTable, app_id: str, version: int) -> int:
    """The table version whose commit carried ``(app_id, version)``, or the table's version when
    that commit has left the log's history."""
    wanted = f"{app_id}@{version}"
    for commit in table.history():
        if commit.get(_APP_TRANSACTION) == wanted:
            return commit["version"]
    return table.version()


def _delta_schema(schema: pl.Schema) -> DeltaSchema:
    arrow = schema.to_frame().to_arrow(compat_level=pl.CompatLevel.oldest()).schema
    text = [
        pa.field(f.name, pa.large_string()) if pa.types.is_dictionary(f.type) else f for f in arrow
    ]
    return DeltaSchema.from_arrow(pa.schema(text))


def _commit_schema(
    table: DeltaTable, schema: pl.Schema, add_columns: bool, table_name: str
) -> DeltaSchema:
    """The schema a commit of files of ``schema`` gives the table: the table's own, with the
    columns it lacks added after its own when ``add_columns``. Anything else would change the
    table's schema under its readers: refused."""
    have = pa.schema(table.schema().to_arrow())
    new = pa.schema(_delta_schema(schema).to_arrow())
    missing = [name for name in have.names if name not in new.names]
    extra = [field for field in new if field.name not in have.names]
    if missing or (extra and not add_columns):
        raise ValueError(
            f"files for {table_name} lack its columns {missing} or add "
            f"{[field.name for field in extra]} (add_columns={add_columns})"
        )
    return DeltaSchema.from_arrow(pa.schema([*have, *extra]))


def _remove_logless_folder(table_uri: str) -> None:
    """A first write that failed leaves its folder (and any data files it had flushed) without a
    log: a table no reader can open. On S3 there are no folders; flushed objects stay invisible to
    Delta (as a crashed writer's do) until vacuum."""
    folder = Path(table_uri)
    if not uris.is_s3(table_uri) and folder.is_dir() and not (folder / "_delta_log").exists():
        shutil.rmtree(folder)


def _row_groups(rows_per_group: int | None) -> dict:
    # Given any WriterProperties, delta-rs writes columns uncompressed unless told: snappy is
    # its default.
    properties = WriterProperties(max_row_group_size=rows_per_group, compression="SNAPPY")
    return {"writer_properties": properties} if rows_per_group else {}


def _check_partition(
    layer: str, name: str, frame: pl.DataFrame, column: str, value: str
) -> pl.DataFrame:
    if not set(value) <= _PARTITION_VALUE_CHARS:
        raise ValueError(f"partition value {value!r} has characters outside [A-Za-z0-9._-]")
    if frame.height and frame[column].unique().to_list() != [value]:
        raise ValueError(f"every row written to {layer}/{name} must have {column} = {value!r}")
    return frame


def _arrow_layout(schema: pl.Schema) -> pl.CompatLevel:
    """Text as Arrow string views: handed over without a copy, which takes a fifth off writing a
    text-heavy table. The Parquet writer cannot take a categorical's views: those keep the old
    layout."""
    categorical = any(
        isinstance(t, (pl.Categorical, pl.Enum)) for t in _all_dtypes(schema.dtypes())
    )
    return pl.CompatLevel.oldest() if categorical else pl.CompatLevel.newest()


def _all_dtypes(dtypes) -> list[pl.DataType]:
    """These types and every type nested in them (list items, struct fields)."""
    found = []
    for dtype in dtypes:
        found.append(dtype)
        if isinstance(dtype, (pl.List, pl.Array)):
            found += _all_dtypes([dtype.inner])
        elif isinstance(dtype, pl.Struct):
            found += _all_dtypes([f.dtype for f in dtype.fields])
    return found
