"""gold/snapshots and gold/preference_snapshots: cutting a data snapshot writes one manifest row
listing the gold shards it holds. Nothing is tokenized or packed here; a snapshot becomes a
partition (``data_snapshots``: gold-v<N>, ``preference_snapshots``: dpo-v<N>), which the training
assets take. Both assets come from one factory."""

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
from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.gold.cadence import (
    PREFERENCE_SERIES,
    SFT_SERIES,
    SNAPSHOT_REASON_TAG,
    ShardStates,
    SnapshotSeries,
    shard_states,
)
from pipeline_assets.defs.gold.checks import SnapshotLengths, judge_snapshot, snapshot_check_specs
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import GOLD_TOKENIZER
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata
from pipeline_assets.defs.retries import TRANSIENT, refusal
from pipeline_assets.lib.gold.manifest import (
    SFT_SNAPSHOTS,
    Manifest,
    SnapshotKind,
    read_manifest,
    sequences_scan,
    shard_counts,
    snapshot_number,
)
from pipeline_assets.resources.lake import DeltaCommit, LakeResource


def snapshot_asset(series: SnapshotSeries, description: str):
    """The asset that cuts the series' snapshots: one manifest row a materialization."""

    @asset(
        key=series.snapshots,
        group_name="gold",
        deps=[AssetDep(series.shards, partition_mapping=AllPartitionMapping()), GOLD_TOKENIZER],
        kinds={"delta"},
        check_specs=snapshot_check_specs(series.snapshots),
        retry_policy=TRANSIENT,
        description=description,
    )
    def cut(
        context: AssetExecutionContext,
        lake: LakeResource,
        gold_policy: GoldPolicy,
        batch_gates: BatchGates,
    ) -> MaterializeResult:
        return cut_snapshot(context, lake, gold_policy, batch_gates, series)

    return cut


gold_snapshots = snapshot_asset(
    SFT_SERIES,
    (
        "Data snapshot manifests: each materialization appends one row, gold-v<N> (N its Delta "
        "version), naming the batch shards of gold/sequences it holds and the Delta version they "
        "are read at, and adds the data_snapshots partition the training assets take. Cut on a "
        "cadence (the snapshot_cadence sensor), on the snapshot schedule, or by hand; cutting "
        "re-tokenizes nothing."
    ),
)
gold_preference_snapshots = snapshot_asset(
    PREFERENCE_SERIES,
    (
        "Preference snapshot manifests: each materialization appends one row, dpo-v<N> (N its "
        "Delta version), naming the batch shards of gold/preference_sequences it holds, and adds "
        "the preference_snapshots partition DPO training takes. Cut on a cadence (the "
        "preference_snapshot_cadence sensor) or by hand."
    ),
)


def cut_snapshot(
    context: AssetExecutionContext,
    lake: LakeResource,
    gold_policy: GoldPolicy,
    batch_gates: BatchGates,
    series: SnapshotSeries,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    kind = series.kind
    tokenizer_version = lake.version("gold", "tokenizer")
    states = shard_states(context.instance, batch_gates, tokenizer_version, series)
    for batch, reason in states.left_out.items():
        context.log.warning(f"left out batch {batch}: {reason}")
    if states.stale:
        context.log.warning(
            f"left out {len(states.stale)} shard(s) encoded by an older gold/tokenizer than "
            f"v{tokenizer_version}, until they are rebuilt: {', '.join(states.stale)}"
        )
    if not states.usable:
        raise Failure(
            allow_retries=False,
            description=f"no {kind.sequences_name} shard to cut a snapshot from: "
            f"{len(states.left_out)} left out, {len(states.stale)} waiting for a rebuild with the "
            "current tokenizer",
        )
    reason = context.run.tags.get(SNAPSHOT_REASON_TAG, "requested by hand")
    manifest, commit = cut_manifest(
        lake, sorted(states.usable), tokenizer_version, _one_seq_len(states), reason, kind
    )
    previous = _previous_snapshot(context.instance, lake, series)
    judged = SnapshotLengths.of(manifest.key, sequences_scan(lake.uri, manifest), manifest.seq_len)
    context.instance.add_dynamic_partitions(series.partitions.name, [manifest.key])
    shards = states.usable.values()
    context.log.info(
        f"data snapshot {manifest.key} ({reason}): {len(manifest.batches)} shard(s) of "
        f"{kind.sequences_name} v{manifest.sequences_version}, {manifest.sequences_by_split()} "
        "sequences"
    )
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(GoldSnapshotManifest),
                upstream_versions={
                    kind.sequences_name: manifest.sequences_version,
                    "gold/tokenizer": tokenizer_version,
                },
                input_bytes=0,
                stopwatch=stopwatch,
            ),
            "data_snapshot": manifest.key,
            "snapshot_reason": reason,
            "tokenizer_version": tokenizer_version,
            "batches": MetadataValue.json(list(manifest.batches)),
            "batches_left_out": MetadataValue.json(
                {**states.left_out, **{b: "older tokenizer" for b in states.stale}}
            ),
            "sequences_by_split": MetadataValue.json(manifest.sequences_by_split()),
            "real_tokens": judged.real_tokens,
            **{
                name: sum(int(s.metadata.get(name, 0)) for s in shards)
                for name in ("tokens", "validation_tokens", "search_tokens", "input_chars")
            },
        },
        check_results=judge_snapshot(judged, previous, gold_policy),
    )


