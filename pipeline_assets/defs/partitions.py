"""Partitions shared by the layers."""

from dagster import DynamicPartitionsDefinition

from pipeline_assets.lib.gold.manifest import snapshot_key, snapshot_number

# One partition per ingest batch; keys sort in arrival order (see lib.landing.batches.batch_key).
ingest_batches = DynamicPartitionsDefinition(name="ingest_batches")

# One partition per data snapshot, "gold-v<N>" (row N of gold/snapshots): training on it reads
# exactly the shards and versions its manifest names.
data_snapshots = DynamicPartitionsDefinition(name="data_snapshots")

# One partition per preference snapshot, "dpo-v<N>" (row N of gold/preference_snapshots).
preference_snapshots = DynamicPartitionsDefinition(name="preference_snapshots")

__all__ = [
    "data_snapshots",
    "ingest_batches",
    "preference_snapshots",
    "snapshot_key",
    "snapshot_number",
]
