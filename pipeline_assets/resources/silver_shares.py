"""Silver's tables written in parallel and committed once (issue 37): each task splits one share of
a batch's staged records by the decision, conforms its rows to the tables' contracts and writes one
Parquet file a table into the lake; the step commits each table's files in one Delta commit. Once
``silver/minhash_index`` is committed, a task a band writes the batch's rows of
``silver/minhash_bands`` from it, and the step commits the bands' files in one commit too.

The tasks (``write_share_tables``, ``write_band_share``) take and return plain values, so a Ray
task runs them as they are; they live here rather than in ``lib/silver`` because they apply the
contracts (``lib`` may not import them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandera.polars as pa
import polars as pl
from deltalake import DeltaTable

from pipeline_assets.contracts import (
    FORMAT_CONTRACTS,
    MinhashBandEntry,
    MinhashIndexEntry,
    SilverReject,
    conform,
    polars_schema,
    validate,
)
from pipeline_assets.lib import uris
from pipeline_assets.lib.delta_files import partition_slices, write_share, write_share_slices
from pipeline_assets.lib.formats import FORMATS
from pipeline_assets.lib.silver.decide import Decision
from pipeline_assets.lib.silver.dedup import band_columns, band_rows
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.prepare import BOUNDED_STRINGS
from pipeline_assets.lib.silver.split import SplitShare, split_share
from pipeline_assets.lib.silver.staging import StagedShare, read_prepared
from pipeline_assets.resources.lake import DeltaCommit, LakeResource

PARTITION = "batch_id"
REJECTS = "silver/rejects"
INDEX = "silver/minhash_index"
BANDS = "silver/minhash_bands"
BANDS_PARTITIONED_BY = ("band", PARTITION)


@dataclass(frozen=True)
class SilverTargets:
    """Where one format's shares of one batch go: the lake, and the tables by ``tables()``."""

    lake_uri: str
    batch_id: str
    format_name: str

    def tables(self) -> dict[str, type[pa.DataFrameModel]]:
        """``layer/name`` -> contract: the format's silver table, silver/rejects,
        silver/minhash_index, in the order ``SplitShare`` holds their rows."""
        fmt = FORMATS[self.format_name]
        silver_contract = FORMAT_CONTRACTS[fmt.name][1]
        return {
            f"silver/{fmt.silver_table}": silver_contract,
            REJECTS: SilverReject,
            INDEX: MinhashIndexEntry,
        }


@dataclass(frozen=True)
class WrittenShare:
    """What one write task hands back: per table, its file's add action (None: the share has no
    rows for it, so no file), the rows written and the conformed columns."""

    format_name: str
    first_position: int
    actions: dict[str, dict | None]
    rows: dict[str, int]
    schemas: dict[str, pl.Schema]


def write_share_tables(
    share: StagedShare,
    decision: Decision,
    targets: SilverTargets,
    minhash: MinHashConfig,
    run_id: str,
    storage_options: dict[str, str] | None = None,
) -> WrittenShare:
    """One task: read ``share``'s staged records, split them by ``decision`` (its verdicts: the
    share's records', ``split.for_positions``), conform and validate each table's rows to its
    contract, and write them as ``<run_id>-<format>-<first position>.parquet`` in the table's
    partition of the batch. The name is the same when the task is retried, so a retry overwrites
    its own files; the format is in it because formats share silver/rejects and the index.
    Raises when the share's records are not each kept or rejected once."""
    prepared = read_prepared([share], storage_options)
    first = min((block.first_position for block in share.blocks), default=0)
    cut = split_share(prepared, decision, minhash)
    _check_accounting(share, cut)
    file_name = f"{run_id}-{share.format_name}-{first:012d}.parquet"
    actions, rows, schemas = {}, {}, {}
    for (table, model), frame in zip(
        targets.tables().items(), (cut.kept, cut.rejects, cut.index), strict=True
    ):
        conformed = to_contract(model, frame)
        uri = uris.join(targets.lake_uri, table)
        partition = {PARTITION: targets.batch_id}
        actions[table] = (
            write_share(uri, conformed, partition, file_name, storage_options, BOUNDED_STRINGS)
            if conformed.height
            else None
        )
        rows[table], schemas[table] = conformed.height, conformed.schema
    return WrittenShare(share.format_name, first, actions, rows, schemas)


