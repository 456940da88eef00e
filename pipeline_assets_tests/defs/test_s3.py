"""Landing zone and lake on s3:// against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import boto3

from pipeline_assets.resources import IngestPolicy, LakeResource, LandingResource
from pipeline_assets_tests.conftest import BUCKET, jsonl_bytes, record
from dagster import SkipReason

from pipeline_assets_tests.defs.bronze_helpers import batch_rows, checks_by_name, materialize_bronze, register
from pipeline_assets_tests.defs.test_landing_sensor import _tick

def test_landing_and_lake_on_s3(s3_endpoint, instance):
    client = boto3.client("s3")
    client.put_object(Bucket=BUCKET, Key="landing/annotate/a.jsonl", Body=jsonl_bytes([record(i) for i in range(12)] + [b"{bad"]))
    client.put_object(Bucket=BUCKET, Key="landing/logs/_tmp.jsonl", Body=jsonl_bytes([record(99)]))  # hidden
    resources = {
        "lake": LakeResource(uri=f"s3://{BUCKET}/lake"),
        "landing": LandingResource(uri=f"s3://{BUCKET}/landing"),
        "ingest_policy": IngestPolicy(max_quarantine_rate=0.10),
    }
    files = resources["landing"].list_files()
    assert [(f.uri, f.source) for f in files] == [(f"s3://{BUCKET}/landing/annotate/a.jsonl", "annotate")]

    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)
    assert result.success and checks_by_name(result)["bronze/records:quarantine_rate"].passed
    records = batch_rows(resources["lake"], "records", batch)
    assert records.height == 12 and set(records["source_file"]) == {"annotate/a.jsonl"}
    assert batch_rows(resources["lake"], "quarantine", batch)["reason"].to_list() == ["invalid_json"]

    version = resources["lake"].version("bronze", "records")
    assert materialize_bronze(instance, resources, batch).success  # a re-run: a new version, same rows
    assert resources["lake"].version("bronze", "records") == version + 1
    assert resources["lake"].read("bronze", "records").height == 12
    assert resources["lake"].read("bronze", "records", version=version).height == 12  # time travel
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="lake/bronze/records/_delta_log/")["KeyCount"]
    assert listed >= 2


def test_landing_sensor_ticks_on_s3(s3_endpoint, instance):
    client = boto3.client("s3")
    resources = {"lake": LakeResource(uri=f"s3://{BUCKET}/lake"), "landing": LandingResource(uri=f"s3://{BUCKET}/landing")}
    client.put_object(Bucket=BUCKET, Key="landing/synth/a.jsonl", Body=jsonl_bytes([record(1)]))
    first = _tick(instance, resources)
    assert len(first.run_requests) == 1
    assert isinstance(_tick(instance, resources), SkipReason)
    client.put_object(Bucket=BUCKET, Key="landing/synth/a.jsonl", Body=jsonl_bytes([record(1), record(2)]))
    changed = _tick(instance, resources)
    assert changed.run_requests[0].partition_key > first.run_requests[0].partition_key
    assert changed.run_requests[0].tags["pipeline/changed_files"] == "synth/a.jsonl"
