"""Two processes register the same landing zone at the same moment: each file version joins
one batch."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import subprocess
import sys

import boto3
import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.landing.batches import register_new_batch
from pipeline_assets.defs.partitions import ingest_batches, read_batch_manifest
from pipeline_assets.lib.locks import LockTimeout
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets_tests.conftest import BUCKET, jsonl_bytes, record, write_landing_file

FILES_PER_ROUND = 2
LINES_PER_FILE = 3


def _register_on_signal(landing_uri: str, lake_uri: str, rounds: int, start, done, results) -> None:
    """A worker: each round, wait for the others, register, report the batch (or None)."""
    landing, lake = LandingResource(uri=landing_uri), LakeResource(uri=lake_uri)
    for _ in range(rounds):
        start.wait()
        try:
            results.put(register_new_batch(landing, lake, logging.getLogger("race")).batch_id)
        except Exception as exc:  # the parent reports it
            results.put(f"error: {exc!r}")
        done.wait()


def _race(landing_uri: str, lake_uri: str, rounds: int, land) -> list[list[str | None]]:
    """Two workers register at the same moment, ``rounds`` times; ``land(r)`` writes round
    r's files."""
    context = multiprocessing.get_context("spawn")  # deltalake's runtime does not survive fork
    start, done, results = context.Barrier(3), context.Barrier(3), context.Queue()
    workers = [
        context.Process(
            target=_register_on_signal, args=(landing_uri, lake_uri, rounds, start, done, results)
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    outcomes = []
    try:
        for round_number in range(rounds):
            land(round_number)
            start.wait(timeout=120)
            done.wait(timeout=120)
            pair = [results.get(timeout=5), results.get(timeout=5)]
            outcomes.append(sorted(pair, key=lambda batch: batch is not None))
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return outcomes


def _assert_one_batch_per_round(
    outcomes: list[list[str | None]], manifest: pl.DataFrame, files: int
) -> None:
    assert not [o for o in outcomes if any(str(b).startswith("error") for b in o)], outcomes
    assert all(o[0] is None and o[1] is not None for o in outcomes), (
        f"one winner per round: {outcomes}"
    )
    versions = manifest.group_by("uri", "checksum").agg(
        batches=pl.col("batch_id").n_unique(), rows=pl.len()
    )
    assert versions.height == files
    twice = versions.filter((pl.col("batches") != 1) | (pl.col("rows") != 1))
    assert twice.is_empty(), f"file versions registered twice: {twice}"
    assert sorted(manifest["batch_id"].unique()) == sorted(o[1] for o in outcomes)


def _assert_bronze_has_each_line_once(
    instance, lake: LakeResource, landing: LandingResource, batches: list[str]
):
    instance.add_dynamic_partitions(ingest_batches.name, batches)
    resources = {"lake": lake, "landing": landing}
    for batch in batches:  # the asset alone: its checks have their own tests
        assert materialize(
            [bronze], partition_key=batch, instance=instance, resources=resources
        ).success
    records = lake.read("bronze", "records")
    assert records.height == len(batches) * FILES_PER_ROUND * LINES_PER_FILE
    assert records.select("source_file", "source_line").is_duplicated().sum() == 0


def _lines(round_number: int, file_number: int) -> list[dict]:
    first = (round_number * FILES_PER_ROUND + file_number) * LINES_PER_FILE
    return [record(i) for i in range(first, first + LINES_PER_FILE)]


def test_two_processes_registering_a_local_landing_zone_at_once(tmp_path, landing_dir, instance):
    landing, lake = LandingResource(uri=str(landing_dir)), LakeResource(uri=str(tmp_path / "lake"))
    rounds = 6

    def land(round_number: int) -> None:
        for file_number in range(FILES_PER_ROUND):
            lines = _lines(round_number, file_number)
            write_landing_file(
                landing_dir, f"source{file_number}", f"r{round_number:03d}.jsonl", lines
            )

    outcomes = _race(landing.uri, lake.uri, rounds, land)
    _assert_one_batch_per_round(outcomes, read_batch_manifest(lake), rounds * FILES_PER_ROUND)
    _assert_bronze_has_each_line_once(instance, lake, landing, [o[1] for o in outcomes])


def test_two_processes_registering_an_s3_landing_zone_at_once(s3_endpoint, instance):
    client = boto3.client("s3")
    landing = LandingResource(uri=f"s3://{BUCKET}/landing")
    lake = LakeResource(uri=f"s3://{BUCKET}/lake")
    rounds = 3

    def land(round_number: int) -> None:
        for file_number in range(FILES_PER_ROUND):
            client.put_object(
                Bucket=BUCKET,
                Key=f"landing/source{file_number}/r{round_number:03d}.jsonl",
                Body=jsonl_bytes(_lines(round_number, file_number)),
            )

    outcomes = _race(landing.uri, lake.uri, rounds, land)
    _assert_one_batch_per_round(outcomes, read_batch_manifest(lake), rounds * FILES_PER_ROUND)
    _assert_bronze_has_each_line_once(instance, lake, landing, [o[1] for o in outcomes])


_HOLD_THE_MANIFEST = """
import sys, time
from pipeline_assets.defs.partitions import BATCH_MANIFEST_TABLE
from pipeline_assets.resources.lake import LakeResource
with LakeResource(uri=sys.argv[1]).lock(*BATCH_MANIFEST_TABLE):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_registration_killed_while_holding_the_lock_blocks_nothing(tmp_path, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1)])
    landing, lake_uri = LandingResource(uri=str(landing_dir)), str(tmp_path / "lake")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_MANIFEST, lake_uri], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        impatient = LakeResource(uri=lake_uri, lock_timeout_seconds=0.3)
        with pytest.raises(
            LockTimeout, match=rf"landing/_manifest.lock is still held by pid {holder.pid} on "
        ):
            register_new_batch(landing, impatient, logging.getLogger("race"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lake = LakeResource(uri=lake_uri, lock_timeout_seconds=30)
    assert register_new_batch(landing, lake, logging.getLogger("race")).batch_id is not None
    assert read_batch_manifest(lake).height == 1
