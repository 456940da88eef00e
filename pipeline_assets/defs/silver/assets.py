"""silver/<format's table> for each record format (silver/records, silver/preference_pairs),
silver/rejects, silver/minhash_index, silver/minhash_bands: one ingest batch, every record format's
rows curated by the same stages."""

import time
from dataclasses import replace

import polars as pl
from dagster import (
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    AssetSpec,
    Failure,
    MaterializeResult,
    multi_asset,
)

from pipeline_assets.contracts import (
    MinhashBandEntry,
    MinhashIndexEntry,
    SilverReject,
    polars_schema,
)
from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.format_tables import FORMAT_TABLES, SFT_TABLES, FormatTables
from pipeline_assets.defs.keys import (
    REFERENCE_EVAL_SETS,
    REFERENCE_QUALITY_MODELS,
    SILVER_MINHASH_BANDS,
    SILVER_MINHASH_INDEX,
    SILVER_RECORDS,
    SILVER_REJECTS,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.policies import SilverPolicy
from pipeline_assets.defs.silver.checks import KEPT_BY_SOURCE, REJECTED_BY_STAGE
from pipeline_assets.defs.silver.flow import (
    BatchFlow,
    FormatCounts,
    check_kept_indexed,
    clean_up,
    commit_bands,
    commit_batch,
    committed_before,
    decide_batch,
    entries_folder,
    format_counts,
    prepare_batch,
    rejected_by_stage,
    search_bands,
    write_bands,
    write_batch,
)
from pipeline_assets.defs.silver.lookup import index_lookup
from pipeline_assets.defs.silver.order import batch_events
from pipeline_assets.lib.silver.decontam import NO_EVAL_SETS, EvalItems, eval_set_names
from pipeline_assets.lib.silver.dedup import lsh_of
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.order import BatchEvents, unsettled_before
from pipeline_assets.resources.engine import BlockEngine, engine_used
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.quality_models import QualityModelsResource, models_fingerprint
from pipeline_assets.resources.silver_shares import BANDS, INDEX

_KINDS = {"delta", "polars"}


def _spec(key, description: str, formats=FORMAT_TABLES) -> AssetSpec:
    """A silver table, fed by the bronze tables of the formats it holds, the eval sets and the
    quality models."""
    # No automation condition: the silver_in_order sensor requests one batch at a time,
    # oldest first.
    deps = [
        *(AssetDep(tables.bronze) for tables in formats),
        AssetDep(REFERENCE_EVAL_SETS),
        AssetDep(REFERENCE_QUALITY_MODELS),
    ]
    return AssetSpec(key, description=description, group_name="silver", kinds=_KINDS, deps=deps)


@multi_asset(
    specs=[
        *(
            _spec(
                tables.silver,
                f"The {tables.fmt.about} silver kept: normalized, exact and near deduplicated, "
                "decontaminated, quality-gated, and judged by the format's own rules where it has "
                "some (preference pairs: no empty side, chosen unlike rejected, no tie, no "
                "contradiction, a cap a prompt).",
                [tables],
            )
            for tables in FORMAT_TABLES
        ),
        _spec(
            SILVER_REJECTS,
            "Every record silver removed, with the stage that removed it and the evidence.",
        ),
        _spec(
            SILVER_MINHASH_INDEX,
            "Exact hashes, MinHash signatures and LSH band keys of kept records.",
        ),
        _spec(
            SILVER_MINHASH_BANDS,
            "The index's keys by band (the exact hashes' first 60 bits as band -1, preference "
            "pairs' prompt hashes as band -2), partitioned by band: what a new batch is joined "
            "with, a task a band.",
        ),
    ],
    partitions_def=ingest_batches,
    pool="silver",  # one batch at a time: each dedups against the index the others wrote
)
def silver(
    context: AssetExecutionContext,
    lake: LakeResource,
    eval_sets: EvalSetsResource,
    silver_policy: SilverPolicy,
    ray_engine: BlockEngine,
    batch_gates: BatchGates,
    quality_models: QualityModelsResource,
):
    stopwatch = Stopwatch()
    batch_id = context.partition_key
    events = batch_events(context.instance, batch_gates)
    _require_earlier_batches(events, batch_id)
    config = replace(silver_policy.silver_config(), scorers=tuple(quality_models.local_specs()))
    models = quality_models.identities()
    eval_files = eval_sets.files()
    eval_version = eval_sets.fingerprint(eval_files)
    eval_items = EvalItems(
        eval_sets.items(eval_files), silver_policy.decontam_config(), eval_version
    )
    run_started = _run_started(context)

    flow = prepare_batch(
        lake, ray_engine, FORMAT_TABLES, batch_id, context.run_id, config, eval_items
    )
    look_up, lookup_report, bands_at = index_lookup(
        context,
        lake,
        ray_engine,
        batch_rows=flow.bronze_rows,
        excluded=_left_out_of_dedup(context, events, batch_id),
        config=config.minhash,
        stage_signatures=entries_folder(flow),
    )
    context.log.info(
        f"batch {batch_id}: "
        + ", ".join(
            f"{batch.bronze_rows} rows of {tables.bronze.to_user_string()} v{batch.version} in "
            f"{len(batch.shares)} prepare task(s)"
            for tables, batch in flow.formats.items()
        )
        + f"; {len(eval_files)} eval set file(s), {eval_items.items.height} item(s)"
    )
    decontamination = _decontamination_note(eval_items)
    if eval_items.items.is_empty():
        context.log.info(f"decontamination: {decontamination}")
    decide_batch(flow, ray_engine, search_bands(flow, ray_engine, bands_at, lookup_report), look_up)
    version = int(run_started * 1000)
    _refuse_a_partly_committed_run(flow, lake, version)
    write_batch(flow, lake, ray_engine, config)
    committed = commit_batch(flow, lake, version)
    check_kept_indexed(flow, committed[INDEX].rows)
    band_files = write_bands(flow, lake, ray_engine, committed[INDEX])
    committed[BANDS] = commit_bands(flow, lake, band_files, version)
    commits = {AssetKey(table.split("/")): commit for table, commit in committed.items()}
    removed = clean_up(lake, flow, list(committed), run_started)
    counts = {tables: format_counts(flow, tables) for tables in FORMAT_TABLES}
    _log_stages(context, flow, counts, lookup_report, removed)

    upstream = {
        **{tables.bronze.to_user_string(): batch.version for tables, batch in flow.formats.items()},
        "reference/eval_sets": eval_version,
        REFERENCE_QUALITY_MODELS.to_user_string(): models_fingerprint(models),
        **lookup_report.get("versions", {}),
    }
    index_rows = commits[SILVER_MINHASH_INDEX].rows
    lsh = _lsh_label(config.minhash) if index_rows else None
    metadata = _metadata(flow, counts, lsh, lookup_report)
    metadata[SILVER_RECORDS]["decontamination"] = decontamination
    for key in metadata:
        metadata[key]["quality_models"] = models
    input_bytes = sum(c.input_chars for c in counts.values())
    for key, model in _CONTRACTS.items():
        written = delta_write_metadata(
            commits[key],
            polars_schema(model),
            upstream_versions=upstream,
            input_bytes=input_bytes,
            stopwatch=stopwatch,
        )
        yield MaterializeResult(asset_key=key, metadata={**written, **metadata[key]})


def _refuse_a_partly_committed_run(flow: BatchFlow, lake: LakeResource, version: int) -> None:
    committed = committed_before(flow, lake, version)
    if committed:
        raise Failure(
            allow_retries=False,
            description=f"this run already committed {', '.join(committed)} for batch "
            f"{flow.batch_id}; its files must not be written again. Materialize the batch in a "
            "new run: it replaces every table's partition.",
        )


def _run_started(context: AssetExecutionContext) -> float:
    """When the run was created (epoch seconds): its commits' application transaction version,
    and the files older than it that no version references are a dead run's."""
    record = context.instance.get_run_record_by_id(context.run_id)
    return record.create_timestamp.timestamp() if record else time.time()


def _decontamination_note(eval_items: EvalItems) -> str:
    if eval_items.items.height:
        names = ", ".join(eval_set_names(eval_items.items))
        return f"against the {eval_items.items.height:,} items of the eval sets {names}"
    return f"none: {NO_EVAL_SETS}; nothing was rejected as contaminated"


_CONTRACTS = {
    **{tables.silver: tables.silver_contract for tables in FORMAT_TABLES},
    SILVER_REJECTS: SilverReject,
    SILVER_MINHASH_INDEX: MinhashIndexEntry,
    SILVER_MINHASH_BANDS: MinhashBandEntry,
}


def _metadata(
    flow: BatchFlow,
    counts: dict[FormatTables, FormatCounts],
    lsh: str | None,
    lookup_report: dict,
) -> dict[AssetKey, dict]:
    """Each table's own metadata; the batch's sft records and lookup are reported on every table but
    the other formats' kept rows, which report their own."""
    counted = {
        tables: {"batch_id": flow.batch_id, **_format_metadata(counts[tables])}
        for tables in FORMAT_TABLES
    }
    kept = {
        tables.silver: {**counted[tables], **_kept_metadata(counts[tables])}
        for tables in FORMAT_TABLES
    }
    batch = {**counted[SFT_TABLES], **_lookup_metadata(flow, counts[SFT_TABLES], lookup_report)}
    return {
        **kept,
        SILVER_RECORDS: {**kept[SILVER_RECORDS], **batch},
        SILVER_REJECTS: {**batch, REJECTED_BY_STAGE: table_metadata(rejected_by_stage(flow))},
        SILVER_MINHASH_INDEX: {
            **batch,
            "lsh_params": lsh,
        },
        SILVER_MINHASH_BANDS: batch,
    }


def _lsh_label(minhash: MinHashConfig) -> str:
    """The index entries' ``lsh_params``: the settings their band keys were made with."""
    params = lsh_of(minhash)
    return params.label(minhash)


def _log_stages(
    context: AssetExecutionContext,
    flow: BatchFlow,
    counts: dict[FormatTables, FormatCounts],
    lookup_report: dict,
    removed: dict,
) -> None:
    per_record = {
        kind: round(size / max(flow.bronze_rows, 1), 1)
        for kind, size in flow.step_bytes.by_kind.items()
    }
    context.log.info(f"bytes through the step's process a bronze record: {per_record}")
    if "tasks" in lookup_report:
        context.log.info(
            f"index lookup: {flow.index_lookup}; tasks: {lookup_report['tasks']}, on "
            f"{lookup_report['ran_on']}"
        )
    for tables, counted in counts.items():
        for stage, counters in counted.stages.items():
            context.log.info(f"{tables.fmt.name} {stage}: {counters}")
    orphans = {table: r for table, r in removed.items() if r.files}
    if orphans:
        context.log.info(f"removed files an earlier run wrote and never committed: {orphans}")


def _format_metadata(counts: FormatCounts) -> dict:
    return {
        "bronze_rows": counts.bronze_rows,
        "input_chars": counts.input_chars,
        "silver_rows": counts.silver_rows,
        "output_chars": counts.output_chars,  # what the snapshot cadence weighs
        "rejected_rows": counts.bronze_rows - counts.silver_rows,
        "pass_rate": (
            round(counts.silver_rows / counts.bronze_rows, 4) if counts.bronze_rows else None
        ),
        "stages": table_metadata(_stage_table(counts.stages)),
        "language_mix": counts.stages["language"].get("language_mix", {}),
        "scorers": _scorer_metadata(counts.stages),
    }


def _scorer_metadata(stages: dict[str, dict]) -> dict:
    """Per scorer: where its model ran, how many processes loaded it, how many actors of a pool
    ran it, and its records/s."""
    return {
        name.removeprefix("score_"): {
            "ran_on": engine_used(counters),
            "model_loads": counters["model_loads"],
            "actors": counters.get("actors", 0),  # of the pool that ran it; 0: no pool
            "records": counters["rows_in"],
            "records_per_second": round(counters["rows_in"] / max(counters["seconds"], 1e-9), 1),
        }
        for name, counters in stages.items()
        if name.startswith("score_")
    }


def _kept_metadata(counts: FormatCounts) -> dict:
    """The kept rows by source, and what the pair rules watch for a format they judge."""
    by_source = pl.DataFrame(
        list(counts.kept_by_source.items()),
        schema={"source": pl.String, "rows": pl.UInt32},
        orient="row",
    ).sort("source")
    if "pair_sides" not in counts.stages:
        return {KEPT_BY_SOURCE: table_metadata(by_source)}
    return {
        KEPT_BY_SOURCE: table_metadata(by_source),
        "prompts": counts.prompts,
        "length_ratio_beyond_4x": counts.stages["pair_sides"]["length_ratio_beyond_4x"],
    }  # DPO's length bias


def _lookup_metadata(flow: BatchFlow, records: FormatCounts, lookup_report: dict) -> dict:
    return {
        "block_stages_ran_on": records.ran_on,
        # the sizer spreads these over a cluster's cores: prepare's stages, the band searches
        # within the batch and the write tasks
        "block_stage_seconds": round(
            records.block_stage_seconds + flow.search_task_seconds + flow.write_task_seconds, 3
        ),
        "block_wall_seconds": round(
            flow.prepare_wall_seconds + flow.search_wall_seconds + flow.write_wall_seconds, 3
        ),
        "prepare_wall_seconds": flow.prepare_wall_seconds,
        "search_wall_seconds": flow.search_wall_seconds,
        "write_wall_seconds": flow.write_wall_seconds,
        "decide_seconds": flow.decide_seconds,
        "commit_seconds": flow.commit_seconds,
        "index_keys_looked_up": flow.index_lookup["keys"],
        "index_entries_found": flow.index_lookup["entries_found"],
        "index_lookup_seconds": flow.index_lookup["seconds"],
        "index_lookup_ran_on": lookup_report.get("ran_on", "nothing to look up"),
        "index_lookup_tasks": lookup_report.get("tasks", "none"),
        # what the sizer spreads over a cluster: the lookup tasks' own seconds, the wall spent on
        # them, a task a band and slice
        "index_lookup_task_seconds": round(lookup_report.get("task_seconds", 0.0), 3),
        "index_lookup_wait_seconds": round(lookup_report.get("wait_seconds", 0.0), 3),
        "index_lookup_bands": lookup_report.get("bands", 0),
        # what the step's process read or received: keys, verdicts, index hashes, task results
        "step_bytes_per_record": (
            round(flow.step_bytes.bytes / flow.bronze_rows, 1) if flow.bronze_rows else 0.0
        ),
        "step_bytes_per_record_by_kind": {
            kind: round(size / max(flow.bronze_rows, 1), 1)
            for kind, size in flow.step_bytes.by_kind.items()
        },
    }


def _require_earlier_batches(events: list[BatchEvents], batch_id: str) -> None:
    """Batches go through silver in arrival order (silver_in_order requests them so); a run by hand
    out of order fails at once, naming the earlier batches that are neither done nor excluded."""
    unsettled = unsettled_before(events, batch_id)
    if not unsettled:
        return
    named = ", ".join(f"{batch} ({stage.value})" for batch, stage in unsettled[:3]) + (
        ", ..." if len(unsettled) > 3 else ""
    )
    raise Failure(
        allow_retries=False,
        description=f"silver takes batches in arrival order, and {len(unsettled)} batch(es) before "
        f"{batch_id} are neither done nor excluded: {named}. Materialize those first (the "
        "silver_in_order sensor and pipeline-assets run go oldest first).",
    )


def _left_out_of_dedup(
    context: AssetExecutionContext, events: list[BatchEvents], batch_id: str
) -> list[str]:
    """The batch itself and blocked batches: their records never reach gold, so they must not reject
    a later copy. A batch re-run after later ones dedups against those too."""
    blocked = sorted(
        e.batch_id
        for e in events
        if (e.bronze_blocked or e.silver_blocked) and e.batch_id != batch_id
    )
    if blocked:
        context.log.info(f"dedup leaves out {len(blocked)} blocked batch(es): {', '.join(blocked)}")
    return [batch_id, *blocked]


def _stage_table(stages: dict[str, dict]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "stage": name,
                "rows_in": c["rows_in"],
                "removed": c["rejected"],
                "seconds": c["seconds"],
            }
            for name, c in stages.items()
        ]
    )
