"""The metadata every Delta-writing asset records, built in one place."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import polars as pl
from dagster import MetadataValue, TableColumn, TableRecord, TableSchema

from pipeline_assets.lib.uris import redact
from pipeline_assets.resources.lake import DeltaCommit


@dataclass
class Stopwatch:
    """Wall and CPU time since creation."""

    wall_start: float = field(default_factory=time.perf_counter)
    cpu_start: float = field(default_factory=time.process_time)

    def wall(self) -> float:
        return time.perf_counter() - self.wall_start

    def cpu(self) -> float:
        return time.process_time() - self.cpu_start


def column_schema(schema: pl.Schema) -> TableSchema:
    return TableSchema(columns=[TableColumn(name, str(dtype)) for name, dtype in schema.items()])


def delta_write_metadata(
    commit: DeltaCommit,
    schema: pl.Schema,
    *,
    upstream_versions: dict[str, int | None],
    input_bytes: int,
    stopwatch: Stopwatch,
) -> dict:
    """Version, location, shape, lineage and throughput of one Delta write."""
    wall = max(stopwatch.wall(), 1e-9)
    return {
        "delta_version": commit.version,
        "dagster/uri": MetadataValue.path(redact(commit.uri)),
        "dagster/row_count": commit.rows,
        "dagster/column_schema": column_schema(schema),
        "upstream_delta_versions": MetadataValue.json(upstream_versions),
        "input_mb": round(input_bytes / 1e6, 3),
        "rows_per_second": round(commit.rows / wall, 1),
        "mb_per_second": round(input_bytes / 1e6 / wall, 3),
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(stopwatch.cpu(), 3),
        "write_seconds": round(commit.wall_seconds, 3),
        "cpu_cores": len(
            os.sched_getaffinity(0)
        ),  # what the throughput was measured on (the sizer's calibration)
    }


def table_metadata(frame: pl.DataFrame) -> MetadataValue:
    """A small frame as a Dagster table (shown as a table in the UI)."""
    return MetadataValue.table(
        records=[TableRecord(row) for row in frame.iter_rows(named=True)],
        schema=column_schema(frame.schema),
    )
