"""The replay buffer's Delta table under the RL job's processes: two writers append groups while the
learner takes updates, and every completion ends up in the table once, consumed at most once,
none lost."""

from __future__ import annotations

import json
import multiprocessing
import time

import polars as pl

from pipeline_assets.lib.rl.replay import StalenessPolicy
from pipeline_assets.trainer.replay_io import ReplayTable
from pipeline_assets_tests.lib.rl.test_replay import buffer, group

POLICY = StalenessPolicy(max_staleness=100, max_pending_seconds=3600.0)
GROUPS_PER_WRITER = 6


def _write_groups(lake_uri: str, writer: str) -> None:
    table = ReplayTable(lake_uri)
    for number in range(GROUPS_PER_WRITER):
        table.append(buffer(*group(f"{writer}-{number}", [1.0, 0.0, 0.0], version=5)))
        time.sleep(0.01)


def test_appends_racing_the_learner_are_each_consumed_once(tmp_path):
    lake_uri = str(tmp_path / "lake")
    table = ReplayTable(lake_uri)
    writers = [
        multiprocessing.get_context("spawn").Process(target=_write_groups, args=(lake_uri, name))
        for name in ("w0", "w1")
    ]
    for writer in writers:
        writer.start()
    taken = []
    while (
        any(writer.is_alive() for writer in writers) or table.read()["status"].eq("pending").any()
    ):
        consumed, dropped = table.take("rl-v0", current_version=6, policy=POLICY)
        assert dropped.is_empty()
        taken.append(consumed)
        time.sleep(
            0.1
        )  # a learner polls between updates (back to back, it would keep the writers waiting)
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0

    rows = table.read()
    consumed = pl.concat(taken)
    assert rows.height == 2 * GROUPS_PER_WRITER * 3 and rows["rollout_id"].n_unique() == rows.height
    assert consumed["rollout_id"].n_unique() == consumed.height == rows.height, (
        "each taken once, none lost"
    )
    assert set(rows["status"]) == {"consumed"} and set(rows["consumed_by_version"]) == {6}


def test_stale_rows_are_written_back_as_dropped(tmp_path):
    table = ReplayTable(str(tmp_path / "lake"))
    table.append(
        buffer(*group("old", [1.0, 0.0], version=1), *group("fresh", [1.0, 0.0], version=4))
    )

    consumed, dropped = table.take("rl-v0", current_version=4, policy=StalenessPolicy(1, 3600.0))

    assert set(consumed["group_id"]) == {"fresh"} and set(dropped["group_id"]) == {"old"}
    statuses = dict(table.read().select("group_id", "status").unique().iter_rows())
    assert statuses == {"fresh": "consumed", "old": "dropped_stale"}
    assert table.take("rl-v0", current_version=5, policy=StalenessPolicy(1, 3600.0))[
        0
    ].is_empty(), "nothing twice"
    assert table.take("rl-v1", current_version=0, policy=StalenessPolicy(1, 3600.0))[
        0
    ].is_empty(), "another run's"


def test_rollout_pairs_land_whole_on_an_s3_landing_zone(tmp_path, s3_endpoint):
    import boto3

    from pipeline_assets.lib.rl.replay import preference_pairs_from_groups
    from pipeline_assets.trainer.replay_io import land_rollout_pairs
    from pipeline_assets_tests.conftest import BUCKET

    rows = buffer(*group("g1", [1.0, 0.0], version=5, prompt_id="p1"))
    pairs = preference_pairs_from_groups(
        rows, pl.DataFrame({"prompt_id": ["p1"], "prompt": ["Sort: 3 1 2"]})
    )

    landed = land_rollout_pairs(
        pairs, f"s3://{BUCKET}/landing", "rl-0001", str(tmp_path / "scratch")
    )

    assert landed == f"s3://{BUCKET}/landing/rl_rollouts/rl-0001.jsonl"
    body = (
        boto3.client("s3")
        .get_object(Bucket=BUCKET, Key="landing/rl_rollouts/rl-0001.jsonl")["Body"]
        .read()
    )
    assert [line["id"] for line in map(json.loads, body.decode().splitlines())] == ["rl:g1"]
    assert not list((tmp_path / "scratch").rglob("*.jsonl")), "the staged copy is removed"
    assert (
        land_rollout_pairs(pairs.clear(), f"s3://{BUCKET}/landing", "rl-0002", str(tmp_path))
        is None
    )
