"""reference/quality_models as an observed source: a changed scorer shows silver stale and the
backfill re-scores the batches done before; its sha256 is read again only when its files' listing
changed; a scorer on S3 is fetched once and keeps its s3:// URI."""

from __future__ import annotations

import hashlib
import json
import os
import random

import boto3
import polars as pl
from dagster import Definitions, RunRequest, SkipReason, build_sensor_context
from dagster._core.definitions.data_version import StaleStatus

from pipeline_assets.cli.backfill import backfill_decontamination
from pipeline_assets.cli.headless import run_stale
from pipeline_assets.cli.lineage import silver_quality_models
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.keys import REFERENCE_QUALITY_MODELS, SILVER_RECORDS
from pipeline_assets.defs.reference.assets import (
    eval_sets,
    observe_quality_models_job,
    observed_version,
    quality_models,
    quality_models_watcher,
)
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import silver_checks
from pipeline_assets.lib.gold.base_model import folder_sha256
from pipeline_assets.resources.quality_models import QualityModelsResource
from pipeline_assets_tests.conftest import BUCKET, record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register
from pipeline_assets_tests.defs.staleness import stale_status
from pipeline_assets_tests.fasttext_models import train_fasttext
from pipeline_assets_tests.lib.silver.test_scorers import classifier_folder

EXAMPLES = [
    ("item works by doing step one then step two", "__label__good"),
    ("buy cheap pills now click here", "__label__spam"),
]


def _fasttext_file(folder):
    folder.mkdir(parents=True, exist_ok=True)
    return train_fasttext(EXAMPLES, epochs=4).save(folder / "quality.bin")


def _records(rng: random.Random) -> list[dict]:
    words = [f"{stem}{i}" for stem in ("river", "stone", "cloud", "field") for i in range(300)]
    return [record(i, response=" ".join(rng.choice(words) for _ in range(30))) for i in range(8)]


def _scorers(model: str, label: str = "good") -> str:
    return json.dumps([{"name": "good", "model": model, "label": label}])


def _defs(resources) -> Definitions:
    return Definitions(
        assets=[eval_sets, quality_models, bronze, silver],
        asset_checks=[*bronze_checks, *silver_checks],
        jobs=[observe_quality_models_job],
        resources=resources,
    )


def _watcher_says(instance, resource: QualityModelsResource):
    with build_sensor_context(instance=instance, resources={"quality_models": resource}) as context:
        return quality_models_watcher(context)


def _observe(instance, resource: QualityModelsResource):
    defs = Definitions(
        assets=[quality_models],
        jobs=[observe_quality_models_job],
        resources={"quality_models": resource},
    )
    return defs.resolve_job_def(observe_quality_models_job.name).execute_in_process(
        instance=instance, raise_on_error=False
    )


def test_a_new_scorer_shows_silver_stale_and_the_backfill_rescores_its_batch(
    instance, resources, landing_dir, tmp_path
):
    write_landing_file(landing_dir, "logs", "part-0.jsonl", _records(random.Random(5)))
    batch = register(instance, resources)
    assert not run_stale(_defs(resources), instance, None).failed_runs
    assert stale_status(_defs(resources), instance, SILVER_RECORDS, batch)[0] == StaleStatus.FRESH
    assert isinstance(_watcher_says(instance, resources["quality_models"]), SkipReason)
    first = resources["lake"].read("silver", "records")
    assert first.height and "score_good" not in first.columns

    scorer = _fasttext_file(tmp_path / "models")
    resources = {**resources, "quality_models": QualityModelsResource(models=_scorers(str(scorer)))}
    defs = _defs(resources)
    assert isinstance(_watcher_says(instance, resources["quality_models"]), RunRequest)
    assert _observe(instance, resources["quality_models"]).success  # the daemon's run
    status, causes = stale_status(defs, instance, SILVER_RECORDS, batch)
    assert status == StaleStatus.STALE
    assert [cause.key.asset_key for cause in causes] == [REFERENCE_QUALITY_MODELS]

    scored_before = resources["lake"].version("silver", "records")
    outcome = backfill_decontamination(defs, instance)
    assert outcome.ok, outcome.failed_runs + outcome.failed_blocking_checks
    [run] = [instance.get_run_by_id(run_id) for run_id in outcome.runs]
    assert run.tags["dagster/partition"] == batch and SILVER_RECORDS in run.asset_selection
    kept = resources["lake"].read("silver", "records", where=pl.col("batch_id") == batch)
    assert kept.height and kept["score_good"].is_not_null().all()
    [materialized] = instance.fetch_materializations(SILVER_RECORDS, limit=1).records
    identities = materialized.asset_materialization.metadata["quality_models"].value
    assert [(m["name"], m["model"]) for m in identities][1:] == [("good", str(scorer))]
    assert identities[1]["sha256"] == hashlib.sha256(scorer.read_bytes()).hexdigest()
    assert stale_status(defs, instance, SILVER_RECORDS, batch)[0] == StaleStatus.FRESH
    assert backfill_decontamination(defs, instance).runs == [], "scored by these models already"

    # lineage: the models a batch was scored with at the silver version a snapshot pinned
    def lineage_at(version):
        table = {"table": "silver/records", "version": version, "batches": [batch]}
        [entry] = silver_quality_models(instance, table)
        return [model["name"] for model in entry["models"]]

    assert lineage_at(scored_before) == ["language"]
    assert lineage_at(resources["lake"].version("silver", "records")) == ["language", "good"]


