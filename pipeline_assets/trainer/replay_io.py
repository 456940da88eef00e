"""The replay buffer's Delta table as the RL job's processes use it: rollout workers append their
completions, the learner takes what an update consumes and writes the rows' new status back.

Every write holds the table's lock (``<lake>/rl/_replay_buffer.lock``, as the lake resource's
locks), so an append and the learner's read-judge-merge never interleave: a row appended while the
learner judges waits for the next update, none is consumed twice, none is lost. Each write is
checked against ``ReplayBufferRow`` before its commit.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import polars as pl
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError

from pipeline_assets.contracts import ReplayBufferRow, conform, polars_schema, validate
from pipeline_assets.lib import uris
from pipeline_assets.lib.locks import FileLock, Lock, S3Lease
from pipeline_assets.lib.rl.replay import (
    CONSUMED,
    PENDING,
    ROLLOUT_SOURCE,
    StalenessPolicy,
    take_for_update,
    write_rollout_pairs,
)

TABLE = ("rl", "replay_buffer")
_LOCK_TIMEOUT_SECONDS = 300.0
_LEASE_SECONDS = 60.0
_STATUS_COLUMNS = ("status", "consumed_by_version", "updated_at")


class ReplayTable:
    def __init__(self, lake_uri: str):
        self.lake_uri = lake_uri
        self.uri = uris.join(lake_uri, *TABLE)
        self.storage_options = uris.delta_storage_options(lake_uri)

    def append(self, rows: pl.DataFrame) -> None:
        """Add a batch of completions (one commit)."""
        frame = validate(conform(rows, ReplayBufferRow), ReplayBufferRow)
        with self._lock():
            write_deltalake(
                self.uri, frame.to_arrow(), mode="append", storage_options=self.storage_options
            )

    def read(self, run: str | None = None) -> pl.DataFrame:
        """Every row (of ``run``), or an empty frame of the contract's columns before the first
        append."""
        try:
            table = DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return pl.DataFrame(schema=polars_schema(ReplayBufferRow))
        rows = pl.from_arrow(
            table.to_pyarrow_table(filters=None if run is None else [("run", "=", run)])
        )
        return rows

    def pending_groups(self, run: str) -> int:
        """Groups of ``run`` waiting for an update: two columns read, the files of other runs
        skipped."""
        try:
            table = DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return 0
        pending = table.to_pyarrow_table(
            columns=["group_id"], filters=[("run", "=", run), ("status", "=", PENDING)]
        )
        return pl.from_arrow(pending)["group_id"].n_unique()

    def updates_taken(self, run: str) -> int:
        """How many updates of ``run`` have consumed rows: the newest consuming version plus one,
        0 before the first."""
        try:
            table = DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return 0
        consumed = table.to_pyarrow_table(
            columns=["consumed_by_version"], filters=[("run", "=", run), ("status", "=", CONSUMED)]
        )
        newest = pl.from_arrow(consumed)["consumed_by_version"].max()
        return 0 if newest is None else int(newest) + 1

    def take(
        self,
        run: str,
        current_version: int,
        policy: StalenessPolicy,
        now: datetime | None = None,
        max_groups: int | None = None,
    ) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The pending rows of ``run`` an update at ``current_version`` consumes and those it drops
        as stale (``lib.rl.replay.take_for_update``), their new status written back before they are
        returned."""
        with self._lock():
            consumed, dropped = take_for_update(
                self.read(run), current_version, policy, now=now, max_groups=max_groups
            )
            changed = pl.concat([consumed, dropped])
            if changed.height:
                self._merge_status(validate(conform(changed, ReplayBufferRow), ReplayBufferRow))
        return consumed, dropped

    def _merge_status(self, changed: pl.DataFrame) -> None:
        table = DeltaTable(self.uri, storage_options=self.storage_options)
        (
            table.merge(
                changed.select("rollout_id", *_STATUS_COLUMNS).to_arrow(),
                predicate="t.rollout_id = s.rollout_id",
                source_alias="s",
                target_alias="t",
            )
            .when_matched_update(updates={column: f"s.{column}" for column in _STATUS_COLUMNS})
            .execute()
        )

    def _lock(self) -> Lock:
        lock_uri = uris.join(self.lake_uri, TABLE[0], f"_{TABLE[1]}.lock")
        if not uris.is_s3(lock_uri):
            return FileLock(lock_uri, timeout=_LOCK_TIMEOUT_SECONDS)
        import boto3  # only on S3

        client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
        return S3Lease(client, lock_uri, timeout=_LOCK_TIMEOUT_SECONDS, ttl_seconds=_LEASE_SECONDS)


def land_rollout_pairs(
    pairs: pl.DataFrame, landing_uri: str, name: str, scratch_dir: str
) -> str | None:
    """``pairs`` as ``<landing>/rl_rollouts/<name>.jsonl`` (``lib.rl.replay.write_rollout_pairs``),
    on a local landing zone or on S3 (written in ``scratch_dir``, then uploaded whole: an S3 object
    appears at once). Returns where it landed; None when there are no pairs."""
    if not uris.is_s3(landing_uri):
        written = write_rollout_pairs(pairs, Path(landing_uri), name)
        return None if written is None else str(written)
    staged = write_rollout_pairs(pairs, Path(scratch_dir) / "rollout_pairs", name)
    if staged is None:
        return None
    import boto3  # only on S3

    target = uris.join(landing_uri, ROLLOUT_SOURCE, staged.name)
    bucket, key = uris.split_s3(target)
    boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None).upload_file(
        str(staged), bucket, key
    )
    staged.unlink()
    return target
