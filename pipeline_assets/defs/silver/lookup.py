"""How a silver batch finds the index entries of the other batches: ``silver/minhash_bands``, one task a band.

Each task reads one band's partition of the table (pinned to one Delta version) and returns the
record ids whose key in that band is one of the batch's; only those records' signatures are then
read from ``silver/minhash_index``. The tasks run where the batch runs its block stages: on Ray
(which then reads the lake from its workers: on a cluster, the lake must be on shared storage such
as S3), or in this process.
"""

from __future__ import annotations

import polars as pl
from dagster import AssetExecutionContext
from deltalake import DeltaTable

from pipeline_assets.engine import BlockEngine
from pipeline_assets.lib.dedup import IndexLookup, band_entries, find_in_band, refuse_other_settings
from pipeline_assets.lib.minhash import MinHashConfig
from pipeline_assets.resources import LakeResource

INDEX = ("silver", "minhash_index")
BANDS = ("silver", "minhash_bands")
BANDS_PARTITIONED_BY = ("band", "batch_id")


def index_lookup(context: AssetExecutionContext, lake: LakeResource, engine: BlockEngine, *, batch_rows: int,
                 excluded: list[str], config: MinHashConfig) -> tuple[IndexLookup | None, dict]:
    """The batch's lookup (None while no batch has an index) and what it reports: the Delta
    versions it reads and, once it ran, where its tasks ran."""
    index = lake.table(*INDEX)
    if index is None:
        return None, {}
    refuse_other_settings(_values_in_file_stats(index, "lsh_params"), config)
    _add_missing_batches(context, lake, index)
    bands = lake.table(*BANDS)
    if bands is None:  # no batch has kept a record yet
        return None, {}
    report = {"versions": {"silver/minhash_index": index.version(), "silver/minhash_bands": bands.version()}}
    bands_uri, options = lake.table_uri(*BANDS), lake.storage_options()

    def look_up(wanted: pl.DataFrame) -> pl.DataFrame:
        calls = [(bands_uri, options, bands.version(), band, keys["band_key"], excluded)
                 for (band,), keys in wanted.sort("band").group_by("band", maintain_order=True)]
        found = engine.map_tasks(find_in_band_table, calls, batch_rows)
        report.update(tasks=len(calls), ran_on=found.ran_on)
        matched = pl.concat(found.results).unique()
        return (
            pl.scan_delta(index)
            .filter(pl.col("batch_id").is_in(matched["batch_id"].unique().implode())
                    & pl.col("record_id").is_in(matched["record_id"].implode()))
            .collect()
        )

    return look_up, report


def find_in_band_table(uri: str, storage_options: dict | None, version: int, band: int, keys: pl.Series,
                       excluded: list[str]) -> pl.DataFrame:
    """One task: ``find_in_band`` on one band's partition of ``silver/minhash_bands`` at ``version``."""
    table = DeltaTable(uri, version=version, storage_options=storage_options)
    return find_in_band(pl.scan_delta(table), band, keys, excluded)


def write_bands(lake: LakeResource, index: pl.DataFrame, batch_id: str):
    """Replace the batch's rows of ``silver/minhash_bands`` with its index entries' keys."""
    return lake.replace_partition(*BANDS, band_entries(index), column="batch_id", value=batch_id,
                                  partition_by=BANDS_PARTITIONED_BY)


def _add_missing_batches(context: AssetExecutionContext, lake: LakeResource, index: DeltaTable) -> None:
    """Batches the index holds and the bands table does not (an index written before the bands table
    existed) get their keys written, one batch at a time."""
    bands = lake.table(*BANDS)
    have = set() if bands is None else {part["batch_id"] for part in bands.partitions()}
    missing = sorted({part["batch_id"] for part in index.partitions()} - have)
    if missing:
        context.log.info(f"silver/minhash_bands: adding the keys of {len(missing)} batch(es) from silver/minhash_index")
    for batch_id in missing:
        entries = pl.scan_delta(index).filter(pl.col("batch_id") == batch_id).select("record_id", "batch_id", "exact_hash", "band_keys")
        write_bands(lake, entries.collect(), batch_id)


def _values_in_file_stats(table: DeltaTable, column: str) -> list[str]:
    """The values a string column takes, from its files' min/max statistics: the Delta log, not the data."""
    actions = pl.DataFrame(table.get_add_actions(flatten=True))
    if actions.is_empty():
        return []
    return sorted(set(actions[f"min.{column}"].drop_nulls()) | set(actions[f"max.{column}"].drop_nulls()))
