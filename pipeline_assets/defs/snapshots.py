"""What a data snapshot was built from, read back from the materializations that built it."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

from pipeline_assets.defs.format_tables import SFT_OBJECTIVE_TABLES
from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    GOLD_PREFERENCE_SEQUENCES,
    GOLD_SEQUENCES,
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
    SILVER_RECORDS,
)
from pipeline_assets.defs.partitions import snapshot_number
from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.ops.cost import Compute

_SEARCH_LIMIT = 1000


def plain_metadata(materialization) -> dict:
    """A materialization's metadata as plain values (numbers, strings, dicts), without Dagster's
    wrappers."""
    return {name: value.value for name, value in materialization.metadata.items()}


def materialization_history(
    instance: DagsterInstance, key: AssetKey, limit: int = 10_000
) -> list[dict]:
    """Plain metadata of every materialization of ``key``, newest first, each with its
    ``partition``."""
    return list(_history(instance, key, limit))


def _history(instance: DagsterInstance, key: AssetKey, limit: int) -> Iterator[dict]:
    for record in instance.fetch_materializations(key, limit=limit).records:
        yield {
            **plain_metadata(record.asset_materialization),
            "partition": record.asset_materialization.partition,
        }


def latest_records_by_partition(instance: DagsterInstance, key: AssetKey) -> dict[str, object]:
    """Per partition of ``key``, the event-log record of its latest materialization (storage id, run
    id, metadata)."""
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(
        key, DagsterEventType.ASSET_MATERIALIZATION
    )
    if not latest:
        return {}
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, storage_ids=list(latest.values())), limit=len(latest)
    ).records
    return {record.partition_key: record for record in records if record.partition_key}


def latest_per_partition(history: list[dict]) -> list[dict]:
    """The newest entry of each partition of a ``materialization_history``."""
    latest: dict[str | None, dict] = {}
    for metadata in history:
        latest.setdefault(metadata["partition"], metadata)
    return list(latest.values())


def latest_materialization_metadata(
    instance: DagsterInstance, key: AssetKey, matches: Callable[[dict], bool]
) -> dict | None:
    """Plain metadata values of the newest of the last thousand materializations of ``key`` that
    ``matches``."""
    return next((m for m in _history(instance, key, _SEARCH_LIMIT) if matches(m)), None)


@dataclass(frozen=True)
class Behind:
    """The materializations a snapshot was built from: its cut, and per batch its shard, silver and
    bronze writes."""

    cut: dict | None
    shards: list[dict]
    silver: list[dict]
    bronze: list[dict]


def behind_snapshot(instance: DagsterInstance, partition_key: str) -> Behind:
    """Per batch of the snapshot's manifest, the newest writes at or before the Delta versions it
    read."""
    cut = latest_materialization_metadata(
        instance, GOLD_SNAPSHOTS, lambda m: m.get("data_snapshot") == partition_key
    )
    if cut is None:
        return Behind(None, [], [], [])
    batches = set(cut.get("batches") or [])
    shards = _per_batch_at_or_before(
        instance, GOLD_SEQUENCES, _upstream(cut, "gold/sequences"), batches
    )
    silver = _per_batch_at_or_before(
        instance, SILVER_RECORDS, _newest_upstream(shards, "silver/records"), batches
    )
    bronze = _per_batch_at_or_before(
        instance, BRONZE_RECORDS, _newest_upstream(silver, "bronze/records"), batches
    )
    return Behind(cut, shards, silver, bronze)


def snapshot_versions(instance: DagsterInstance, partition_key: str) -> dict[str, int | None]:
    """Delta versions behind a snapshot: its manifest row (gold/snapshots), gold/sequences and
    gold/tokenizer as the manifest pins them, and for each format packed into its shards (sft
    records, conversations) the newest silver version its shards read and the newest bronze
    version those silver writes read."""
    behind = behind_snapshot(instance, partition_key)
    versions = {
        "gold/snapshots": snapshot_number(partition_key),
        "gold/sequences": _upstream(behind.cut, "gold/sequences"),
        "gold/tokenizer": _upstream(behind.cut, "gold/tokenizer"),
    }
    batches = set((behind.cut or {}).get("batches") or [])
    for tables in SFT_OBJECTIVE_TABLES:
        silver, bronze = tables.silver.to_user_string(), tables.bronze.to_user_string()
        if tables.fmt is SFT:
            writes = behind.silver
        else:  # a table of the shards' other formats, read only when they read it
            writes = _per_batch_at_or_before(
                instance, tables.silver, _newest_upstream(behind.shards, silver), batches
            )
        versions[silver] = _newest_upstream(behind.shards, silver)
        versions[bronze] = _newest_upstream(writes, bronze)
    return versions


def preference_pairs_version(
    instance: DagsterInstance, batches: set[str], sequences_version: int
) -> int | None:
    """The newest silver/preference_pairs version read by the shards of gold/preference_sequences a
    preference snapshot lists (those batches' writes at or before the version its manifest pins);
    None when unknown."""
    shards = _per_batch_at_or_before(
        instance, GOLD_PREFERENCE_SEQUENCES, sequences_version, batches
    )
    return _newest_upstream(shards, "silver/preference_pairs")


def _upstream(metadata: dict | None, table: str) -> int | None:
    return None if metadata is None else (metadata.get("upstream_delta_versions") or {}).get(table)


def _newest_upstream(writes: list[dict], table: str) -> int | None:
    return max((v for v in (_upstream(m, table) for m in writes) if v is not None), default=None)


def partition_metadata(instance: DagsterInstance, key: AssetKey, partition_key: str) -> dict | None:
    """Plain metadata values of the newest materialization of one partition of ``key``."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[partition_key]), limit=1
    ).records
    if not records:
        return None
    return plain_metadata(records[0].asset_materialization)


def data_compute_behind(instance: DagsterInstance, partition_key: str) -> Compute:
    """CPU and GPU seconds of the data stages behind a snapshot: bronze, silver and the gold shard
    of every batch it holds (the writes at the Delta versions it read), the tokenizer it used, and
    its cut."""
    behind = behind_snapshot(instance, partition_key)
    if behind.cut is None:
        return Compute()
    tokenizer = latest_materialization_metadata(
        instance,
        GOLD_TOKENIZER,
        lambda m: m.get("tokenizer_version") == behind.cut.get("tokenizer_version"),
    )
    stages = [
        *behind.bronze,
        *behind.silver,
        *behind.shards,
        *([tokenizer] if tokenizer else []),
        behind.cut,
    ]
    return Compute(
        sum(float(m.get("cpu_seconds") or 0) for m in stages),
        sum(float(m.get("gpu_seconds") or 0) for m in stages),
    )


def _per_batch_at_or_before(
    instance: DagsterInstance, key: AssetKey, version: int | None, batches: set[str]
) -> list[dict]:
    """Per batch of ``batches``, the newest write of ``key`` at or before Delta ``version``."""
    if version is None:
        return []
    found: dict[str, dict] = {}
    for metadata in materialization_history(instance, key):
        batch = metadata["partition"]
        if batch not in batches or metadata.get("delta_version", version + 1) > version:
            continue
        found.setdefault(batch, metadata)
    return list(found.values())
