"""Register a batch and materialize bronze (with its checks) the way the
sensor-triggered run does."""

from __future__ import annotations

import logging

import polars as pl
from dagster import AssetCheckEvaluation, materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.landing.batches import register_new_batch
from pipeline_assets.defs.partitions import ingest_batches

log = logging.getLogger("test")


def register(instance, resources) -> str:
    registration = register_new_batch(resources["landing"], resources["lake"], log)
    assert registration.batch_id is not None, "expected new landing files"
    instance.add_dynamic_partitions(ingest_batches.name, [registration.batch_id])
    return registration.batch_id


def materialize_bronze(instance, resources, batch_id: str, **overrides):
    return materialize(
        [bronze, *bronze_checks],
        partition_key=batch_id,
        instance=instance,
        resources={**resources, **overrides},
        raise_on_error=False,
    )


def checks_by_name(result) -> dict[str, AssetCheckEvaluation]:
    return {
        f"{e.asset_key.to_user_string()}:{e.check_name}": e
        for e in result.get_asset_check_evaluations()
    }


def batch_rows(lake, name: str, batch_id: str) -> pl.DataFrame:
    return lake.read("bronze", name, where=pl.col("batch_id") == batch_id)
