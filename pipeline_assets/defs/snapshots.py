"""What a data snapshot was built from, read back from the materializations that built it."""

from collections.abc import Callable, Iterator

from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

from pipeline_assets.defs.keys import BRONZE_RECORDS, GOLD_SEQUENCES, GOLD_TOKENIZER, SILVER_RECORDS
from pipeline_assets.defs.partitions import snapshot_version
from pipeline_assets.lib.cost import Compute

_SEARCH_LIMIT = 1000


def plain_metadata(materialization) -> dict:
    """A materialization's metadata as plain values (numbers, strings, dicts), without Dagster's wrappers."""
    return {name: value.value for name, value in materialization.metadata.items()}


def materialization_history(instance: DagsterInstance, key: AssetKey, limit: int = 10_000) -> list[dict]:
    """Plain metadata of every materialization of ``key``, newest first, each with its ``partition``."""
    return list(_history(instance, key, limit))


def _history(instance: DagsterInstance, key: AssetKey, limit: int) -> Iterator[dict]:
    for record in instance.fetch_materializations(key, limit=limit).records:
        yield {**plain_metadata(record.asset_materialization), "partition": record.asset_materialization.partition}


def latest_records_by_partition(instance: DagsterInstance, key: AssetKey) -> dict[str, object]:
    """Per partition of ``key``, the event-log record of its latest materialization (storage id, run id, metadata)."""
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(key, DagsterEventType.ASSET_MATERIALIZATION)
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


def latest_materialization_metadata(instance: DagsterInstance, key: AssetKey, matches: Callable[[dict], bool]) -> dict | None:
    """Plain metadata values of the newest of the last thousand materializations of ``key`` that ``matches``."""
    return next((m for m in _history(instance, key, _SEARCH_LIMIT) if matches(m)), None)


def snapshot_versions(instance: DagsterInstance, partition_key: str) -> dict[str, int | None]:
    """Delta versions of gold/sequences, gold/tokenizer, silver/records and bronze/records behind a snapshot."""
    gold = snapshot_version(partition_key)
    versions: dict[str, int | None] = {"gold/sequences": gold, "gold/tokenizer": None, "silver/records": None,
                                       "bronze/records": None}
    built = latest_materialization_metadata(instance, GOLD_SEQUENCES, lambda m: m.get("data_snapshot") == partition_key)
    if built is None:
        return versions
    upstream = built.get("upstream_delta_versions") or {}
    versions["gold/tokenizer"] = upstream.get("gold/tokenizer")
    versions["silver/records"] = upstream.get("silver/records")
    silver = latest_materialization_metadata(
        instance, SILVER_RECORDS, lambda m: m.get("delta_version") == versions["silver/records"]
    )
    if silver:
        versions["bronze/records"] = (silver.get("upstream_delta_versions") or {}).get("bronze/records")
    return versions


def partition_metadata(instance: DagsterInstance, key: AssetKey, partition_key: str) -> dict | None:
    """Plain metadata values of the newest materialization of one partition of ``key``."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[partition_key]), limit=1
    ).records
    if not records:
        return None
    return plain_metadata(records[0].asset_materialization)


def data_compute_behind(instance: DagsterInstance, partition_key: str) -> Compute:
    """CPU and GPU seconds of the data stages behind a snapshot: bronze and silver of every batch it
    holds (the writes at the Delta versions it read), the tokenizer it used, and its own gold build."""
    built = latest_materialization_metadata(instance, GOLD_SEQUENCES, lambda m: m.get("data_snapshot") == partition_key)
    if built is None:
        return Compute()
    upstream = built.get("upstream_delta_versions") or {}
    left_out = set(built.get("batches_left_out") or [])
    silver = _per_batch_at_or_before(instance, SILVER_RECORDS, upstream.get("silver/records"), left_out)
    bronze_version = max(((m.get("upstream_delta_versions") or {}).get("bronze/records", -1) for m in silver), default=-1)
    bronze = _per_batch_at_or_before(instance, BRONZE_RECORDS, bronze_version, left_out, {m["partition"] for m in silver})
    tokenizer = latest_materialization_metadata(
        instance, GOLD_TOKENIZER, lambda m: m.get("tokenizer_version") == built.get("tokenizer_version"))
    stages = [*silver, *bronze, *([tokenizer] if tokenizer else []), built]
    return Compute(sum(float(m.get("cpu_seconds") or 0) for m in stages), sum(float(m.get("gpu_seconds") or 0) for m in stages))


def _per_batch_at_or_before(instance: DagsterInstance, key: AssetKey, version: int | None, left_out: set[str],
                            only: set[str] | None = None) -> list[dict]:
    """Per batch, the newest write of ``key`` at or before Delta ``version``."""
    if version is None:
        return []
    found: dict[str, dict] = {}
    for metadata in materialization_history(instance, key):
        batch = metadata["partition"]
        if batch in left_out or (only is not None and batch not in only) or metadata.get("delta_version", version + 1) > version:
            continue
        found.setdefault(batch, metadata)
    return list(found.values())
