"""Silver's batch without its records passing through the step's process (issue 37): tasks read
the batch's bronze files and prepare them (``lib.silver.staging``), tasks search their band keys,
the step reads only keys (of the candidates the searches found, for the formats decided from them)
and decides (``lib.silver.decide``), tasks write their shares of the tables
(``resources.silver_shares``), and the step commits each table once.

What the step reads or receives is hashes, verdicts and plain counts: every frame that enters it
is refused if it holds a text column, and its Arrow bytes are counted (``StepBytes``).
"""

from __future__ import annotations

import functools
import json
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import polars as pl
import pyarrow.fs as pafs

from pipeline_assets.contracts import polars_schema
from pipeline_assets.defs.format_tables import FormatTables
from pipeline_assets.defs.silver.lookup import BandsAt, add_tasks
from pipeline_assets.lib import uris
from pipeline_assets.lib.delta_files import PinnedFiles, table_filesystem
from pipeline_assets.lib.formats import RecordFormat
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.decide import Decision, decide, from_candidates, reached_dedup
from pipeline_assets.lib.silver.decontam import EvalItems
from pipeline_assets.lib.silver.dedup import (
    EXACT_BAND,
    PROMPT_BAND,
    BandMatches,
    IndexLookup,
    band_numbers,
    lsh_of,
    search_band,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.near_edges import (
    EDGE_SCHEMA,
    SIGNED_COLUMNS,
    NearPairs,
    band_edges,
    pair_similarity,
)
from pipeline_assets.lib.silver.prepare import REMOVED_BY, model_stages, refuse_text
from pipeline_assets.lib.silver.split import DECIDED, for_positions, stage_counters, with_verdicts
from pipeline_assets.lib.silver.staging import (
    BronzeFile,
    FinishedBlock,
    StagedShare,
    StartedBlock,
    bronze_files,
    bronze_schema,
    cut_files,
    finish_file_block,
    group_files,
    prepare_files,
    read_band,
    read_keys,
    read_signed,
    share_positions,
    signed_files,
    stage_signatures,
    staged_counters,
    staged_record_counters,
    staged_share,
    staged_tally,
    start_file_blocks,
    write_signed,
)
from pipeline_assets.lib.stages import Stage, StagesResult
from pipeline_assets.resources.engine import BlockEngine, TaskResults, engine_used
from pipeline_assets.resources.lake import DeltaCommit, LakeResource
from pipeline_assets.resources.silver_shares import (
    BANDS,
    REJECTS,
    BandTargets,
    SilverTargets,
    WrittenShare,
    commit_band_shares,
    commit_silver_tables,
    write_band_share,
    write_share_tables,
)

LANGUAGE = "language"  # the language stage, and the column it labels records with
STAGE = "silver"  # its staging under the lake: <batch>/<run>/ a run's staged Parquet
NEAR, ENTRIES = "near", "entries"  # a run's staged signatures: ``near_folder``


@dataclass
class StepBytes:
    """The Arrow bytes (and pickled task results) the step's process read or received, by what
    they were."""

    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.by_kind.values())

    def frame(self, kind: str, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` counted, once refused if it holds text."""
        refuse_text(frame)
        self._add(kind, int(frame.estimated_size()))
        return frame

    def results(self, kind: str, results: list) -> list:
        self._add(kind, sum(len(pickle.dumps(result)) for result in results))
        return results

    def _add(self, kind: str, size: int) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + size


@dataclass(frozen=True)
class Where:
    """Where a share ran: its Ray nodes (none: the step's process), its polars threads, and the
    actors that ran its model stages (none: they ran with the rest)."""

    nodes: tuple[str, ...]
    polars_threads: int
    actors: tuple[str, ...] = ()

    @classmethod
    def here(cls, on_ray: bool) -> Where:
        if not on_ray:
            return cls((), pl.thread_pool_size())
        import ray

        return cls((ray.get_runtime_context().get_node_id(),), pl.thread_pool_size())


@dataclass(frozen=True)
class PreparedShare:
    staged: StagedShare
    where: Where


@dataclass(frozen=True)
class ShareToPrepare:
    """What a prepare task is given: a share's bronze files, how to judge and read them, and
    where to stage them (the eval items apart: every task is given the same)."""

    files: Sequence[BronzeFile]
    config: SilverConfig
    tables: FormatTables
    staging_dir: str
    rows_per_block: int
    schema: pl.Schema
    storage_options: dict | None
    on_ray: bool

    @property
    def rows(self) -> int:
        return sum(file.rows for file in self.files)


def prepare_share(share: ShareToPrepare, eval_items: EvalItems) -> PreparedShare:
    """One prepare task: ``prepare_files``, and where it ran. Its process builds the eval index
    once (``EvalItems.index``); a share with no row needs none."""
    staged = prepare_files(
        share.files,
        share.config,
        eval_items.index() if share.rows else eval_items.names_only(),
        share.tables.fmt,
        share.staging_dir,
        share.rows_per_block,
        share.schema,
        share.storage_options,
    )
    return PreparedShare(staged, Where.here(share.on_ray and share.rows > 0))  # none: here


def start_share(
    share: ShareToPrepare, eval_items: EvalItems
) -> list[tuple[StagesResult, StartedBlock]]:
    """A prepare task before the actor pool: the share's blocks up to their model stages. Each
    block's judged records go on to the pool as Arrow; the rest of it is carried to the task
    that finishes it."""
    blocks = start_file_blocks(
        share.files,
        share.config,
        eval_items.index(),
        share.tables.fmt,
        share.rows_per_block,
        share.schema,
        share.storage_options,
        before_models=True,
    )
    # judged travels apart (the pool runs on it) and is put back by finish_pooled_block
    return [(b.started.judged, replace(b, started=replace(b.started, judged=None))) for b in blocks]


def finish_pooled_block(
    judged: StagesResult, carried: StartedBlock, staging_dir: str, storage_options: dict | None
) -> FinishedBlock:
    """A prepare task after the actor pool: the block finished and written; paths and counters
    returned."""
    block = replace(carried, started=replace(carried.started, judged=judged))
    return finish_file_block(block, staging_dir, storage_options)


@dataclass(frozen=True)
class ShareCounts:
    """What one write task hands back: its files, and what the metadata counts of its rows."""

    written: WrittenShare
    output_chars: int
    kept_by_source: dict[str, int]
    rejected_by_stage: dict[tuple[str, str], int]  # (source, stage) -> rows
    language_mix: dict[str, int]  # the records that reached the language stage
    prompt_hashes: tuple[str, ...]  # a preference share's kept prompts


def write_share(
    share: StagedShare,
    decision: Decision,
    targets: SilverTargets,
    minhash: MinHashConfig,
    run_id: str,
    storage_options: dict | None,
) -> ShareCounts:
    """One write task: ``write_share_tables``, and the counts of the rows it wrote (read back
    from its own files, in the worker)."""
    from pipeline_assets.lib.formats import text_chars

    written = write_share_tables(share, decision, targets, minhash, run_id, storage_options)
    silver_table = next(iter(targets.tables()))
    kept = _written_rows(targets, written, silver_table, storage_options)
    rejects = _written_rows(targets, written, REJECTS, storage_options)
    prompts = kept["prompt_hash"].unique() if "prompt_hash" in kept.columns else pl.Series()
    return ShareCounts(
        written,
        text_chars(kept),
        _counts(kept, "source"),
        {
            (source, stage): rows
            for source, stage, rows in rejects.group_by("source", "stage").len().iter_rows()
        },
        _language_mix(share, decision, storage_options),
        tuple(prompts.drop_nulls().to_list()) if decision.last_stages else (),
    )


def _language_mix(
    share: StagedShare, decision: Decision, storage_options: dict | None
) -> dict[str, int]:
    """The share's records by language, of those that reached the language stage (kept, or removed
    by it or a stage after it), as the stage counts them: prepare labelled every record it saw."""
    stages = share.record_stages
    if LANGUAGE not in stages:
        return {}
    later = [*stages[stages.index(LANGUAGE) :], *decision.last_stages]
    labelled = pl.concat([_labels(block.records, storage_options) for block in share.blocks])
    removed_by = pl.col(DECIDED + REMOVED_BY)
    reached = with_verdicts(labelled, decision).filter(
        removed_by.is_null() | removed_by.is_in(later)
    )
    return _counts(reached.select(LANGUAGE).drop_nulls(), LANGUAGE)


def _labels(records: str, storage_options: dict | None) -> pl.DataFrame:
    """A staged block's record ids, staged verdicts and languages (null: no record of it reached
    the stage)."""
    scan = pl.scan_parquet(records, storage_options=storage_options)
    language = pl.col(LANGUAGE) if LANGUAGE in scan.collect_schema().names() else pl.lit(None)
    return scan.select(
        "record_id", REMOVED_BY, "stage", language.cast(pl.String).alias(LANGUAGE)
    ).collect()


def _written_rows(
    targets: SilverTargets, written: WrittenShare, table: str, storage_options: dict | None
) -> pl.DataFrame:
    action = written.actions[table]
    if action is None:
        return pl.DataFrame(schema=written.schemas[table])
    uri = uris.join(targets.lake_uri, table, action["path"])
    return pl.read_parquet(uri, storage_options=storage_options)


def _counts(frame: pl.DataFrame, column: str) -> dict[str, int]:
    return {value: rows for value, rows in frame.group_by(column).len().iter_rows()}


@dataclass(frozen=True)
class FormatBatch:
    """One format's batch through the flow: its bronze version, staged shares and decision."""

    tables: FormatTables
    version: int | None
    bronze_rows: int
    shares: list[PreparedShare]
    keys: pl.DataFrame | None = None  # what the decision read: every record's, or its candidates'
    decision: Decision | None = None

    @property
    def staged(self) -> list[StagedShare]:
        return [share.staged for share in self.shares]


@dataclass
class BatchFlow:
    """One batch of every format through the flow, what the step counted on the way."""

    batch_id: str
    run_id: str
    staging_dir: str
    formats: dict[FormatTables, FormatBatch]
    step_bytes: StepBytes
    config: SilverConfig
    storage_options: dict | None
    prepare_wall_seconds: float = 0.0
    write_task_seconds: float = 0.0  # the write tasks' own seconds, summed
    write_wall_seconds: float = 0.0
    # the band searches within the batch, the reads of their candidates' keys and near dedup's pair
    # tasks: block work
    search_task_seconds: float = 0.0
    search_wall_seconds: float = 0.0
    decide_seconds: float = 0.0  # the decision in the step's process, the index lookup apart
    commit_seconds: float = 0.0
    index_lookup: dict = field(default_factory=dict)
    written: list[ShareCounts] = field(default_factory=list)

    @property
    def bronze_rows(self) -> int:
        return sum(batch.bronze_rows for batch in self.formats.values())


def staging_dir(lake: LakeResource, batch_id: str, run_id: str | None = None) -> str:
    """The batch's staging folder under the lake (a run's, with ``run_id``)."""
    return lake.staging_uri(STAGE, batch_id, *([run_id] if run_id else []))


def prepare_batch(
    lake: LakeResource,
    engine: BlockEngine,
    formats: Sequence[FormatTables],
    batch_id: str,
    run_id: str,
    config: SilverConfig,
    eval_items: EvalItems,
) -> BatchFlow:
    """Every format's bronze files of the batch at the tables' current versions, prepared by tasks
    into the run's staging folder. A format without rows is prepared here (an empty block: nothing
    to read, no task to send the eval items to)."""
    folder, options = staging_dir(lake, batch_id, run_id), lake.storage_options()
    started, step_bytes = time.perf_counter(), StepBytes()
    pinned = {tables: _pinned_files(lake, tables, batch_id) for tables in formats}
    rows = sum(f.rows for _, files, _ in pinned.values() for f in files)
    on_ray = engine.uses_ray(rows)
    calls = [
        (
            ShareToPrepare(
                share,
                config,
                tables,
                folder,
                engine.rows_per_block,
                schema,
                options,
                on_ray,
            ),
        )
        for tables, (_, files, schema) in pinned.items()
        for share in _shares(files, engine.rows_per_block)
    ]
    pooled = {
        tables: stages
        for tables in pinned
        if on_ray and (stages := model_stages(config, tables.fmt))
    }
    prepared = _on_engine_unless_empty(
        engine,
        prepare_share,
        [call for call in calls if call[0].tables not in pooled],
        rows,
        step_bytes,
        "prepare",
        shared=(eval_items,),
    ).results
    for tables, stages in pooled.items():
        own = [call for call in calls if call[0].tables == tables]
        prepared += _prepare_on_actor_pool(
            engine, [c for c in own if c[0].rows], stages, eval_items, folder, options, step_bytes
        )
        prepared += [prepare_share(*c, eval_items) for c in own if not c[0].rows]
    batches = {}
    for tables, (version, files, _) in pinned.items():
        shares = [p for p in prepared if p.staged.format_name == tables.fmt.name]
        batches[tables] = FormatBatch(tables, version, sum(f.rows for f in files), shares)
        staged_rows = sum(share.staged.rows for share in shares)
        if staged_rows != batches[tables].bronze_rows:
            raise RuntimeError(
                f"accounting broken: {batches[tables].bronze_rows} rows in "
                f"{tables.bronze.to_user_string()}'s files, {staged_rows} prepared"
            )
    flow = BatchFlow(batch_id, run_id, folder, batches, step_bytes, config, options)
    flow.prepare_wall_seconds = round(time.perf_counter() - started, 3)
    return flow


def _prepare_on_actor_pool(
    engine: BlockEngine,
    calls: list[tuple],
    stages: list[Stage],
    eval_items: EvalItems,
    folder: str,
    options: dict | None,
    step_bytes: StepBytes,
) -> list[PreparedShare]:
    """One format's shares through tasks, the actor pool that runs its model stages, and tasks
    that write them; the blocks back as shares, in call order."""
    if not calls:
        return []
    finish = functools.partial(finish_pooled_block, staging_dir=folder, storage_options=options)
    pooled = step_bytes.results(
        "prepare results",
        engine.map_through_actors(start_share, calls, stages, finish, shared=(eval_items,)),
    )
    shares = []
    for call in range(len(calls)):
        blocks = [p for p in pooled if p.call == call]
        where = Where(
            tuple(sorted({n for p in blocks for n in p.nodes})),
            blocks[0].polars_threads,
            tuple(sorted({p.actor for p in blocks})),
        )
        shares.append(PreparedShare(staged_share([p.value for p in blocks]), where))
    return shares


def _shares(files: Sequence[BronzeFile], rows_per_block: int) -> list[list[BronzeFile]]:
    """A task a block, as the block stages ran before: a share is a block's rows of the files."""
    return group_files(cut_files(files, rows_per_block), rows_per_block)


def _pinned_files(
    lake: LakeResource, tables: FormatTables, batch_id: str
) -> tuple[int | None, list[BronzeFile], pl.Schema]:
    """The bronze table's current version, the batch's files at it and the columns to read them
    with: the table's, and a column its contract gained since it was written (null)."""
    contract = polars_schema(tables.bronze_contract)
    version = lake.version(*tables.bronze.path)
    if version is None:
        return None, [], contract
    uri, options = lake.table_uri(*tables.bronze.path), lake.storage_options()
    schema = bronze_schema(uri, version, options)
    if not set(contract) <= set(schema):
        schema = pl.Schema({**contract, **schema})
    return version, bronze_files(uri, version, batch_id, options), schema


def decide_batch(
    flow: BatchFlow,
    engine: BlockEngine,
    searched: dict[RecordFormat, BandMatches],
    look_up: IndexLookup | None,
) -> None:
    """The batch's decision for every format from its keys and its band searches (``searched``),
    after one lookup of the index. A format decided from candidates (``from_candidates``) has
    its candidates' keys read by a task a share; any other, every record's keys by the step."""
    started, reads = time.perf_counter(), []
    flow.index_lookup.update(keys=0, entries_found=0, seconds=0.0)
    tallies = {}
    for tables, batch in flow.formats.items():
        if from_candidates(flow.config, tables.fmt):
            candidates = searched[tables.fmt].every_candidate()
            keys = _candidates_keys(flow, engine, batch, candidates, reads)
            tallies[tables.fmt] = staged_tally(batch.staged)
        else:
            keys = flow.step_bytes.frame(
                "keys", read_keys(batch.staged, flow.storage_options, signatures=False)
            )
        flow.formats[tables] = replace(batch, keys=keys)
    counted = _counted_lookup(look_up, flow) if look_up is not None else None
    decisions = decide(
        {b.tables.fmt: b.keys for b in flow.formats.values()},
        counted,
        flow.config,
        {
            b.tables.fmt: _near_pairs(flow, engine, b, searched[b.tables.fmt], reads)
            for b in flow.formats.values()
        },
        searched,
        tallies,
    )
    read_wall = sum(done.wall_seconds for done in reads)  # block work, timed with the searches
    flow.search_task_seconds = round(
        flow.search_task_seconds + sum(done.task_seconds for done in reads), 3
    )
    flow.search_wall_seconds = round(flow.search_wall_seconds + read_wall, 3)
    for tables, batch in flow.formats.items():
        decision = decisions[tables.fmt]
        flow.step_bytes.frame("verdicts", decision.verdicts)
        flow.formats[tables] = replace(batch, decision=decision)
    flow.index_lookup["keys"] += sum(found.keys for found in searched.values())
    waited = flow.index_lookup["seconds"] + read_wall
    flow.decide_seconds = round(time.perf_counter() - started - waited, 3)


def search_bands(
    flow: BatchFlow, engine: BlockEngine, bands_at: BandsAt | None, report: dict
) -> dict[RecordFormat, BandMatches]:
    """Every format's LSH band keys searched by tasks (``search_band``): per format, near dedup's
    candidates and the index entries sharing a key with them; for a format decided from
    candidates, its exact hashes too (EXACT_BAND: exact dedup's candidates). The band keys stay in
    the staged files. First a task a band searches the batch itself: block work, timed with the
    workers' (``search_task_seconds``). Then, with other batches, a task a band and slice of them
    searches the index's band table: the lookup's half, whose counts go to its ``report``."""
    within = _search_tasks(flow, engine, None)
    flow.search_task_seconds = round(within.task_seconds, 3)
    flow.search_wall_seconds = round(within.wall_seconds, 3)
    found = within.results
    if bands_at is not None:
        done = _search_tasks(flow, engine, bands_at)
        add_tasks(
            report,
            {
                "tasks": f"{len(done.results)} band searches",
                "ran_on": done.ran_on,
                "bands": len(done.results) // len(bands_at.slices),  # what the sizer spreads
                "task_seconds": done.task_seconds,
                "wait_seconds": done.wall_seconds,
            },
        )
        found += done.results
    return {
        fmt: BandMatches.joined(
            [m for f, m in found if f is fmt], from_candidates(flow.config, fmt)
        )
        for fmt in (tables.fmt for tables in flow.formats)
    }


def _search_tasks(
    flow: BatchFlow, engine: BlockEngine, bands_at: BandsAt | None
) -> TaskResults[tuple[RecordFormat, BandMatches]]:
    """A task a format's band: within the batch (``bands_at`` None), or a task a format's band and
    slice of ``bands_at`` that has files; results by format."""

    @functools.cache
    def searches(band: int) -> list[PinnedFiles | None]:  # a band's, the same for every format
        if bands_at is None:
            return [None]
        return [f for b in bands_at.slices if (f := bands_at.of(band, b)).files]

    lsh = lsh_of(flow.config.minhash)
    calls, formats = [], []
    for tables, batch in flow.formats.items():
        reached = reached_dedup(flow.config, tables.fmt)
        exact = [EXACT_BAND] if from_candidates(flow.config, tables.fmt) else []
        for band in [*exact, *range(lsh.bands)] if batch.bronze_rows else []:
            for files in searches(band):
                calls.append((batch.staged, band, reached, files, flow.storage_options))
                formats.append(tables.fmt)
    done = engine.map_tasks(search_share_band, calls, flow.bronze_rows)
    found = flow.step_bytes.results("band searches", done.results)
    return replace(done, results=list(zip(formats, found)))


def search_share_band(
    staged: list[StagedShare],
    band: int,
    reached: pl.Expr,
    files: PinnedFiles | None,
    storage_options: dict | None,
) -> BandMatches:
    """One task: ``search_band`` on one band of a format's staged keys (EXACT_BAND: their exact
    hashes), within the batch (``files`` None) or in ``files``, the band's rows of some other
    batches."""
    keys = read_band(staged, band, reached, storage_options)
    return search_band(keys, band, files is None, files.scan() if files else None)


def _candidates_keys(
    flow: BatchFlow,
    engine: BlockEngine,
    batch: FormatBatch,
    candidates: pl.Series,
    reads: list[TaskResults],
) -> pl.DataFrame:
    """The keys of ``candidates`` (record ids), but their signatures: a task a share reads them
    from its staged keys, the tasks' results noted in ``reads``, the bytes received counted."""
    calls = [([share.staged], flow.storage_options) for share in batch.shares]
    done = engine.map_tasks(read_share_keys, calls, flow.bronze_rows, (candidates,))
    reads.append(done)
    return flow.step_bytes.frame("keys", pl.concat(done.results, how="diagonal_relaxed"))


def read_share_keys(
    staged: list[StagedShare], storage_options: dict | None, record_ids: pl.Series
) -> pl.DataFrame:
    """One task: ``read_keys`` of one share's ``record_ids``, their signatures left out."""
    return read_keys(staged, storage_options, signatures=False, record_ids=record_ids)


def near_folder(staging: str) -> str:
    """Where a run stages the signatures near dedup's pair tasks read: its candidates' (a file a
    share and format) and, in ``entries_folder``, the index entries' its lookup found."""
    return uris.join(staging, NEAR)


def entries_folder(flow: BatchFlow) -> str:
    """Where the batch's index lookup stages the signatures of the entries it finds."""
    return uris.join(near_folder(flow.staging_dir), ENTRIES)


def _near_pairs(
    flow: BatchFlow,
    engine: BlockEngine,
    batch: FormatBatch,
    found: BandMatches,
    reads: list[TaskResults],
) -> NearPairs:
    """Near dedup's verified pairs of a format's batch, built by tasks: a task a share stages its
    candidates' signatures, then a task an LSH band pairs the candidates and the index entries
    found for them (``band_edges``). Only the pairs reach the step; the tasks' results are noted
    in ``reads``."""
    fmt, folder, options = batch.tables.fmt, near_folder(flow.staging_dir), flow.storage_options
    bands = lsh_of(flow.config.minhash).bands

    @functools.cache
    def staged() -> tuple[str, ...]:
        calls = [
            ([share.staged], uris.join(folder, f"{fmt.name}-{number:05d}.parquet"), options)
            for number, share in enumerate(batch.shares)
            if share.staged.rows
        ]
        done = engine.map_tasks(
            stage_share_signatures, calls, flow.bronze_rows, (found.candidates,)
        )
        reads.append(done)
        files = [
            path for path in flow.step_bytes.results("near staging results", done.results) if path
        ]
        return (*files, *signed_files(entries_folder(flow), options))

    def edges() -> pl.DataFrame:
        if found.candidates.is_empty():
            return pl.DataFrame(schema=EDGE_SCHEMA)
        files = staged()
        calls = [
            (files, band, found.entries, flow.batch_id, flow.config.minhash, fmt, options)
            for band in range(bands)
        ]
        done = engine.map_tasks(pair_band, calls, flow.bronze_rows)
        reads.append(done)
        return flow.step_bytes.frame("near pairs", pl.concat(done.results))

    def similarity(pairs: pl.DataFrame) -> pl.DataFrame:
        call = (staged(), pairs, flow.config.minhash, options)
        done = engine.map_tasks(pair_similarity_of, [call], flow.bronze_rows)
        reads.append(done)
        return flow.step_bytes.frame("near pairs", done.results[0])

    return NearPairs(edges, similarity)


def stage_share_signatures(
    staged: list[StagedShare], path: str, storage_options: dict | None, record_ids: pl.Series
) -> str | None:
    """One task: ``stage_signatures`` of one share's ``record_ids``, to ``path``."""
    return stage_signatures(staged, record_ids, path, storage_options)


def pair_band(
    files: Sequence[str],
    band: int,
    entries: pl.DataFrame,
    batch_id: str,
    minhash: MinHashConfig,
    fmt: RecordFormat,
    storage_options: dict | None,
) -> pl.DataFrame:
    """One task: ``band_edges`` of one LSH band, over the staged signatures of the batch's
    candidates and of the index ``entries`` (ENTRY_IDS) found for them."""
    signed = read_signed(files, storage_options)
    nodes = pl.concat(
        [
            signed.filter(pl.col("batch_id") == batch_id),
            signed.join(entries, on=["record_id", "batch_id"], how="semi"),
        ]
    )
    return band_edges(nodes, band, batch_id, minhash, fmt)


def pair_similarity_of(
    files: Sequence[str], pairs: pl.DataFrame, minhash: MinHashConfig, storage_options: dict | None
) -> pl.DataFrame:
    """One task: ``pair_similarity`` of ``pairs``, over the staged signatures."""
    return pair_similarity(read_signed(files, storage_options), pairs, minhash)


def _counted_lookup(look_up: IndexLookup, flow: BatchFlow) -> IndexLookup:
    """``look_up``, recording the keys it was given, the entries it found (their bytes counted)
    and its seconds."""

    def counted(wanted: pl.DataFrame, also: pl.DataFrame | None = None) -> pl.DataFrame:
        started = time.perf_counter()
        found = flow.step_bytes.frame("index entries found", look_up(wanted, also))
        if SIGNED_COLUMNS[0] in found.columns:  # a lookup held here (tests): staged as tasks do
            here = uris.join(entries_folder(flow), "here.parquet")
            write_signed(found, here, flow.storage_options)
            found = found.drop(SIGNED_COLUMNS, strict=False)
        seconds = round(time.perf_counter() - started, 3)
        flow.index_lookup.update(keys=wanted.height, entries_found=found.height, seconds=seconds)
        return found

    return counted


def write_batch(flow: BatchFlow, lake: LakeResource, engine: BlockEngine, config) -> None:
    """A write task a share: each splits its records by their verdicts and writes its files."""
    calls = [
        (
            share.staged,
            for_positions(batch.decision, *share_positions(share.staged)),
            SilverTargets(lake.uri, flow.batch_id, tables.fmt.name),
            config.minhash,
            flow.run_id,
            lake.storage_options(),
        )
        for tables, batch in flow.formats.items()
        for share in batch.shares
    ]
    done = _on_engine_unless_empty(
        engine, write_share, calls, flow.bronze_rows, flow.step_bytes, "write"
    )
    flow.written = done.results
    flow.write_task_seconds = round(done.task_seconds, 3)
    flow.write_wall_seconds = round(done.wall_seconds, 3)


def _on_engine_unless_empty(
    engine, function, calls, rows, step_bytes, kind: str, shared: tuple = ()
) -> TaskResults:
    """``function(*call, *shared)`` on each call, in order: as the engine's tasks where the call's
    share has rows (their results counted as received), here where it has none."""

    def empty(call) -> bool:
        return not call[0].rows  # a StagedShare or a ShareToPrepare

    sent = [call for call in calls if not empty(call)]
    done = engine.map_tasks(function, sent, rows, shared)
    results = iter(step_bytes.results(f"{kind} results", done.results))
    return replace(
        done,
        results=[function(*call, *shared) if empty(call) else next(results) for call in calls],
    )


def committed_before(flow: BatchFlow, lake: LakeResource, version: int) -> list[str]:
    """The tables whose partition of the batch a commit at ``version`` (this run's) already
    replaced: a step retried after some of its commits. Writing again would overwrite files those
    commits reference."""
    targets = [SilverTargets(lake.uri, flow.batch_id, t.fmt.name) for t in flow.formats]
    tables = {BANDS, *(table for target in targets for table in target.tables())}
    found = []
    for table in sorted(tables):
        delta = lake.table(*table.split("/"))
        carried = None if delta is None else delta.transaction_version(f"{table}/{flow.batch_id}")
        if carried is not None and carried >= version:
            found.append(table)
    return found


def commit_batch(flow: BatchFlow, lake: LakeResource, version: int) -> dict[str, DeltaCommit]:
    """Each table's partition of the batch replaced, once, by exactly the files the tasks wrote."""
    targets = [SilverTargets(lake.uri, flow.batch_id, tables.fmt.name) for tables in flow.formats]
    written = [counts.written for counts in flow.written]
    started = time.perf_counter()
    commits = commit_silver_tables(lake, written, targets, flow.batch_id, version)
    flow.commit_seconds = round(time.perf_counter() - started, 3)
    return commits


def clean_up(lake: LakeResource, flow: BatchFlow, tables: Sequence[str], run_started: float):
    """After the commits: the batch's staging folder gone (every run's), and the files an earlier
    run of the batch wrote into the tables' partitions without committing them."""
    filesystem = table_filesystem(lake.staging_uri(STAGE), lake.storage_options())
    if filesystem.get_file_info(flow.batch_id).type != pafs.FileType.NotFound:
        filesystem.delete_dir(flow.batch_id)
    return {
        table: lake.remove_uncommitted(
            *table.split("/"), "batch_id", flow.batch_id, keep_after=run_started
        )
        for table in tables
    }


@dataclass(frozen=True)
class FormatCounts:
    """One format's batch, counted for the metadata: no record read by the step."""

    bronze_rows: int
    input_chars: int
    silver_rows: int
    output_chars: int
    stages: dict[str, dict]  # as CuratedBatch.stages
    kept_by_source: dict[str, int]
    prompts: int  # a preference format's kept prompts
    block_stage_seconds: float
    ran_on: str


def format_counts(flow: BatchFlow, tables: FormatTables) -> FormatCounts:
    """The format's counts from its shares' and write tasks' plain values and its verdicts."""
    batch = flow.formats[tables]
    staged = [share.staged for share in batch.shares]
    written = [w for w in flow.written if w.written.format_name == tables.fmt.name]
    where = _where(share.where for share in batch.shares)
    before = staged_counters(staged)
    record_stages = staged[0].record_stages
    stages = stage_counters(before, record_stages, batch.decision)
    language_mix = _summed(w.language_mix for w in written)
    pooled = {
        stage.name: _actors(share.where for share in batch.shares)
        for stage in model_stages(flow.config, tables.fmt)
    }
    for name, counted in staged_record_counters(staged).items():
        # rows from the verdicts; prepare's seconds and model loads (on every record it saw)
        stages[name] = {**stages[name], **counted, **where, **pooled.get(name, {})}
    for name in before:
        stages[name] = {**stages[name], **where}
    if "language" in stages:
        stages["language"]["language_mix"] = dict(
            sorted(language_mix.items(), key=lambda item: (-item[1], item[0]))
        )
    block_stages = [*before, *record_stages]
    return FormatCounts(
        bronze_rows=batch.bronze_rows,
        input_chars=sum(block.input_chars for share in staged for block in share.blocks),
        silver_rows=sum(w.written.rows[f"silver/{tables.fmt.silver_table}"] for w in written),
        output_chars=sum(w.output_chars for w in written),
        stages=stages,
        kept_by_source=_summed(w.kept_by_source for w in written),
        prompts=len({h for w in written for h in w.prompt_hashes}),
        block_stage_seconds=round(sum(stages[name]["seconds"] for name in block_stages), 3),
        ran_on=engine_used(where) if where else "this process",
    )


def _where(places) -> dict:
    """``engine_used``'s counters for tasks that ran at ``places`` (none on Ray: none)."""
    places = list(places)
    nodes = sorted({node for p in places for node in p.nodes})
    if not nodes:
        return {}
    return {
        "ray_nodes": nodes,
        "ray_polars_threads": sorted({p.polars_threads for p in places}),
    }


def _actors(places) -> dict:
    """How many actors of a pool ran the model stages of the shares at ``places``."""
    actors = {actor for p in places for actor in p.actors}
    return {"actors": len(actors)} if actors else {}


def _summed(dicts) -> dict:
    out: dict = {}
    for counts in dicts:
        for key, value in counts.items():
            out[key] = out.get(key, 0) + value
    return out


def rejected_by_stage(flow: BatchFlow) -> pl.DataFrame:
    rows = _summed(w.rejected_by_stage for w in flow.written)
    return pl.DataFrame(
        [{"source": s, "stage": st, "rows": n} for (s, st), n in rows.items()],
        schema={"source": pl.String, "stage": pl.String, "rows": pl.UInt32},
    ).sort("source", "stage")


def check_kept_indexed(flow: BatchFlow, committed_rows: int) -> None:
    """The batch's kept records, counted by their decisions, must be the ``committed_rows`` rows
    of ``silver/minhash_index`` that its bands are written from."""
    kept = sum(batch.decision.kept_rows() for batch in flow.formats.values())
    if kept != committed_rows:
        raise RuntimeError(f"{kept} kept records but {committed_rows} silver/minhash_index rows")


def write_bands(flow: BatchFlow, lake: LakeResource, engine: BlockEngine, index: DeltaCommit):
    """A task a band (the exact and prompt bands included) writes the batch's rows of
    ``silver/minhash_bands`` from its entries in ``index`` (the commit of
    ``silver/minhash_index`` just made); the step receives only the files' add actions. Each band
    but the prompt band holds a row an entry: checked from the files' statistics."""
    targets = BandTargets(lake.uri, flow.batch_id, index.version)
    minhash = flow.config.minhash
    lsh = lsh_of(minhash)
    bands = band_numbers(lsh.bands) if index.rows else []  # no entry: the partition emptied
    calls = [(targets, band, flow.run_id, lake.storage_options()) for band in bands]
    done = engine.map_tasks(write_band_share, calls, flow.bronze_rows)
    flow.write_task_seconds = round(flow.write_task_seconds + done.task_seconds, 3)
    flow.write_wall_seconds = round(flow.write_wall_seconds + done.wall_seconds, 3)
    actions = flow.step_bytes.results("bands results", done.results)
    for band, action in zip(bands, actions, strict=True):
        rows = json.loads(action["stats"])["numRecords"] if action else 0
        if band != PROMPT_BAND and rows != index.rows:
            raise RuntimeError(
                f"band {band} of silver/minhash_bands: {rows} rows for {index.rows} index entries"
            )
    return [action for action in actions if action]


def commit_bands(flow: BatchFlow, lake: LakeResource, actions: list[dict], version: int):
    """The bands' files committed in one commit that replaces the batch's rows in every band."""
    started = time.perf_counter()
    commit = commit_band_shares(lake, actions, flow.batch_id, version)
    flow.commit_seconds = round(flow.commit_seconds + time.perf_counter() - started, 3)
    return commit


def run_flow(
    lake: LakeResource,
    engine: BlockEngine,
    formats: Sequence[FormatTables],
    batch_id: str,
    run_id: str,
    config: SilverConfig,
    eval_items: EvalItems,
    look_up: IndexLookup | None,
    bands_at: BandsAt | None,
) -> BatchFlow:
    """Prepare, decide and write one batch: everything before the commits."""
    flow = prepare_batch(lake, engine, formats, batch_id, run_id, config, eval_items)
    decide_batch(flow, engine, search_bands(flow, engine, bands_at, {}), look_up)
    write_batch(flow, lake, engine, config)
    return flow
