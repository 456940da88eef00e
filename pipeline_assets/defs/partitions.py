"""Partitions shared by the layers."""

from dagster import DynamicPartitionsDefinition

# One partition per ingest batch; keys sort in arrival order (see lib.batches.batch_key).
ingest_batches = DynamicPartitionsDefinition(name="ingest_batches")

# One partition per gold Delta version, "gold-v<N>": training on it reads exactly that version.
data_snapshots = DynamicPartitionsDefinition(name="data_snapshots")


def snapshot_key(gold_version: int) -> str:
    return f"gold-v{gold_version}"



def snapshot_version(partition_key: str) -> int:
    """``gold-v<N>`` -> N."""
    prefix = "gold-v"
    if not partition_key.startswith(prefix) or not partition_key[len(prefix):].isdigit():
        raise ValueError(f"{partition_key!r} is not a data snapshot key (gold-v<N>)")
    return int(partition_key[len(prefix):])
