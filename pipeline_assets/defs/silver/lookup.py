"""How a silver batch finds the index entries of the other batches: ``silver/minhash_bands``, by
band.

The other batches are cut into slices of about ROWS_PER_LOOKUP_TASK indexed records (from the
Delta log's file statistics). One task a band and slice reads that band's keys in those batches'
partitions and returns the record ids that hold one of the batch's keys: for the LSH bands, the
band searches (``flow.search_bands``), which read the batch's keys of the band from its staged
files themselves; for the hashes' bands, tasks given the keys the step looked up. Then one task a
slice with matches reads those records' entries (hashes and signatures) from
``silver/minhash_index``; for silver's flow, it stages their signatures for near dedup's pair
tasks and returns the rest.
All of it is pinned to the tables' Delta versions when the step started: the step reads each
table's log once and names every task its files (``PinnedFiles``), so no task reads a log, which
grows with the tables' files. The tasks run where the
batch runs its block stages: on Ray (which reads the lake from its workers: on a cluster, the lake
must be on shared storage such as S3), or in this process, one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
from dagster import AssetExecutionContext
from deltalake import DeltaTable

from pipeline_assets.lib import uris
from pipeline_assets.lib.delta_files import PinnedFiles, TableFiles, partition_values
from pipeline_assets.lib.silver.dedup import (
    ENTRY_IDS,
    ROWS_PER_LOOKUP_TASK,
    IndexLookup,
    band_entries,
    find_in_band,
    refuse_other_settings,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.near_edges import SIGNED_COLUMNS
from pipeline_assets.lib.silver.staging import write_signed
from pipeline_assets.resources.engine import BlockEngine
from pipeline_assets.resources.lake import LakeResource

INDEX = ("silver", "minhash_index")
BANDS = ("silver", "minhash_bands")
BANDS_PARTITIONED_BY = ("band", "batch_id")


@dataclass(frozen=True)
class BandsAt:
    """``silver/minhash_bands`` as a batch's lookup reads it: its files at a pinned version, and
    the other batches in slices (a task a band and slice)."""

    files: TableFiles
    version: int
    slices: list[list[str]]

    def of(self, band: int, batches: list[str]) -> PinnedFiles:
        """The files a task reads for ``band`` in ``batches``."""
        return self.files.of((band, batch) for batch in batches)


def index_lookup(
    context: AssetExecutionContext,
    lake: LakeResource,
    engine: BlockEngine,
    *,
    batch_rows: int,
    excluded: list[str],
    config: MinHashConfig,
    stage_signatures: str | None = None,
) -> tuple[IndexLookup | None, dict, BandsAt | None]:
    """The batch's lookup (None while no other batch has an index entry), what it reports (the
    Delta versions it reads and, once it ran, its tasks and where they ran) and the bands table the
    band searches read. With ``stage_signatures`` (a folder), the entries it finds come without
    their signatures, which its tasks write there (``staging.write_signed``)."""
    index = lake.table(*INDEX)
    if index is None:
        return None, {}, None
    refuse_other_settings(_values_in_file_stats(index, "lsh_params"), config)
    _add_missing_batches(context, lake, index)
    bands_at = bands_to_search(lake, index, excluded)
    if bands_at is None:
        return None, {}, None
    report = {
        "versions": {
            "silver/minhash_index": index.version(),
            "silver/minhash_bands": bands_at.version,
        }
    }
    index_files = TableFiles(index, lake.storage_options())

    def look_up(wanted: pl.DataFrame, also: pl.DataFrame | None = None) -> pl.DataFrame:
        entries, tasks = look_up_by_band(
            wanted, engine, batch_rows, bands_at, index_files, also, stage_signatures
        )
        add_tasks(report, tasks)
        if entries is None:
            entries = pl.scan_delta(index).head(0).collect()
        return entries.drop(SIGNED_COLUMNS, strict=False) if stage_signatures else entries

    return look_up, report, bands_at


def bands_to_search(lake: LakeResource, index: DeltaTable, excluded: list[str]) -> BandsAt | None:
    """``silver/minhash_bands`` pinned, with the slices of ``index``'s batches less ``excluded``
    (None: no table, or no other batch)."""
    bands = lake.table(*BANDS)
    slices = batch_slices(index, excluded, ROWS_PER_LOOKUP_TASK)
    if bands is None or not slices:
        return None
    return BandsAt(TableFiles(bands, lake.storage_options()), bands.version(), slices)


def look_up_by_band(
    wanted: pl.DataFrame,
    engine: BlockEngine,
    batch_rows: int,
    bands_at: BandsAt,
    index_files: TableFiles,
    also: pl.DataFrame | None = None,
    stage_signatures: str | None = None,
) -> tuple[pl.DataFrame | None, dict]:
    """The index entries holding one of the ``wanted`` (band, band_key) rows or named in ``also``
    (ENTRY_IDS, found by the band searches) (None: none), and the tasks that found them.
    ``index_files``: ``silver/minhash_index``'s, pinned. A band and slice without rows (the
    prompts' band of batches without preference pairs) has no task. With ``stage_signatures``
    (a folder), each task reading entries writes their signatures there and returns the rest."""
    by_key = wanted.sort("band").group_by("band", maintain_order=True)
    slices = bands_at.slices
    searches = [
        (bands_at.of(band, batches), band, keys["band_key"])
        for (band,), keys in by_key
        for batches in slices
    ]
    calls = [call for call in searches if call[0].files]
    by_band = engine.map_tasks(find_in_band_table, calls, batch_rows)
    found = pl.concat(
        [pl.DataFrame(schema=ENTRY_IDS), *by_band.results, *([] if also is None else [also])]
    ).unique()
    reads = [found.filter(pl.col("batch_id").is_in(batches)) for batches in slices]
    entries = engine.map_tasks(
        read_entries,
        [
            (
                index_files.of((batch,) for batch in named["batch_id"].unique().sort()),
                named,
                stage_signatures and uris.join(stage_signatures, f"entries-{number:05d}.parquet"),
            )
            for number, named in enumerate(reads)
            if not named.is_empty()
        ],
        batch_rows,
    )
    tasks = {
        "tasks": f"{len(calls)} by band, {len(entries.results)} reading entries",
        "ran_on": by_band.ran_on,
        "bands": wanted["band"].n_unique(),  # a task a band and slice: what the sizer spreads
        "task_seconds": by_band.task_seconds + entries.task_seconds,
        "wait_seconds": by_band.wall_seconds + entries.wall_seconds,
    }
    return (pl.concat(entries.results, how="diagonal_relaxed") if entries.results else None), tasks


def add_tasks(report: dict, tasks: dict) -> None:
    """A lookup's tasks (silver's band searches, then its call for every format's hashes) summed in
    the report, their tasks listed a call apart; where they ran is where the first call's ran (the
    band searches: most of the tasks)."""
    for name, value in tasks.items():
        if name not in report:
            report[name] = value
        elif isinstance(value, str):
            if name != "ran_on":
                report[name] = f"{report[name]}; {value}"
        else:
            report[name] += value


def batch_slices(index: DeltaTable, excluded: list[str], rows_per_task: int) -> list[list[str]]:
    """The index's batches less ``excluded``, in order, cut where a slice reaches ``rows_per_task``
    records."""
    actions = pl.DataFrame(index.get_add_actions(flatten=True))
    if actions.is_empty():
        return []
    rows = (
        actions.group_by(batch_id="partition.batch_id")
        .agg(pl.col("num_records").sum())
        .filter(~pl.col("batch_id").is_in(excluded))
        .sort("batch_id")
    )
    slices, current, size = [], [], 0
    for batch_id, count in rows.iter_rows():
        if current and size + count > rows_per_task:
            slices.append(current)
            current, size = [], 0
        current.append(batch_id)
        size += count
    return [*slices, current] if current else slices


def find_in_band_table(files: PinnedFiles, band: int, keys: pl.Series) -> pl.DataFrame:
    """One task: ``find_in_band`` on one band's files of some batches of
    ``silver/minhash_bands``."""
    return find_in_band(files.scan(), band, keys)


def read_entries(
    files: PinnedFiles, found: pl.DataFrame, signatures_to: str | None = None
) -> pl.DataFrame:
    """One task: the ``silver/minhash_index`` entries of the (record_id, batch_id) rows found, from
    ``files``, the partitions of the batches that hold them; with ``signatures_to`` (a file),
    their signatures written there and the rest returned."""
    entries = files.scan().filter(pl.col("record_id").is_in(found["record_id"].implode())).collect()
    if signatures_to is None:
        return entries
    write_signed(entries, signatures_to, files.storage_options)
    return entries.drop(SIGNED_COLUMNS, strict=False)


def _write_bands_here(lake: LakeResource, index: pl.DataFrame, batch_id: str):
    """Replace the batch's rows of ``silver/minhash_bands`` with its index entries' keys, made in
    this process (silver's own batches have theirs written by tasks: ``flow.write_bands``)."""
    return lake.replace_partition(
        *BANDS,
        band_entries(index),
        column="batch_id",
        value=batch_id,
        partition_by=BANDS_PARTITIONED_BY,
    )


def _add_missing_batches(
    context: AssetExecutionContext, lake: LakeResource, index: DeltaTable
) -> None:
    """Batches the index holds and the bands table does not (an index written before the bands table
    existed) get their keys written, one batch at a time."""
    bands = lake.table(*BANDS)
    have = set() if bands is None else partition_values(bands, "batch_id")
    missing = sorted(partition_values(index, "batch_id") - have)
    if missing:
        context.log.info(
            f"silver/minhash_bands: adding the keys of {len(missing)} batch(es) from "
            "silver/minhash_index"
        )
    for batch_id in missing:
        entries = (
            pl.scan_delta(index)
            .filter(pl.col("batch_id") == batch_id)
            .select("record_id", "batch_id", "exact_hash", "band_keys")
        )
        _write_bands_here(lake, entries.collect(), batch_id)


def _values_in_file_stats(table: DeltaTable, column: str) -> list[str]:
    """The values a string column takes, from its files' min/max statistics: the Delta log, not the
    data."""
    actions = pl.DataFrame(table.get_add_actions(flatten=True))
    if actions.is_empty():
        return []
    return sorted(
        set(actions[f"min.{column}"].drop_nulls()) | set(actions[f"max.{column}"].drop_nulls())
    )
