"""Files written by worker processes, committed once per partition by the lake resource: the rows,
the statistics, the idempotent retry, and a run killed between the writes and the commit."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import polars as pl
import pytest

from pipeline_assets.lib.delta_files import write_share
from pipeline_assets.lib.ops.retention import Removed
from pipeline_assets.resources.lake import LakeResource

TABLE = ("silver", "records")
SPAWN = multiprocessing.get_context("spawn")  # deltalake in a forked child can hang


def _rows(batch_id: str, start: int, count: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"r{i:04d}" for i in range(start, start + count)],
            "score": [float(i) for i in range(start, start + count)],
            "tags": [["a"]] * count,
            "batch_id": [batch_id] * count,
        }
    )


def _write(table_uri: str, frame: pl.DataFrame, file_name: str, options=None) -> dict:
    return write_share(table_uri, frame, {"batch_id": "b1"}, file_name, options)


def _write_then_hang(table_uri: str, frames: list[pl.DataFrame], written) -> None:
    """A step's workers wrote their shares and the step never commits them."""
    for index, frame in enumerate(frames):
        _write(table_uri, frame, f"part-killed-{index}.parquet")
    written.set()
    time.sleep(600)


def _table_files(lake: LakeResource) -> set[str]:
    root = Path(lake.table_uri(*TABLE))
    return {
        str(p.relative_to(root)) for p in root.rglob("*.parquet") if "_delta_log" not in p.parts
    }


def _version_files(lake: LakeResource, version: int) -> set[str]:
    actions = lake.table(*TABLE, version=version).get_add_actions(flatten=True)
    return set(pl.DataFrame(actions)["path"])


def _commit(lake: LakeResource, shares: list[dict], version: int, schema: pl.Schema):
    return lake.commit_partition(
        *TABLE, shares, schema, column="batch_id", value="b1", app_id="silver:b1", version=version
    )


def test_shares_from_two_spawned_workers_replace_the_partition_in_one_commit(lake: LakeResource):
    lake.replace_partition(*TABLE, _rows("b1", 0, 5), column="batch_id", value="b1")
    before = lake.append(*TABLE, _rows("b2", 100, 3)).version
    new = _rows("b1", 10, 8)
    halves = [new.head(5), new.tail(3)]
    with SPAWN.Pool(2) as pool:
        shares = pool.starmap(
            _write,
            [(lake.table_uri(*TABLE), half, f"part-{i}.parquet") for i, half in enumerate(halves)],
        )

    commit = _commit(lake, shares, 1, new.schema)

    assert commit.version == before + 1 and commit.rows == 8
    assert lake.read(*TABLE, where=pl.col("batch_id") == "b1").sort("record_id").equals(new)
    assert lake.read(*TABLE, where=pl.col("batch_id") == "b2").equals(_rows("b2", 100, 3))
    assert lake.read(*TABLE, version=before, where=pl.col("batch_id") == "b1").equals(
        _rows("b1", 0, 5)
    )
    actions = pl.DataFrame(lake.table(*TABLE).get_add_actions(flatten=True)).filter(
        pl.col("partition.batch_id") == "b1"
    )
    assert sorted(actions["num_records"]) == [3, 5]
    assert (actions["min.record_id"].min(), actions["max.record_id"].max()) == ("r0010", "r0017")
    assert (actions["min.score"].min(), actions["max.score"].max()) == (10.0, 17.0)
    assert actions["null_count.score"].to_list() == [0, 0]

    retried = _commit(lake, shares, 1, new.schema)
    assert (retried.version, lake.version(*TABLE)) == (commit.version, commit.version)
    later = lake.append(*TABLE, _rows("b3", 200, 1)).version
    assert _commit(lake, shares, 1, new.schema).version == commit.version  # not the newest
    assert lake.version(*TABLE) == later


def test_a_run_killed_before_its_commit_is_committed_once_by_the_rerun(lake: LakeResource):
    table_uri = lake.table_uri(*TABLE)
    lake.replace_partition(*TABLE, _rows("b1", 0, 2), column="batch_id", value="b1")
    rows = _rows("b1", 0, 6)
    written = SPAWN.Event()
    killed = SPAWN.Process(
        target=_write_then_hang, args=(table_uri, [rows.head(3), rows.tail(3)], written)
    )
    killed.start()
    assert written.wait(120)
    os.kill(killed.pid, signal.SIGKILL)
    killed.join()
    assert lake.read(*TABLE).height == 2  # nothing of the killed run is visible

    shares = [_write(table_uri, rows.head(4), "part-rerun-0.parquet")]
    shares.append(_write(table_uri, rows.tail(2), "part-rerun-1.parquet"))
    commit = _commit(lake, shares, 7, rows.schema)

    assert lake.read(*TABLE).sort("record_id").equals(rows)  # every row once
    orphans = {"batch_id=b1/part-killed-0.parquet", "batch_id=b1/part-killed-1.parquet"}
    assert orphans <= _table_files(lake)
    removed = lake.remove_uncommitted(*TABLE, "batch_id", "b1", keep_after=time.time() + 1)
    assert removed.files == 2
    assert _table_files(lake) == _version_files(lake, commit.version) | _version_files(lake, 0)
    assert lake.read(*TABLE, version=commit.version - 1).height == 2  # time travel still reads


