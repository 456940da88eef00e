"""Partitions shared by the layers."""

from dagster import DynamicPartitionsDefinition

# One partition per ingest batch; keys sort in arrival order (see lib.batches.batch_key).
ingest_batches = DynamicPartitionsDefinition(name="ingest_batches")
