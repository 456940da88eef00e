"""A share's Delta statistics are the ones delta-rs writes for the same rows, written at once or a
slice at a time; the slices a partition is read in keep to their byte budget; the files a task is
named read as the pinned table."""

from __future__ import annotations

import json
import shutil
from datetime import date, datetime, timezone
from pathlib import Path

import polars as pl
import pytest
from deltalake import DeltaTable, write_deltalake

from pipeline_assets.lib.delta_files import (
    TableFiles,
    data_files,
    partition_slices,
    write_share,
    write_share_slices,
)


def _delta_rs_stats(table: Path) -> dict:
    [log] = table.glob("_delta_log/*.json")
    [add] = [json.loads(line)["add"] for line in log.read_text().splitlines() if '"add"' in line]
    return json.loads(add["stats"])


def test_a_shares_statistics_are_those_delta_rs_writes(tmp_path):
    frame = pl.DataFrame(
        {
            "text": ["a long document " * 5, "ü ✓", None, "é" * 70],
            "blob": [b"\x00", b"", None, None],
            "keys": [[1, 2], [], None, None],
            "pair": [{"name": "x", "count": 1}, None, {"name": None, "count": 3}, None],
            "day": [date(2026, 11, 1), None, date(2026, 11, 2), None],
            "at": pl.Series(
                [datetime(2026, 11, 1, 5, 6, 7, 123456, tzinfo=timezone.utc), None, None, None],
                dtype=pl.Datetime("us", "UTC"),
            ),
            "naive": [datetime(2026, 1, 1), None, None, datetime(2026, 1, 1, 1, 1, 1, 5000)],
            "score": [1.5, float("nan"), None, 2.0],
            "flag": [True, False, None, None],
            "hash": pl.Series([-5, 2**62, None, None], dtype=pl.Int64),
            "batch_id": ["b1"] * 4,
        }
    )
    write_deltalake(tmp_path / "by_delta_rs", frame.to_arrow(), partition_by=["batch_id"])

    share = write_share(str(tmp_path / "by_worker"), frame, {"batch_id": "b1"}, "part.parquet")

    assert json.loads(share["stats"]) == _delta_rs_stats(tmp_path / "by_delta_rs")
    assert share["path"] == "batch_id=b1/part.parquet"
    assert share["size"] == (tmp_path / "by_worker" / share["path"]).stat().st_size


def test_an_integer_partition_column_is_checked_against_its_value_as_text(tmp_path):
    rows = pl.DataFrame(
        {"band": [-1, -1], "key": [1, 2]}, schema={"band": pl.Int16, "key": pl.Int64}
    )
    share = write_share(str(tmp_path), rows, {"band": "-1"}, "part.parquet")
    assert share["path"] == "band=-1/part.parquet"
    assert pl.read_parquet(tmp_path / share["path"]).columns == ["key"]
    with pytest.raises(ValueError, match="band = '0'"):
        write_share(str(tmp_path), rows, {"band": "0"}, "other.parquet")


def test_a_share_written_a_slice_at_a_time_is_the_share_written_at_once(tmp_path):
    frame = pl.DataFrame(
        {"key": list(range(10)), "name": [f"r{i}" for i in range(10)], "batch_id": ["b1"] * 10}
    )
    whole = write_share(str(tmp_path / "whole"), frame, {"batch_id": "b1"}, "part.parquet")
    slices = [frame.slice(0, 3), frame.slice(3, 0), frame.slice(3, 7)]
    sliced = write_share_slices(
        str(tmp_path / "sliced"), slices, {"batch_id": "b1"}, "part.parquet"
    )
    assert sliced["stats"] == whole["stats"] and sliced["path"] == whole["path"]
    written = pl.read_parquet(tmp_path / "sliced" / sliced["path"])
    assert written.equals(frame.drop("batch_id"))
    assert write_share_slices(str(tmp_path / "none"), [frame.clear()], {}, "p.parquet") is None
    assert not (tmp_path / "none").exists(), "no rows, no file"
    with pytest.raises(ValueError, match="batch_id = 'b2'"):
        write_share_slices(str(tmp_path / "x"), [frame], {"batch_id": "b2"}, "part.parquet")


