"""Every record contract of the pipeline (pandera, polars backend), DESIGN.md §2.

Each layer validates its output against its contract before the Delta commit, so a frame that
breaks a contract never becomes a table version. ``polars_schema`` gives the exact column types a
layer must produce, so an all-null column still lands with its declared type.
"""

from __future__ import annotations

import polars as pl
import pandera.polars as pa
from pandera.engines.polars_engine import DateTime

UTC_TIMESTAMP = DateTime(time_zone_agnostic=False, time_zone="UTC", time_unit="us")


class LandingRecord(pa.DataFrameModel):
    """One accepted landing line, after the source's field mapping."""

    prompt: str
    response: str
    system: str = pa.Field(nullable=True)
    id: str = pa.Field(nullable=True)
    created_at: UTC_TIMESTAMP = pa.Field(nullable=True)
    meta: str = pa.Field(nullable=True, description="the source's meta object, as JSON")
    extra: str = pa.Field(nullable=True, description="every unknown field, verbatim, as JSON")

    class Config:
        strict = True
        coerce = False

    @pa.check("prompt", "response", name="not_blank")
    def _not_blank(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col(data.key).str.strip_chars().str.len_chars() > 0)


class BronzeRecord(LandingRecord):
    """A landing record plus provenance: where it came from and when it arrived."""

    record_id: str = pa.Field(unique=True, str_length={"min_value": 32, "max_value": 32})
    source: str = pa.Field(str_length={"min_value": 1})
    source_file: str = pa.Field(str_length={"min_value": 1})
    source_line: pl.Int64 = pa.Field(ge=1)
    batch_id: str = pa.Field(str_length={"min_value": 1})
    ingested_at: UTC_TIMESTAMP
    content_hash: str = pa.Field(str_length={"min_value": 32, "max_value": 32})


QUARANTINE_REASON = r"^(invalid_json|not_an_object|invalid_utf8|blank_line|truncated_file|unreadable_file|unsupported_format|(missing_field|wrong_type|empty_field|invalid_timestamp):[a-z_]+)$"


class QuarantineRecord(pa.DataFrameModel):
    """A landing line (or Parquet row, or whole file) that failed the landing contract, verbatim."""

    raw: str = pa.Field(description="the line as read (invalid UTF-8 bytes replaced), or the row as JSON")
    source: str = pa.Field(str_length={"min_value": 1})
    source_file: str = pa.Field(str_length={"min_value": 1})
    source_line: pl.Int64 = pa.Field(ge=0, description="0 when the whole file is unreadable")
    batch_id: str = pa.Field(str_length={"min_value": 1})
    reason: str = pa.Field(str_matches=QUARANTINE_REASON)
    detail: str

    class Config:
        strict = True
        coerce = False


class LandingManifestEntry(pa.DataFrameModel):
    """One landing file registered into an ingest batch."""

    uri: str
    source: str
    size: pl.Int64 = pa.Field(ge=0)
    modified: str
    checksum: str = pa.Field(str_length={"min_value": 64, "max_value": 64})
    batch_id: str
    registered_at: UTC_TIMESTAMP
    previous_checksum: str = pa.Field(nullable=True, description="set when the file changed after an earlier ingest")

    class Config:
        strict = True


def polars_schema(model: type[pa.DataFrameModel]) -> pl.Schema:
    """The polars column types a contract declares, in declaration order."""
    columns = model.to_schema().columns
    return pl.Schema({name: column.dtype.type for name, column in columns.items()})


def conform(frame: pl.DataFrame, model: type[pa.DataFrameModel]) -> pl.DataFrame:
    """Select and cast a frame to the contract's columns and types (empty frames included)."""
    schema = polars_schema(model)
    missing = [name for name in schema if name not in frame.columns]
    if missing:
        raise ValueError(f"{model.__name__}: frame lacks column(s) {missing}")
    return frame.select([pl.col(name).cast(dtype) for name, dtype in schema.items()])


def validate(frame: pl.DataFrame, model: type[pa.DataFrameModel]) -> pl.DataFrame:
    """Validate eagerly with every failure reported (not just the first)."""
    return model.validate(frame, lazy=True)
