"""Partitions shared by the layers, and the batch manifest: the landing files of each ingest batch,
written by the landing sensor and read by bronze."""

import polars as pl
from dagster import DynamicPartitionsDefinition

from pipeline_assets.lib.gold.manifest import snapshot_key, snapshot_number
from pipeline_assets.resources.lake import LakeResource

# One partition per ingest batch; keys sort in arrival order (see lib.landing.batches.batch_key).
ingest_batches = DynamicPartitionsDefinition(name="ingest_batches")

# One partition per data snapshot, "gold-v<N>" (row N of gold/snapshots): training on it reads
# exactly the shards and versions its manifest names.
data_snapshots = DynamicPartitionsDefinition(name="data_snapshots")

# One partition per preference snapshot, "dpo-v<N>" (row N of gold/preference_snapshots).
preference_snapshots = DynamicPartitionsDefinition(name="preference_snapshots")

BATCH_MANIFEST_TABLE = ("landing", "manifest")


def read_batch_manifest(lake: LakeResource) -> pl.DataFrame | None:
    return lake.read(*BATCH_MANIFEST_TABLE)


__all__ = [
    "BATCH_MANIFEST_TABLE",
    "read_batch_manifest",
    "data_snapshots",
    "ingest_batches",
    "preference_snapshots",
    "snapshot_key",
    "snapshot_number",
]
