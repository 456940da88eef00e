"""reference/eval_sets as an observed source: a changed benchmark makes silver stale, and one
backfill re-decontaminates every silver batch, oldest first, before the next snapshot."""

from __future__ import annotations

import hashlib
import json
import random

import polars as pl
from dagster import Definitions, RunRequest, build_sensor_context
from dagster._core.definitions.data_version import StaleStatus

from pipeline_assets.cli.backfill import backfill_decontamination
from pipeline_assets.cli.headless import run_stale
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer, read_snapshot
from pipeline_assets.defs.gold.manifest import gold_snapshots
from pipeline_assets.defs.keys import REFERENCE_EVAL_SETS, SILVER_RECORDS
from pipeline_assets.defs.reference.assets import (
    eval_sets,
    eval_sets_watcher,
    observe_eval_sets_job,
)
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.defs.silver.sensors import silver_job
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register
from pipeline_assets_tests.defs.staleness import stale_status

UNRELATED = {
    "eval_set": "bench",
    "item_id": "b0",
    "prompt": "Name the largest planet of the solar system, please.",
    "response": "Jupiter is the largest planet of the solar system by mass and by volume alike.",
}


def _defs(resources) -> Definitions:
    return Definitions(
        assets=[eval_sets, bronze, silver, gold_tokenizer, gold_sequences, gold_snapshots],
        asset_checks=[*bronze_checks, *silver_checks],
        jobs=[observe_eval_sets_job, silver_job],
        sensors=[eval_sets_watcher],
        resources=resources,
    )


def _records(rng: random.Random, start: int) -> list[dict]:
    words = [f"{stem}{i}" for stem in ("river", "stone", "cloud", "field") for i in range(300)]
    return [
        record(start + j, response=" ".join(rng.choice(words) for _ in range(30)))
        for j in range(40)
    ]


def _write_eval_items(folder, items: list[dict]) -> str:
    data = b"".join(json.dumps(item).encode() + b"\n" for item in items)
    (folder / "bench.jsonl").write_bytes(data)
    return hashlib.sha256(b"bench.jsonl\0" + hashlib.sha256(data).digest()).hexdigest()


def _observed_version(instance) -> str:
    [observation] = instance.fetch_observations(REFERENCE_EVAL_SETS, limit=1).records
    return observation.asset_observation.tags["dagster/data_version"]


def _silver_status(defs, instance, batch):
    return stale_status(defs, instance, SILVER_RECORDS, batch)


def _watcher_says(instance, resources):
    with build_sensor_context(
        instance=instance, resources={"eval_sets": resources["eval_sets"]}
    ) as context:
        return eval_sets_watcher(context)


def test_a_new_eval_item_makes_silver_stale_and_the_backfill_removes_its_copy(
    instance, resources, landing_dir, eval_sets_dir
):
    defs, lake, rng = _defs(resources), resources["lake"], random.Random(3)
    first_version = _write_eval_items(eval_sets_dir, [UNRELATED])
    batches = []
    for start in (0, 100):
        write_landing_file(landing_dir, "logs", f"part-{start}.jsonl", _records(rng, start))
        batches.append(register(instance, resources))
    outcome = run_stale(defs, instance, None)  # pipeline-assets run: observes the eval sets first
    assert not outcome.failed_runs, outcome.failed_runs
    assert _observed_version(instance) == first_version
    assert _silver_status(defs, instance, batches[0])[0] == StaleStatus.FRESH
    assert not isinstance(_watcher_says(instance, resources), RunRequest), (
        "nothing changed: nothing to observe"
    )

    silver_rows = lake.read("silver", "records", where=pl.col("batch_id") == batches[0])
    copied = silver_rows.row(0, named=True)
    assert copied["record_id"] in set(read_snapshot(lake, "gold-v0")["record_ids"].explode())
    copy = {
        "eval_set": "bench",
        "item_id": "b1",
        "prompt": copied["prompt"],
        "response": copied["response"],
    }
    new_version = _write_eval_items(eval_sets_dir, [UNRELATED, copy])

    request = _watcher_says(instance, resources)
    assert (
        isinstance(request, RunRequest) and eval_sets_watcher.job_name == observe_eval_sets_job.name
    )
    assert (
        defs.resolve_job_def(eval_sets_watcher.job_name)
        .execute_in_process(instance=instance)
        .success
    )  # the daemon's run
    assert _observed_version(instance) == new_version != first_version
    status, causes = _silver_status(defs, instance, batches[0])
    assert status == StaleStatus.STALE
    assert [cause.key.asset_key for cause in causes] == [REFERENCE_EVAL_SETS]

    snapshots_before = lake.version("gold", "snapshots")
    outcome = backfill_decontamination(defs, instance)
    assert outcome.ok, outcome.failed_runs + outcome.failed_blocking_checks
    runs = [instance.get_run_by_id(run) for run in outcome.runs]
    assert [sorted(key.to_user_string() for key in run.asset_selection) for run in runs] == [
        *[
            [
                "silver/conversations",
                "silver/minhash_bands",
                "silver/minhash_index",
                "silver/preference_pairs",
                "silver/records",
                "silver/rejects",
            ]
        ]
        * 2,
        *[["gold/sequences"]] * 2,
        ["gold/snapshots"],
    ], "observed already: no new observation"
    assert [run.tags.get("dagster/partition") for run in runs[:4]] == batches * 2, (
        "batch by batch, oldest first: silver, then shards"
    )

    rejected = lake.read("silver", "rejects", where=pl.col("record_id") == copied["record_id"])
    assert rejected.select("stage", "eval_set", "eval_item_id").rows() == [
        ("decontaminated", "bench", "b1")
    ]
    assert copied["record_id"] not in set(lake.read("silver", "records")["record_id"])
    assert lake.version("gold", "snapshots") == snapshots_before + 1
    assert copied["record_id"] not in set(
        read_snapshot(lake, f"gold-v{snapshots_before + 1}")["record_ids"].explode()
    )
    assert all(_silver_status(defs, instance, batch)[0] == StaleStatus.FRESH for batch in batches)
    assert backfill_decontamination(defs, instance).runs == [], (
        "every batch is decontaminated against these sets"
    )
