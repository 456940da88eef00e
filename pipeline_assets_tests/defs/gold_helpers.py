"""Build gold the way the pipeline does: the tokenizer, each batch's shard, then a snapshot cut."""

from __future__ import annotations

from dataclasses import dataclass, field

from dagster import materialize

from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer
from pipeline_assets.defs.gold.manifest import gold_snapshots
from pipeline_assets.defs.partitions import ingest_batches

GOLD = [gold_tokenizer, gold_sequences, gold_snapshots]


@dataclass
class GoldRuns:
    tokenizer: object | None = None
    shards: dict = field(default_factory=dict)  # batch -> result
    cut: object | None = None

    @property
    def success(self) -> bool:
        runs = [self.tokenizer, *self.shards.values(), self.cut]
        return all(run.success for run in runs if run is not None)


def build_tokenizer(instance, resources, upstream):
    return materialize(
        [*upstream, *GOLD],
        selection=[gold_tokenizer],
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )


def build_shards(instance, resources, upstream, batches: list[str] | None = None) -> dict:
    batches = (
        batches if batches is not None else instance.get_dynamic_partitions(ingest_batches.name)
    )
    return {
        batch: materialize(
            [*upstream, *GOLD],
            selection=[gold_sequences],
            partition_key=batch,
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )
        for batch in batches
    }


def cut_snapshot(instance, resources, upstream, tags: dict | None = None):
    return materialize(
        [*upstream, *GOLD],
        selection=[gold_snapshots],
        instance=instance,
        resources=resources,
        raise_on_error=False,
        tags=tags,
    )


def build_gold(
    instance, resources, upstream, batches: list[str] | None = None, tags: dict | None = None
) -> GoldRuns:
    """The tokenizer, every (or these) batch's shard, and a snapshot of them; stops at the
    first failure."""
    runs = GoldRuns(tokenizer=build_tokenizer(instance, resources, upstream))
    if not runs.success:
        return runs
    runs.shards = build_shards(instance, resources, upstream, batches)
    if runs.success:
        runs.cut = cut_snapshot(instance, resources, upstream, tags)
    return runs


def shard_new_batches_and_cut(instance, resources, upstream, tags: dict | None = None):
    """Each batch without a shard yet gets one, then a snapshot is cut (what the pipeline does after
    new data)."""
    built = instance.get_materialized_partitions(gold_sequences.key)
    new = [b for b in instance.get_dynamic_partitions(ingest_batches.name) if b not in built]
    shards = build_shards(instance, resources, upstream, new)
    assert all(result.success for result in shards.values())
    return cut_snapshot(instance, resources, upstream, tags)