def test_a_partitions_slices_hold_at_most_their_byte_budget_and_every_row_once(tmp_path):
    wide = pl.DataFrame(
        {
            "batch_id": ["b1"] * 300 + ["b2"] * 100,
            "row": list(range(400)),
            "payload": [bytes(1000)] * 400,
        }
    )
    for part in range(4):  # four files
        write_deltalake(tmp_path, wide.slice(part * 100, 100).to_arrow(), mode="append")
    table = DeltaTable(tmp_path)

    slices = list(partition_slices(table, "batch_id", "b1", 50_000))
    assert sorted(pl.concat(slices)["row"]) == list(range(300))
    assert len(slices) >= 6 and max(s.estimated_size() for s in slices) <= 50_000
    narrow = list(partition_slices(table, "batch_id", "b1", 50_000, ["row"]))
    assert narrow[0].columns == ["row"] and len(narrow) == 1, "300 narrow rows: one slice"


def test_pinned_files_scan_as_the_table_at_its_version_scans_with_no_log_read(tmp_path):
    """A task given some partitions' files reads their rows as ``scan_delta`` of the table at the
    pinned version gives them, partition columns included and in the table's order, even once the
    table has moved on; a partition with no file names none."""
    uri = str(tmp_path / "bands")
    for batch in ("b1", "b2"):
        rows = pl.DataFrame(
            {
                "band": pl.Series([0, 0, 3], dtype=pl.Int16),
                "band_key": [1, 2, 3],
                "record_id": [f"{batch}-r1", f"{batch}-r2", f"{batch}-r3"],
                "batch_id": [batch] * 3,
            }
        )
        write_deltalake(uri, rows.to_arrow(), mode="append", partition_by=["band", "batch_id"])
    table = DeltaTable(uri)
    files = TableFiles(table).of([(0, "b2"), (3, "b1"), (3, "b9")])
    expected = (
        pl.scan_delta(table)
        .filter(
            ((pl.col("band") == 0) & (pl.col("batch_id") == "b2"))
            | ((pl.col("band") == 3) & (pl.col("batch_id") == "b1"))
        )
        .collect()
    )
    write_deltalake(uri, expected.head(0).to_arrow(), mode="overwrite")  # the table moves on
    shutil.rmtree(tmp_path / "bands" / "_delta_log")  # and no task could read its log
    scanned = files.scan().collect()
    assert scanned.columns == expected.columns and scanned.schema == expected.schema
    assert scanned.sort("record_id").equals(expected.sort("record_id"))
    assert len(files.files) == 2, "b9 has no file in band 3"


def test_a_table_whose_files_cannot_be_read_alone_is_refused_by_name(tmp_path):
    """Deletion vectors: a file read alone would hold rows the table deleted. ``data_files``
    (what the bronze reads and the lookup's ``TableFiles`` both list files by) refuses the table,
    naming it; a table without them lists each file with its add action."""
    frame = pl.DataFrame({"a": [1, 2], "batch_id": ["b1", "b2"]})
    plain, vectors = tmp_path / "plain", tmp_path / "vectors"
    write_deltalake(plain, frame.to_arrow(), partition_by=["batch_id"])
    write_deltalake(
        vectors,
        frame.to_arrow(),
        partition_by=["batch_id"],
        configuration={"delta.enableDeletionVectors": "true"},
    )
    listed = data_files(DeltaTable(plain))
    assert sorted(action["partition.batch_id"] for _, action in listed) == ["b1", "b2"]
    assert all(uri.endswith(action["path"]) for uri, action in listed)
    for refused in (
        lambda: data_files(DeltaTable(vectors)),
        lambda: TableFiles(DeltaTable(vectors)),
    ):
        with pytest.raises(ValueError, match="vectors.*deletion vectors; its files cannot be read"):
            refused()
