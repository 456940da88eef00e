"""A flaky object store under `pipeline-assets run`: transient read faults are retried, never
quarantined, and a file that cannot be read after the retries fails its batch with nothing
in bronze."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import boto3
import polars as pl
from dagster import DagsterEventType, DagsterInstance

from pipeline_assets_tests.conftest import BUCKET, jsonl_bytes, record
from pipeline_assets_tests.faulty_s3 import FaultyS3

FLAKY_KEY = "landing/annotate/flaky.jsonl"


def _land(client) -> None:
    client.put_object(
        Bucket=BUCKET, Key=FLAKY_KEY, Body=jsonl_bytes([record(i) for i in range(40)])
    )
    client.put_object(
        Bucket=BUCKET,
        Key="landing/annotate/steady.jsonl",
        Body=jsonl_bytes([record(100 + i) for i in range(10)]),
    )


def _run_bronze(home: Path, endpoint: str) -> subprocess.CompletedProcess:
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))
    }
    environment.update(
        PIPELINE_HOME=str(home),
        PIPELINE_LANDING_URI=f"s3://{BUCKET}/landing",
        AWS_ENDPOINT_URL=endpoint,
        AWS_MAX_ATTEMPTS="1",  # one try inside boto: the step's retry policy must retry
        PIPELINE_RETRY_DELAY_SECONDS="0.2",
    )
    return subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli.main", "run", "--select", 'key:"bronze/*"'],
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _step_retries(home: Path) -> int:
    instance = DagsterInstance.from_config(str(home / "dagster"))
    [run] = instance.get_runs()
    return len(instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY))


def _bronze(home: Path) -> pl.DataFrame:
    return pl.read_delta(str(home / "lake" / "bronze" / "records"))


def test_a_read_that_fails_twice_is_retried_and_every_line_lands(s3_endpoint, tmp_path):
    _land(boto3.client("s3"))
    # GET 1 hashes the file at registration; bronze's first two reads get a 503, the third succeeds.
    with FaultyS3(s3_endpoint, FLAKY_KEY, fails=lambda n: n in (2, 3)) as store:
        run = _run_bronze(tmp_path, store.endpoint)
    assert run.returncode == 0, run.stderr
    assert store.requests == 4, "registration, two failed reads, one good one"
    assert _step_retries(tmp_path) == 2, "the step's retry policy fired, not a quarantine"
    bronze = _bronze(tmp_path)
    assert bronze.filter(pl.col("source_file") == "annotate/flaky.jsonl").height == 40
    assert bronze.height == 50
    assert (
        not (tmp_path / "lake" / "bronze" / "quarantine").exists()
        or pl.read_delta(str(tmp_path / "lake" / "bronze" / "quarantine")).height == 0
    ), "a transient fault is never quarantined"


def test_a_read_that_keeps_failing_fails_the_batch_naming_the_file(s3_endpoint, tmp_path):
    _land(boto3.client("s3"))
    with FaultyS3(s3_endpoint, FLAKY_KEY, fails=lambda n: n > 1) as store:
        run = _run_bronze(tmp_path, store.endpoint)
    assert run.returncode == 1
    assert store.requests == 5, (
        "registration, then the first try and three retries",
        run.stdout,
        run.stderr[-3000:],
    )
    failed = [line for line in run.stderr.splitlines() if line.startswith("FAILED:")]
    assert failed and "annotate/flaky.jsonl" in failed[0] and "SlowDown" in failed[0], run.stderr
    lake = tmp_path / "lake" / "bronze"
    for table in ("records", "quarantine"):
        assert (
            not (lake / table).exists()
            or pl.read_delta(str(lake / table))
            .filter(pl.col("source_file") == "annotate/flaky.jsonl")
            .is_empty()
        ), f"nothing of the file in bronze/{table}"
