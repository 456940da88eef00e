"""A run submitted through Dagster's GraphQL API (`DagsterGraphQLClient`) to a real `dagster dev` on
loopback, as an external scheduler or a CI job would submit one, and watched until it succeeds."""

from __future__ import annotations

import time

import polars as pl
from dagster import DagsterRunStatus
from dagster_graphql import DagsterGraphQLClient

from pipeline_assets_tests.dagster_dev import DEADLINE_SECONDS, running_dagster_dev


def test_a_run_submitted_through_graphql_succeeds(tmp_path, monkeypatch):
    with running_dagster_dev(tmp_path, monkeypatch) as dev:
        client = DagsterGraphQLClient("127.0.0.1", port_number=dev.port)
        run_id = client.submit_job_execution("ingest_batch", repository_location_name="pipeline_assets",
                                             tags={"dagster/partition": dev.batch})
        deadline = time.monotonic() + DEADLINE_SECONDS
        while (status := client.get_run_status(run_id)) not in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE):
            assert time.monotonic() < deadline, f"run {run_id} still {status} after {DEADLINE_SECONDS} s"
            time.sleep(2)
    assert status == DagsterRunStatus.SUCCESS
    records = pl.read_delta(str(dev.home / "lake" / "bronze" / "records"))
    assert records.height == dev.manifest["expected"]["bronze_rows"] and records["batch_id"].unique().to_list() == [dev.batch]
