"""Landing zone and lake on s3:// against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import random

import boto3
import polars as pl
from dagster import SkipReason

from pipeline_assets.defs.bronze.policy import IngestPolicy
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets_tests.conftest import BUCKET, jsonl_bytes, record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import (
    batch_rows,
    checks_by_name,
    materialize_bronze,
    register,
)
from pipeline_assets_tests.defs.test_landing_sensor import _tick


def test_landing_and_lake_on_s3(s3_endpoint, instance):
    client = boto3.client("s3")
    client.put_object(
        Bucket=BUCKET,
        Key="landing/annotate/a.jsonl",
        Body=jsonl_bytes([record(i) for i in range(12)] + [b"{bad"]),
    )
    client.put_object(
        Bucket=BUCKET, Key="landing/logs/_tmp.jsonl", Body=jsonl_bytes([record(99)])
    )  # hidden
    resources = {
        "lake": LakeResource(uri=f"s3://{BUCKET}/lake"),
        "landing": LandingResource(uri=f"s3://{BUCKET}/landing"),
        "ingest_policy": IngestPolicy(max_quarantine_rate=0.10),
    }
    files = resources["landing"].list_files()
    assert [(f.uri, f.source) for f in files] == [
        (f"s3://{BUCKET}/landing/annotate/a.jsonl", "annotate")
    ]

    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)
    assert result.success and checks_by_name(result)["bronze/records:quarantine_rate"].passed
    records = batch_rows(resources["lake"], "records", batch)
    assert records.height == 12 and set(records["source_file"]) == {"annotate/a.jsonl"}
    assert batch_rows(resources["lake"], "quarantine", batch)["reason"].to_list() == [
        "invalid_json"
    ]

    version = resources["lake"].version("bronze", "records")
    assert materialize_bronze(
        instance, resources, batch
    ).success  # a re-run: a new version, same rows
    assert resources["lake"].version("bronze", "records") == version + 1
    assert resources["lake"].read("bronze", "records").height == 12
    assert resources["lake"].read("bronze", "records", version=version).height == 12  # time travel
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="lake/bronze/records/_delta_log/")[
        "KeyCount"
    ]
    assert listed >= 2


def test_landing_sensor_ticks_on_s3(s3_endpoint, instance):
    client = boto3.client("s3")
    resources = {
        "lake": LakeResource(uri=f"s3://{BUCKET}/lake"),
        "landing": LandingResource(uri=f"s3://{BUCKET}/landing"),
    }
    client.put_object(Bucket=BUCKET, Key="landing/synth/a.jsonl", Body=jsonl_bytes([record(1)]))
    first = _tick(instance, resources)
    assert len(first.run_requests) == 1
    assert isinstance(_tick(instance, resources), SkipReason)
    client.put_object(
        Bucket=BUCKET, Key="landing/synth/a.jsonl", Body=jsonl_bytes([record(1), record(2)])
    )
    changed = _tick(instance, resources)
    assert changed.run_requests[0].partition_key > first.run_requests[0].partition_key
    assert changed.run_requests[0].tags["pipeline/changed_files"] == "synth/a.jsonl"


def test_a_later_batch_finds_an_earlier_copy_through_the_band_table_on_s3(
    s3_endpoint, instance, resources, landing_dir
):
    """The lake on S3: batch 2's lookup reads silver/minhash_bands by band from the object store."""
    from dagster import materialize

    from pipeline_assets.defs.bronze.assets import bronze
    from pipeline_assets.defs.reference.assets import eval_sets
    from pipeline_assets.defs.silver.assets import silver

    s3 = {**resources, "lake": LakeResource(uri=f"s3://{BUCKET}/lake")}
    rng = random.Random(3)
    words = [f"{stem}{i}" for stem in ("data", "model", "token", "layer") for i in range(300)]
    first = [
        record(i, prompt=f"Question {i}?", response=" ".join(rng.choice(words) for _ in range(60)))
        for i in range(7)
    ]
    batches = []
    for name, rows in (("a.jsonl", first[:6]), ("b.jsonl", [{**first[2], "id": "copy"}, first[6]])):
        write_landing_file(landing_dir, "synth", name, rows)
        batches.append(register(instance, s3))
        result = materialize(
            [eval_sets, bronze, silver], partition_key=batches[-1], instance=instance, resources=s3
        )
        assert result.success
    silver_metadata = result.asset_materializations_for_node("silver")[0].metadata
    assert silver_metadata["index_entries_found"].value == 1
    rejects = s3["lake"].read("silver", "rejects", where=pl.col("batch_id") == batches[1])
    assert rejects["stage"].to_list() == ["exact_dup"]
    assert (
        s3["lake"].read("silver", "minhash_bands").height == 17 * 7
    )  # 6 + 1 records kept, a key a band
    listed = boto3.client("s3").list_objects_v2(
        Bucket=BUCKET, Prefix="lake/silver/minhash_bands/band=-1/"
    )
    assert listed["KeyCount"] >= 2, "a file a batch in each band's partition"