def test_the_sha256_is_read_again_only_when_the_files_listing_changed(tmp_path):
    scorer = _fasttext_file(tmp_path / "models")
    resource = QualityModelsResource(
        models=_scorers(str(scorer)), cache_dir=str(tmp_path / "cache")
    )
    first = resource.identities()[1]["sha256"]
    assert first == hashlib.sha256(scorer.read_bytes()).hexdigest()

    stat, data = scorer.stat(), bytearray(scorer.read_bytes())
    data[-1] ^= 1  # the same size and, restored below, the same time: the listing is unchanged
    scorer.write_bytes(bytes(data))
    os.utime(scorer, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert resource.identities()[1]["sha256"] == first, "read from the cache"

    os.utime(scorer, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert resource.identities()[1]["sha256"] == hashlib.sha256(data).hexdigest() != first


def test_scorers_on_s3_are_fetched_once_and_keep_their_s3_uri(instance, tmp_path, s3_endpoint):
    scorer = _fasttext_file(tmp_path / "models")
    client = boto3.client("s3")
    client.upload_file(str(scorer), BUCKET, "scorers/quality.bin")
    uri = f"s3://{BUCKET}/scorers/quality.bin"
    resource = QualityModelsResource(models=_scorers(uri), cache_dir=str(tmp_path / "cache"))
    assert _observe(instance, resource).success
    assert observed_version(instance, REFERENCE_QUALITY_MODELS) == resource.fingerprint()
    [local] = resource.local_specs()
    assert local.model.startswith(str(tmp_path / "cache")) and local.model.endswith("quality.bin")
    fetched_at = os.stat(local.model).st_mtime_ns
    [identity] = resource.identities()[1:]
    assert identity["model"] == uri
    assert identity["sha256"] == hashlib.sha256(scorer.read_bytes()).hexdigest()
    assert os.stat(resource.local_specs()[0].model).st_mtime_ns == fetched_at, "fetched again"
    assert isinstance(_watcher_says(instance, resource), SkipReason)

    classifier = classifier_folder(tmp_path / "reward", num_labels=1)
    for file in classifier.iterdir():
        client.upload_file(str(file), BUCKET, f"scorers/reward/{file.name}")
    folder_uri = f"s3://{BUCKET}/scorers/reward/"
    both = QualityModelsResource(
        models=json.dumps([{"name": "reward", "model": folder_uri}]),
        cache_dir=str(tmp_path / "cache"),
    )
    [reward] = both.checked_specs()
    fetched = sorted(name for name in os.listdir(reward.model) if not name.startswith("."))
    assert fetched == sorted(os.listdir(classifier))
    [identity] = both.identities()[1:]
    assert identity["model"] == folder_uri and identity["sha256"] == folder_sha256(classifier)

    wrong_label = QualityModelsResource(
        models=_scorers(uri, label="great"), cache_dir=str(tmp_path / "cache")
    )
    assert isinstance(_watcher_says(instance, wrong_label), RunRequest)
    result = _observe(instance, wrong_label)
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.user_failure_data.description
    assert "PIPELINE_QUALITY_MODELS" in message and "'label' must be one of" in message
