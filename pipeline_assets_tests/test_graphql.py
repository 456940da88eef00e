"""A run submitted through Dagster's GraphQL API (`DagsterGraphQLClient`) to a real `dagster dev` on
loopback, as an external scheduler or a CI job would submit one, and watched until it succeeds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
from dagster import DagsterRunStatus
from dagster_graphql import DagsterGraphQLClient

from pipeline_assets.headless import persistent_instance, register_batches
from pipeline_assets.lib.sample_corpus import write_sample_corpus
from pipeline_assets.resources import Settings, build_resources

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_SECONDS = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_serving(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        assert server.poll() is None, "dagster dev exited"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"dagster dev did not serve on 127.0.0.1:{port} within {DEADLINE_SECONDS} s")


def test_a_run_submitted_through_graphql_succeeds(tmp_path, monkeypatch):
    home = tmp_path / "home"
    manifest = write_sample_corpus(home / "landing", records=300, eval_sets_dir=home / "reference" / "eval_sets")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))}
    env.update(PIPELINE_HOME=str(home), DAGSTER_HOME=str(home / "dagster"))
    for name in ("PIPELINE_HOME", "DAGSTER_HOME"):
        monkeypatch.setenv(name, env[name])
    instance = persistent_instance(str(home / "dagster"))
    # Registered here, so the sensor finds nothing new: the only run is the one submitted below.
    [batch] = register_batches(build_resources(Settings.from_env()), instance)

    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        _wait_until_serving(port, server)
        client = DagsterGraphQLClient("127.0.0.1", port_number=port)
        run_id = client.submit_job_execution("ingest_batch", repository_location_name="pipeline_assets",
                                             tags={"dagster/partition": batch})
        deadline = time.monotonic() + DEADLINE_SECONDS
        while (status := client.get_run_status(run_id)) not in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE):
            assert time.monotonic() < deadline, f"run {run_id} still {status} after {DEADLINE_SECONDS} s"
            time.sleep(2)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert status == DagsterRunStatus.SUCCESS
    records = pl.read_delta(str(home / "lake" / "bronze" / "records"))
    assert records.height == manifest["expected"]["bronze_rows"] and records["batch_id"].unique().to_list() == [batch]
