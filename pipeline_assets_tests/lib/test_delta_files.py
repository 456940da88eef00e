"""A share's Delta statistics are the ones delta-rs writes for the same rows."""

from __future__ import annotations

import json
from datetime import date, datetime, timezone
from pathlib import Path

import polars as pl
import pytest
from deltalake import write_deltalake

from pipeline_assets.lib.delta_files import write_share


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