def test_the_first_commit_creates_the_table_and_a_later_one_may_add_a_column(lake: LakeResource):
    table_uri = lake.table_uri(*TABLE)
    rows = _rows("b1", 0, 3)
    shares = [_write(table_uri, rows, "part-a.parquet")]
    first = _commit(lake, shares, 0, rows.schema)
    assert first.version == 0 and lake.table(*TABLE).transaction_version("silver:b1") == 0
    assert _commit(lake, shares, 0, rows.schema).version == 0 == lake.version(*TABLE)

    wider = _rows("b1", 3, 2).with_columns(language=pl.lit("en"))
    share = _write(table_uri, wider, "part-b.parquet")
    with pytest.raises(ValueError, match="language"):
        _commit(lake, [share], 1, wider.schema)
    commit = lake.commit_partition(
        *TABLE,
        [share],
        wider.schema,
        column="batch_id",
        value="b1",
        app_id="silver:b1",
        version=1,
        add_columns=True,
    )
    assert commit.version == 1
    assert lake.read(*TABLE).select(wider.columns).equals(wider)


def _stage(lake: LakeResource, run: str, modified: float) -> str:
    """A run's staged file under the lake, last written at ``modified``."""
    path = lake.staging_uri("silver", "b1", run, "sft-records-000000000000.parquet")
    if not path.startswith("s3://"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    _rows("b1", 0, 2).write_parquet(path, storage_options=lake.storage_options())
    if not path.startswith("s3://"):
        os.utime(path, (modified, modified))
    return path


def test_retention_removes_a_dead_runs_staging_and_keeps_a_run_under_way(lake: LakeResource):
    now = time.time()
    dead, live = _stage(lake, "run-dead", now - 3600), _stage(lake, "run-live", now)

    folders, removed = lake.remove_abandoned_staging(keep_after=now - 60)

    assert folders == ["silver/b1/run-dead"] and removed.files == 1 and removed.bytes > 0
    assert not Path(dead).parent.exists() and Path(live).exists()
    assert lake.remove_abandoned_staging(keep_after=now - 60) == ([], Removed())


def test_shares_on_s3_are_committed_and_their_orphans_removed(s3_endpoint):
    lake = LakeResource(uri="s3://pipeline/lake")
    table_uri, options = lake.table_uri(*TABLE), lake.storage_options()
    rows = _rows("b1", 0, 4)
    orphan = _write(table_uri, rows, "part-orphan.parquet", options)
    share = _write(table_uri, rows, "part-kept.parquet", options)

    _commit(lake, [share], 1, rows.schema)

    assert lake.read(*TABLE).sort("record_id").equals(rows)
    assert lake.remove_uncommitted(*TABLE, "batch_id", "b1", keep_after=time.time() + 1).files == 1
    assert lake.read(*TABLE).height == 4 and orphan["path"] != share["path"]
    staged = _stage(lake, "run-dead", 0.0)
    folders, removed = lake.remove_abandoned_staging(keep_after=time.time() + 1)
    assert folders == ["silver/b1/run-dead"] and removed.files == 1
    with pytest.raises(FileNotFoundError):
        pl.read_parquet(staged, storage_options=lake.storage_options())


def test_a_table_partitioned_by_band_then_batch_replaces_the_batch_in_every_band(
    lake: LakeResource,
):
    bands = ("silver", "minhash_bands")
    table_uri = lake.table_uri(*bands)

    def keys(batch_id: str, band: int, key: int) -> pl.DataFrame:
        return pl.DataFrame({"key": [key], "band": [str(band)], "batch_id": [batch_id]})

    for batch_id in ("b1", "b2"):
        old = pl.concat([keys(batch_id, band, -1) for band in (0, 1, 2)])
        lake.replace_partition(
            *bands, old, column="batch_id", value=batch_id, partition_by=("band", "batch_id")
        )
    shares = [
        write_share(
            table_uri,
            keys("b1", band, band),
            {"band": str(band), "batch_id": "b1"},
            f"part-band{band}.parquet",
        )
        for band in (0, 1)
    ]
    lake.commit_partition(
        *bands,
        shares,
        keys("b1", 0, 0).schema,
        column="batch_id",
        value="b1",
        app_id="bands:b1",
        version=1,
        partition_by=("band", "batch_id"),
    )

    back = lake.read(*bands).sort("batch_id", "band")
    assert back.filter(pl.col("batch_id") == "b1")["key"].to_list() == [0, 1]
    assert back.filter(pl.col("batch_id") == "b2")["key"].to_list() == [-1, -1, -1]
    assert shares[1]["path"] == "band=1/batch_id=b1/part-band1.parquet"