def to_contract(model: type[pa.DataFrameModel], frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with every column of ``model`` (null where it has none), conformed and validated:
    what the silver asset does to each table's rows before it writes them."""
    empty = pl.DataFrame(schema=polars_schema(model))
    return validate(conform(pl.concat([empty, frame], how="diagonal_relaxed"), model), model)


def _check_accounting(share: StagedShare, cut: SplitShare) -> None:
    if share.rows != cut.kept.height + cut.rejects.height:
        raise RuntimeError(
            f"accounting broken in a {share.format_name} share: {share.rows} staged records != "
            f"{cut.kept.height} kept + {cut.rejects.height} rejected"
        )


def commit_silver_tables(
    lake: LakeResource,
    written: Sequence[WrittenShare],
    targets: Sequence[SilverTargets],
    batch_id: str,
    version: int,
) -> dict[str, DeltaCommit]:
    """Commit every table of ``targets`` once: its partition of ``batch_id`` replaced by exactly the
    files the tasks wrote (none: the partition emptied, as today's write of no rows does), each
    commit carrying the application transaction ``(silver/<table>/<batch>, version)``.

    ``version`` comes from the run (the step passes the run's start time in epoch milliseconds):
    a commit retried within the same run finds its transaction already carried and commits
    nothing, while a later run of the batch has a greater version and replaces the partition
    again. A retry must therefore not rewrite a table's files once its commit is carried (the
    files keep their run's names, and that commit reads them)."""
    tables: dict[str, type[pa.DataFrameModel]] = {}
    for target in targets:
        if target.batch_id != batch_id:
            raise ValueError(f"targets of batch {target.batch_id} in a commit of {batch_id}")
        tables.update(target.tables())
    commits = {}
    for table, model in tables.items():
        layer, name = table.split("/")
        commits[table] = lake.commit_partition(
            layer,
            name,
            [share.actions[table] for share in written if share.actions.get(table)],
            _table_schema(table, model, written),
            column=PARTITION,
            value=batch_id,
            app_id=f"{table}/{batch_id}",
            version=version,
            add_columns=True,  # as today: a column the contract gained since (a scorer's)
        )
    return commits


def _table_schema(
    table: str, model: type[pa.DataFrameModel], written: Sequence[WrittenShare]
) -> pl.Schema:
    """The columns every share wrote to ``table`` (the contract's, and a scorer's where it has
    some); the contract's alone when no share wrote to it."""
    found = {tuple(share.schemas[table].items()) for share in written if table in share.schemas}
    if len(found) > 1:
        raise ValueError(f"the shares of {table} were conformed to different columns")
    return pl.Schema(found.pop()) if found else polars_schema(model)


BAND_SLICE_BYTES = 16 * 2**20  # the index's entries a band task holds at a time


@dataclass(frozen=True)
class BandTargets:
    """Where a batch's rows of ``silver/minhash_bands`` come from and go: the lake, the batch, and
    the version of ``silver/minhash_index`` that holds the batch's committed entries."""

    lake_uri: str
    batch_id: str
    index_version: int


def write_band_share(
    targets: BandTargets, band: int, run_id: str, storage_options: dict[str, str] | None = None
) -> dict | None:
    """One task: the batch's entries of ``silver/minhash_index`` at ``targets.index_version``, as
    one band's rows (``band_rows``: only the columns that band reads), conformed and validated,
    written as ``<run_id>-band<band>.parquet`` in ``band=<band>/batch_id=<batch>/``. Returns the
    file's add action; None when the band has no rows (no file). It holds about
    ``BAND_SLICE_BYTES`` of the index at a time, not the batch's entries."""
    index = DeltaTable(
        uris.join(targets.lake_uri, INDEX),
        version=targets.index_version,
        storage_options=storage_options,
    )
    entries = partition_slices(
        index, PARTITION, targets.batch_id, BAND_SLICE_BYTES, band_columns(band)
    )
    return write_share_slices(
        uris.join(targets.lake_uri, BANDS),
        (to_contract(MinhashBandEntry, band_rows(part.lazy(), band).collect()) for part in entries),
        {"band": str(band), PARTITION: targets.batch_id},
        f"{run_id}-band{band}.parquet",
        storage_options,
        BOUNDED_STRINGS,
    )


def commit_band_shares(
    lake: LakeResource, actions: Sequence[dict], batch_id: str, version: int
) -> DeltaCommit:
    """One commit replacing the batch's rows in every band of ``silver/minhash_bands`` by exactly
    the files of ``actions``, carrying the application transaction
    ``(silver/minhash_bands/<batch>, version)`` as ``commit_silver_tables`` does."""
    layer, name = BANDS.split("/")
    return lake.commit_partition(
        layer,
        name,
        actions,
        polars_schema(MinhashBandEntry),
        column=PARTITION,
        value=batch_id,
        app_id=f"{BANDS}/{batch_id}",
        version=version,
        partition_by=BANDS_PARTITIONED_BY,
    )