def _one_seq_len(states: ShardStates) -> int:
    lengths = {batch: shard.metadata.get("seq_len") for batch, shard in states.usable.items()}
    if len(set(lengths.values())) != 1:
        raise Failure(
            allow_retries=False,
            description=f"the shards were packed to different sequence lengths {lengths}: "
            "rebuild the odd ones (materialize their shard partitions) with one PIPELINE_SEQ_LEN",
        )
    return int(next(iter(lengths.values())))


def cut_manifest(
    lake: LakeResource,
    batches: list[str],
    tokenizer_version: int,
    seq_len: int,
    reason: str,
    kind: SnapshotKind = SFT_SNAPSHOTS,
) -> tuple[Manifest, DeltaCommit]:
    """Append the next manifest row for these batches' shards at the shard table's current version.
    One cut at a time: row N must be version N of the manifest table."""
    with lake.lock(*kind.manifest_table):
        sequences_version = lake.version(*kind.sequences_table)
        if sequences_version is None:
            raise refusal(
                f"{kind.sequences_name} does not exist yet: materialize a batch's shard first"
            )
        counts = shard_counts(lake.scan(*kind.sequences_table, sequences_version), batches)
        if not counts.is_empty() and set(counts["tokenizer_version"]) != {tokenizer_version}:
            raise Failure(
                allow_retries=False,
                description=f"{kind.sequences_name} v{sequences_version} holds shards of "
                f"{sorted(set(counts['tokenizer_version']))} tokenizer versions, expected only "
                f"v{tokenizer_version}",
            )
        last = lake.version(*kind.manifest_table)
        number = 0 if last is None else last + 1
        manifest = Manifest.from_counts(
            number, sequences_version, tokenizer_version, seq_len, batches, counts, kind
        )
        row = validate(
            conform(manifest.frame(reason, datetime.now(timezone.utc)), GoldSnapshotManifest),
            GoldSnapshotManifest,
        )
        commit = lake.append(*kind.manifest_table, row)
    if commit.version != number:
        raise RuntimeError(
            f"{kind.manifest_name}: row {number} landed in version {commit.version}: another "
            "writer bypassed the table's lock"
        )
    return manifest, commit


def _previous_snapshot(
    instance: DagsterInstance, lake: LakeResource, series: SnapshotSeries
) -> SnapshotLengths | None:
    """The newest snapshot of the series before this one: what drift and volume compare with."""
    keys = instance.get_dynamic_partitions(series.partitions.name)
    if not keys:
        return None
    manifest = read_manifest(
        lake.uri, max(snapshot_number(key, series.kind) for key in keys), series.kind
    )
    return SnapshotLengths.of(manifest.key, sequences_scan(lake.uri, manifest), manifest.seq_len)
