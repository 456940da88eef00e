"""landing_sensor ticks on a test instance."""

from __future__ import annotations

import logging
import os

from dagster import SensorResult, SkipReason, build_sensor_context

from pipeline_assets.defs.landing.batches import register_new_batch
from pipeline_assets.defs.landing.sensors import landing_sensor
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets_tests.conftest import record, write_landing_file


def _tick(instance, resources):
    with build_sensor_context(
        instance=instance, resources={"landing": resources["landing"], "lake": resources["lake"]}
    ) as context:
        result = landing_sensor(context)
    if isinstance(result, SensorResult):  # what the daemon does with the partition requests
        for request in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
    return result


def test_first_tick_requests_one_run_for_one_batch(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(i) for i in range(3)])
    write_landing_file(landing_dir, "logs", "l.jsonl.gz", [record(i) for i in range(3)])
    write_landing_file(
        landing_dir, "logs", "_upload_in_progress.jsonl", [record(9)]
    )  # hidden: not data
    result = _tick(instance, resources)
    assert isinstance(result, SensorResult) and len(result.run_requests) == 1
    request = result.run_requests[0]
    assert request.run_key == request.partition_key
    assert instance.get_dynamic_partitions(ingest_batches.name) == [request.partition_key]
    manifest = resources["lake"].read("landing", "manifest")
    assert sorted(manifest["source"]) == ["annotate", "logs"]


def test_tick_with_nothing_new_requests_nothing(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1)])
    _tick(instance, resources)
    again = _tick(instance, resources)
    assert isinstance(again, SkipReason)
    assert resources["lake"].read("landing", "manifest").height == 1


def test_new_file_makes_a_new_batch(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1)])
    first = _tick(instance, resources).run_requests[0].partition_key
    write_landing_file(landing_dir, "annotate", "b.jsonl", [record(2)])
    second = _tick(instance, resources).run_requests[0].partition_key
    assert second > first
    manifest = resources["lake"].read("landing", "manifest").sort("batch_id")
    assert manifest.select("batch_id", "uri").rows() == [
        (first, str(landing_dir / "annotate" / "a.jsonl")),
        (second, str(landing_dir / "annotate" / "b.jsonl")),
    ]


def test_touched_file_is_not_reingested_and_changed_file_is_reported(
    instance, resources, landing_dir
):
    path = write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1)])
    first = _tick(instance, resources).run_requests[0].partition_key
    os.utime(path, ns=(1, 1))  # same bytes, new mtime
    assert isinstance(_tick(instance, resources), SkipReason)
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1), record(2)])
    result = _tick(instance, resources)
    assert len(result.run_requests) == 1 and result.run_requests[0].partition_key > first
    assert result.run_requests[0].tags["pipeline/changed_files"] == "annotate/a.jsonl"
    manifest = resources["lake"].read("landing", "manifest").sort("batch_id")
    assert manifest["previous_checksum"][1] == manifest["checksum"][0]


def test_interrupted_registration_is_completed_on_the_next_tick(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(1)])
    registration = register_new_batch(resources["landing"], resources["lake"], logging.getLogger())
    result = _tick(instance, resources)  # the manifest has the batch, the instance does not
    assert [r.partition_key for r in result.run_requests] == [registration.batch_id]
