"""What the instance says about gold shards: which a snapshot can hold, and whether one is due
(lib.gold.cadence).

Two series of snapshots come from the same code: the sft records' (gold/sequences shards,
gold/snapshots manifests, gold-v<N>) and the preference pairs' (gold/preference_sequences,
gold/preference_snapshots, dpo-v<N>).
"""

from dataclasses import dataclass

from dagster import AssetCheckSpec, AssetKey, DagsterInstance, DynamicPartitionsDefinition

from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.check_helpers import partitions_failing
from pipeline_assets.defs.gold.checks import PREFERENCE_SHARD_CHECK_SPECS, SHARD_CHECK_SPECS
from pipeline_assets.defs.keys import (
    GOLD_PREFERENCE_SEQUENCES,
    GOLD_PREFERENCE_SNAPSHOTS,
    GOLD_SEQUENCES,
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
)
from pipeline_assets.defs.partitions import data_snapshots, preference_snapshots
from pipeline_assets.defs.snapshots import (
    latest_materialization_metadata,
    latest_records_by_partition,
    plain_metadata,
)
from pipeline_assets.lib.gold.cadence import CadenceInputs, lacks_a_split, snapshot_due
from pipeline_assets.lib.gold.manifest import PREFERENCE_SNAPSHOTS, SFT_SNAPSHOTS, SnapshotKind

SNAPSHOT_REASON_TAG = (
    "pipeline/snapshot_reason"  # why a run cuts a snapshot; gold/snapshots records it
)


@dataclass(frozen=True)
class SnapshotSeries:
    """One series of snapshots: the shards it cuts from, its manifests' asset and its partitions."""

    kind: SnapshotKind
    shards: AssetKey
    shard_checks: list[AssetCheckSpec]
    snapshots: AssetKey
    partitions: DynamicPartitionsDefinition


SFT_SERIES = SnapshotSeries(
    SFT_SNAPSHOTS, GOLD_SEQUENCES, SHARD_CHECK_SPECS, GOLD_SNAPSHOTS, data_snapshots
)
PREFERENCE_SERIES = SnapshotSeries(
    PREFERENCE_SNAPSHOTS,
    GOLD_PREFERENCE_SEQUENCES,
    PREFERENCE_SHARD_CHECK_SPECS,
    GOLD_PREFERENCE_SNAPSHOTS,
    preference_snapshots,
)


@dataclass(frozen=True)
class Shard:
    """One batch's latest gold/sequences write, as the instance recorded it."""

    batch: str
    storage_id: int
    tokenizer_version: int | None
    sequences: int
    metadata: dict


@dataclass(frozen=True)
class ShardStates:
    """Every batch's shard, sorted into those a snapshot can hold and those it cannot (with why)."""

    usable: dict[str, Shard]
    left_out: dict[str, str]  # batch -> reason
    stale: dict[
        str, Shard
    ]  # usable but encoded by another tokenizer version: they wait for their rebuild


def shard_states(
    instance: DagsterInstance,
    gates: BatchGates,
    tokenizer_version: int | None,
    series: SnapshotSeries = SFT_SERIES,
) -> ShardStates:
    """A shard is usable when its blocking checks and its batch's (bronze, silver) passed, it holds
    rows, and it was encoded by ``tokenizer_version``."""
    failing = {batch for batch, _ in partitions_failing(instance, series.shard_checks)}
    blocked = gates.blocked(instance)
    usable, left_out, stale = {}, {}, {}
    for batch, record in sorted(latest_records_by_partition(instance, series.shards).items()):
        metadata = plain_metadata(record.asset_materialization)
        shard = Shard(
            batch,
            record.storage_id,
            metadata.get("tokenizer_version"),
            int(metadata.get("sequences", 0)),
            metadata,
        )
        if batch in blocked:
            left_out[batch] = "a blocking check on its bronze or silver failed"
        elif batch in failing:
            left_out[batch] = "a blocking check on its shard failed"
        elif shard.sequences == 0:
            left_out[batch] = "no sequences (no silver record left in the batch)"
        elif shard.tokenizer_version != tokenizer_version:
            stale[batch] = shard
        else:
            usable[batch] = shard
    return ShardStates(usable, left_out, stale)


@dataclass(frozen=True)
class SnapshotDecision:
    due: bool
    reason: str
    state: str  # names what was judged (the newest shard write), so one state asks once


def snapshot_decision(
    instance: DagsterInstance,
    gates: BatchGates,
    min_new_fraction: float,
    series: SnapshotSeries = SFT_SERIES,
) -> SnapshotDecision:
    tokenizer = latest_materialization_metadata(instance, GOLD_TOKENIZER, lambda m: True)
    if tokenizer is None:
        return SnapshotDecision(False, "gold/tokenizer is not built yet", "")
    states = shard_states(instance, gates, tokenizer.get("tokenizer_version"), series)
    shards = (*states.usable.values(), *states.stale.values())
    state = f"shards-{max((s.storage_id for s in shards), default=0)}"
    if states.stale:
        return SnapshotDecision(
            False,
            f"{len(states.stale)} shard(s) still encoded by an older gold/tokenizer than "
            f"v{tokenizer.get('tokenizer_version')}: waiting for their rebuild",
            state,
        )
    last_cut = instance.fetch_materializations(series.snapshots, limit=1).records
    since = last_cut[0].storage_id if last_cut else -1
    changed = {
        batch: int(shard.metadata.get("real_tokens", 0))
        for batch, shard in states.usable.items()
        if shard.storage_id > since
    }
    last = None if not last_cut else last_cut[0].asset_materialization
    last_key = None if last is None else last.metadata["data_snapshot"].value
    last_tokens = 0 if last is None else int(last.metadata["real_tokens"].value)
    lacking = lacks_a_split(_sequences_by_split(states.usable.values()))
    if changed and lacking:
        return SnapshotDecision(False, lacking, state)
    due, reason = snapshot_due(CadenceInputs(changed, last_key, last_tokens), min_new_fraction)
    return SnapshotDecision(due, reason, state)


def _sequences_by_split(shards) -> dict[str, int]:
    """Sequences per split over the shards' materializations."""
    total: dict[str, int] = {}
    for shard in shards:
        for split, n in (shard.metadata.get("sequences_by_split") or {}).items():
            total[split] = total.get(split, 0) + int(n)
    return total
