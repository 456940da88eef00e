"""The lake resource's Delta writes: every column type the layers write reads back as written."""

from __future__ import annotations

from datetime import date, datetime, timezone
from functools import partial

import polars as pl
import pytest

from pipeline_assets.resources.lake import LakeResource


def _frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "text": ["a long document " * 500, "ü ✓", None],
            "blob": [b"\x00\x01", b"", None],
            "keys": [[1, 2], [], None],
            "words": [["a", None], [], None],
            "pair": [{"name": "x", "count": 1}, None, {"name": None, "count": 3}],
            "label": pl.Series(["u", "v", None], dtype=pl.Categorical),
            "day": [date(2026, 11, 1), None, date(2026, 11, 2)],
            "at": pl.Series(
                [datetime(2026, 11, 1, tzinfo=timezone.utc), None, None],
                dtype=pl.Datetime("us", "UTC"),
            ),
            "batch_id": ["b1", "b1", "b1"],
        }
    )


def test_every_column_type_reads_back_as_written(lake: LakeResource):
    frame = _frame()
    lake.replace_partition("bronze", "records", frame, column="batch_id", value="b1")
    lake.append("bronze", "records", frame.with_columns(batch_id=pl.lit("b2")))
    back = lake.read("bronze", "records", where=pl.col("batch_id") == "b1").select(frame.columns)
    assert back.equals(frame.with_columns(pl.col("label").cast(pl.String)))
    assert lake.read("bronze", "records").height == 6


def test_a_categorical_nested_in_a_struct_reads_back_as_text(lake: LakeResource):
    frame = pl.DataFrame({"pair": [{"label": "u"}, {"label": None}]}).with_columns(
        pl.col("pair").cast(pl.Struct({"label": pl.Categorical}))
    )
    lake.overwrite("silver", "labels", frame)
    assert lake.read("silver", "labels")["pair"].struct.field("label").to_list() == ["u", None]


def test_an_overwrite_can_bound_its_parquet_row_groups(lake: LakeResource):
    import pyarrow.parquet as pq

    frame = pl.DataFrame({"sequence_index": range(1000), "input_ids": [[1, 2, 3]] * 1000})
    commit = lake.overwrite("gold", "sequences", frame, rows_per_group=128)
    [path] = lake.table("gold", "sequences").file_uris()
    groups = pq.ParquetFile(path).metadata
    assert commit.rows == 1000 and groups.num_row_groups == 8
    assert max(groups.row_group(i).num_rows for i in range(groups.num_row_groups)) == 128
    # Compressed as a write with delta-rs' defaults is (any WriterProperties would otherwise
    # leave it raw).
    assert {groups.row_group(0).column(i).compression for i in range(groups.num_columns)} == {
        "SNAPPY"
    }


def test_a_streamed_partition_is_committed_whole_or_not_at_all(lake: LakeResource, tmp_path):
    frame = _frame().drop("label")
    schema = frame.schema

    def frames(fail: bool):
        yield frame
        if fail:
            raise ValueError("the second chunk broke its contract")
        yield frame

    # Row groups smaller than a frame: the first frame's rows are encoded (and may be flushed)
    # before the failure.
    write = partial(
        lake.replace_partition_streaming,
        "bronze",
        "records",
        schema=schema,
        column="batch_id",
        value="b1",
        rows_per_group=2,
    )
    with pytest.raises(
        ValueError, match="^the second chunk broke its contract$"
    ):  # the maker's own error
        write(frames(fail=True))
    assert (
        lake.version("bronze", "records") is None
        and not (tmp_path / "lake" / "bronze" / "records").exists()
    )

    first = write(frames(fail=False))
    assert first.rows == 6 and lake.read("bronze", "records").height == 6
    with pytest.raises(ValueError):
        write(frames(fail=True))
    assert lake.version("bronze", "records") == first.version, (
        "a failed replacement commits nothing"
    )
    assert lake.read("bronze", "records").select(frame.columns).equals(pl.concat([frame, frame]))
