"""A deterministic refusal is reported once, never retried: retries are for transient faults, and
a refusal retried three times with backoff reads as a crash."""

from __future__ import annotations

from dagster import DagsterEventType, materialize

from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.retries import TRANSIENT


def test_a_gold_shard_without_its_upstream_fails_once_with_the_reason(instance, resources):
    assert gold_sequences.op.retry_policy == TRANSIENT  # the step does retry transient faults
    instance.add_dynamic_partitions(ingest_batches.name, ["20261128T000000Z-000001"])
    result = materialize(
        [gold_tokenizer, gold_sequences],
        selection=[gold_sequences],
        partition_key="20261128T000000Z-000001",
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    assert not result.success
    events = [
        event.event_type
        for event in instance.all_logs(result.run_id)
        if event.dagster_event is not None
        for event in [event.dagster_event]
    ]
    assert DagsterEventType.STEP_UP_FOR_RETRY not in events
    [failure] = result.get_step_failure_events()
    assert failure.event_specific_data.error.message.startswith(
        "dagster._core.definitions.events.Failure: silver/records does not exist yet"
    )
