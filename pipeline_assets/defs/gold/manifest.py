"""gold/snapshots: cutting a data snapshot writes one manifest row listing the gold shards it holds.
Nothing is tokenized or packed here; a snapshot becomes a ``data_snapshots`` partition, which the
training assets take."""

from datetime import datetime, timezone

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    DagsterInstance,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from pipeline_assets.contracts import GoldSnapshotManifest, conform, polars_schema, validate
from pipeline_assets.defs.gold.cadence import SNAPSHOT_REASON_TAG, ShardStates, shard_states
from pipeline_assets.defs.gold.checks import SNAPSHOT_CHECK_SPECS, SnapshotLengths, judge_snapshot
from pipeline_assets.defs.keys import GOLD_SEQUENCES, GOLD_SNAPSHOTS, GOLD_TOKENIZER
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.lib.snapshot_manifest import (
    MANIFEST_TABLE,
    SEQUENCES_TABLE,
    Manifest,
    read_manifest,
    sequences_scan,
    shard_counts,
    snapshot_number,
)
from pipeline_assets.resources import DeltaCommit, GoldPolicy, LakeResource


@asset(
    key=GOLD_SNAPSHOTS,
    group_name="gold",
    deps=[AssetDep(GOLD_SEQUENCES, partition_mapping=AllPartitionMapping()), GOLD_TOKENIZER],
    kinds={"delta"},
    check_specs=SNAPSHOT_CHECK_SPECS,
    retry_policy=TRANSIENT,
    description="Data snapshot manifests: each materialization appends one row, gold-v<N> (N its Delta version), "
    "naming the batch shards of gold/sequences it holds and the Delta version they are read at, and adds the "
    "data_snapshots partition the training assets take. Cut on a cadence (the snapshot_cadence sensor), on the "
    "snapshot schedule, or by hand; cutting re-tokenizes nothing.",
)
def gold_snapshots(context: AssetExecutionContext, lake: LakeResource, gold_policy: GoldPolicy) -> MaterializeResult:
    stopwatch = Stopwatch()
    tokenizer_version = lake.version("gold", "tokenizer")
    states = shard_states(context.instance, tokenizer_version)
    for batch, reason in states.left_out.items():
        context.log.warning(f"left out batch {batch}: {reason}")
    if states.stale:
        context.log.warning(f"left out {len(states.stale)} shard(s) encoded by an older gold/tokenizer than "
                            f"v{tokenizer_version}, until they are rebuilt: {', '.join(states.stale)}")
    if not states.usable:
        raise Failure(allow_retries=False, description="no gold shard to cut a snapshot from: "
                      f"{len(states.left_out)} left out, {len(states.stale)} waiting for a rebuild with the current tokenizer")
    reason = context.run.tags.get(SNAPSHOT_REASON_TAG, "requested by hand")
    manifest, commit = cut_manifest(lake, sorted(states.usable), tokenizer_version, _one_seq_len(states), reason)
    previous = _previous_snapshot(context.instance, lake)
    judged = SnapshotLengths.of(manifest.key, sequences_scan(lake.uri, manifest), manifest.seq_len)
    context.instance.add_dynamic_partitions(data_snapshots.name, [manifest.key])
    shards = states.usable.values()
    context.log.info(f"data snapshot {manifest.key} ({reason}): {len(manifest.batches)} shard(s) of gold/sequences "
                     f"v{manifest.sequences_version}, {manifest.sequences_by_split()} sequences")
    return MaterializeResult(
        metadata={
            **delta_write_metadata(commit, polars_schema(GoldSnapshotManifest),
                                   upstream_versions={"gold/sequences": manifest.sequences_version,
                                                      "gold/tokenizer": tokenizer_version},
                                   input_bytes=0, stopwatch=stopwatch),
            "data_snapshot": manifest.key,
            "snapshot_reason": reason,
            "tokenizer_version": tokenizer_version,
            "batches": MetadataValue.json(list(manifest.batches)),
            "batches_left_out": MetadataValue.json({**states.left_out, **{b: "older tokenizer" for b in states.stale}}),
            "sequences_by_split": MetadataValue.json(manifest.sequences_by_split()),
            "real_tokens": judged.real_tokens,
            "tokens": sum(int(s.metadata.get("tokens", 0)) for s in shards),
            "validation_tokens": sum(int(s.metadata.get("validation_tokens", 0)) for s in shards),
            "search_tokens": sum(int(s.metadata.get("search_tokens", 0)) for s in shards),
            "input_chars": sum(int(s.metadata.get("input_chars", 0)) for s in shards),
        },
        check_results=judge_snapshot(judged, previous, gold_policy),
    )


def _one_seq_len(states: ShardStates) -> int:
    lengths = {batch: shard.metadata.get("seq_len") for batch, shard in states.usable.items()}
    if len(set(lengths.values())) != 1:
        raise Failure(allow_retries=False, description=f"the shards were packed to different sequence lengths {lengths}: "
                      "rebuild the odd ones (materialize their gold/sequences partitions) with one PIPELINE_SEQ_LEN")
    return int(next(iter(lengths.values())))


def cut_manifest(lake: LakeResource, batches: list[str], tokenizer_version: int, seq_len: int,
                 reason: str) -> tuple[Manifest, DeltaCommit]:
    """Append the next manifest row for these batches' shards at gold/sequences' current version. One
    cut at a time: row N must be version N of gold/snapshots."""
    with lake.lock(*MANIFEST_TABLE):
        sequences_version = lake.version(*SEQUENCES_TABLE)
        if sequences_version is None:
            raise ValueError("gold/sequences does not exist yet: materialize a batch's shard first")
        counts = shard_counts(lake.scan(*SEQUENCES_TABLE, sequences_version), batches)
        if not counts.is_empty() and set(counts["tokenizer_version"]) != {tokenizer_version}:
            raise Failure(allow_retries=False, description=f"gold/sequences v{sequences_version} holds shards of "
                          f"{sorted(set(counts['tokenizer_version']))} tokenizer versions, expected only v{tokenizer_version}")
        last = lake.version(*MANIFEST_TABLE)
        number = 0 if last is None else last + 1
        manifest = Manifest.from_counts(number, sequences_version, tokenizer_version, seq_len, batches, counts)
        row = validate(conform(manifest.frame(reason, datetime.now(timezone.utc)), GoldSnapshotManifest), GoldSnapshotManifest)
        commit = lake.append(*MANIFEST_TABLE, row)
    if commit.version != number:
        raise RuntimeError(f"gold/snapshots: row {number} landed in version {commit.version}: another writer "
                           "bypassed the table's lock")
    return manifest, commit


def _previous_snapshot(instance: DagsterInstance, lake: LakeResource) -> SnapshotLengths | None:
    """The newest snapshot before this one: what drift and volume compare with."""
    keys = instance.get_dynamic_partitions(data_snapshots.name)
    if not keys:
        return None
    manifest = read_manifest(lake.uri, max(snapshot_number(key) for key in keys))
    return SnapshotLengths.of(manifest.key, sequences_scan(lake.uri, manifest), manifest.seq_len)
