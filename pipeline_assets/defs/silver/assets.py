"""silver/<format's table> for each record format (silver/records, silver/preference_pairs),
silver/rejects, silver/minhash_index, silver/minhash_bands: one ingest batch, every record format's
rows curated by the same stages."""

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
    conform,
    polars_schema,
    validate,
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
from pipeline_assets.defs.silver.lookup import index_lookup, write_bands
from pipeline_assets.defs.silver.order import batch_events
from pipeline_assets.lib.formats import text_chars
from pipeline_assets.lib.silver.curation import CuratedBatch, CuratedFormats, curate_formats
from pipeline_assets.lib.silver.decontam import NO_EVAL_SETS, EvalNgramIndex
from pipeline_assets.lib.silver.order import BatchEvents, unsettled_before
from pipeline_assets.resources.engine import BlockEngine, engine_used
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import DeltaCommit, LakeResource
from pipeline_assets.resources.quality_models import QualityModelsResource, models_fingerprint

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
    bronze = {tables: _bronze_rows(lake, tables, batch_id) for tables in FORMAT_TABLES}
    rows = {tables: frame for tables, (_, frame) in bronze.items()}
    eval_files = eval_sets.files()
    eval_index = EvalNgramIndex.build(eval_sets.items(eval_files), silver_policy.decontam_config())
    look_up, lookup_report = index_lookup(
        context,
        lake,
        ray_engine,
        batch_rows=sum(f.height for f in rows.values()),
        excluded=_left_out_of_dedup(context, events, batch_id),
        config=config.minhash,
    )
    context.log.info(
        f"batch {batch_id}: "
        + ", ".join(
            f"{frame.height} rows of {tables.bronze.to_user_string()} v{version}"
            for tables, (version, frame) in bronze.items()
        )
        + f"; {len(eval_files)} eval set file(s), {len(eval_index)} n-grams"
    )
    decontamination = _decontamination_note(eval_index)
    if not len(eval_index):
        context.log.info(f"decontamination: {decontamination}")

    # a format the batch has none of: an empty partition to write
    curated = curate_formats(
        {tables.fmt: frame for tables, frame in rows.items()},
        look_up,
        eval_index,
        config,
        ray_engine.run,
    )
    _log_stages(context, curated, lookup_report)
    partitions = _batch_partitions(rows, {tables: curated.formats[tables.fmt] for tables in rows})
    commits = _write(lake, partitions, batch_id)
    upstream = {
        **{tables.bronze.to_user_string(): version for tables, (version, _) in bronze.items()},
        "reference/eval_sets": eval_sets.fingerprint(eval_files),
        REFERENCE_QUALITY_MODELS.to_user_string(): models_fingerprint(models),
        **lookup_report.get("versions", {}),
    }
    metadata = _metadata(batch_id, rows, curated, partitions, lookup_report)
    metadata[SILVER_RECORDS]["decontamination"] = decontamination
    for key in metadata:
        metadata[key]["quality_models"] = models
    input_bytes = sum(int(frame.estimated_size()) for frame in rows.values())
    for key, model in _CONTRACTS.items():
        written = delta_write_metadata(
            commits[key],
            polars_schema(model),
            upstream_versions=upstream,
            input_bytes=input_bytes,
            stopwatch=stopwatch,
        )
        yield MaterializeResult(asset_key=key, metadata={**written, **metadata[key]})


def _decontamination_note(eval_index: EvalNgramIndex) -> str:
    if len(eval_index):
        return f"against {len(eval_index):,} n-grams of the eval sets"
    return f"none: {NO_EVAL_SETS}; nothing was rejected as contaminated"


_CONTRACTS = {
    **{tables.silver: tables.silver_contract for tables in FORMAT_TABLES},
    SILVER_REJECTS: SilverReject,
    SILVER_MINHASH_INDEX: MinhashIndexEntry,
    SILVER_MINHASH_BANDS: MinhashBandEntry,
}


def _batch_partitions(
    rows: dict[FormatTables, pl.DataFrame], curated: dict[FormatTables, CuratedBatch]
) -> dict[AssetKey, pl.DataFrame]:
    """The batch's partition of each silver table but the bands: each format's kept rows, and every
    format's rejects and index entries, to their contracts; every bronze row kept or rejected."""
    kept = {tables: _to_contract(tables.silver_contract, [c.kept]) for tables, c in curated.items()}
    rejects = _to_contract(SilverReject, [c.rejects for c in curated.values()])
    for tables, frame in rows.items():
        removed = rejects.filter(pl.col("record_id").is_in(frame["record_id"].implode())).height
        if frame.height != kept[tables].height + removed:
            raise RuntimeError(
                f"accounting broken: {frame.height} {tables.bronze.to_user_string()} rows != "
                f"{kept[tables].height} kept + {removed} rejected"
            )
    return {
        **{tables.silver: kept[tables] for tables in FORMAT_TABLES},
        SILVER_REJECTS: rejects,
        SILVER_MINHASH_INDEX: _to_contract(MinhashIndexEntry, [c.index for c in curated.values()]),
    }


def _to_contract(model, frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Every format's rows in one frame, conformed to ``model`` and validated."""
    return validate(conform(_concat(model, frames), model), model)


def _write(
    lake: LakeResource, partitions: dict[AssetKey, pl.DataFrame], batch_id: str
) -> dict[AssetKey, DeltaCommit]:
    """Replace the batch's partition of each silver table; the bands table's from the index
    entries."""
    # add_columns: a table written before a column existed (response_signature, prompt_hash)
    # takes it
    commits = {
        key: lake.replace_partition(
            *key.path, frame, column="batch_id", value=batch_id, add_columns=True
        )
        for key, frame in partitions.items()
    }
    commits[SILVER_MINHASH_BANDS] = write_bands(lake, partitions[SILVER_MINHASH_INDEX], batch_id)
    return commits


def _metadata(
    batch_id: str,
    rows: dict[FormatTables, pl.DataFrame],
    curated: CuratedFormats,
    partitions: dict[AssetKey, pl.DataFrame],
    lookup_report: dict,
) -> dict[AssetKey, dict]:
    """Each table's own metadata; the batch's sft records and lookup are reported on every table but
    the other formats' kept rows, which report their own."""
    counted = {
        tables: {
            "batch_id": batch_id,
            **_format_metadata(
                rows[tables], partitions[tables.silver], curated.formats[tables.fmt]
            ),
        }
        for tables in FORMAT_TABLES
    }
    kept = {
        tables.silver: {
            **counted[tables],
            **_kept_metadata(partitions[tables.silver], curated.formats[tables.fmt]),
        }
        for tables in FORMAT_TABLES
    }
    rejects, index = partitions[SILVER_REJECTS], partitions[SILVER_MINHASH_INDEX]
    batch = {**counted[SFT_TABLES], **_lookup_metadata(curated, lookup_report)}
    return {
        **kept,
        SILVER_RECORDS: {**kept[SILVER_RECORDS], **batch},
        SILVER_REJECTS: {
            **batch,
            "rejected_by_stage": table_metadata(
                rejects.group_by("source", "stage").len("rows").sort("source", "stage")
            ),
        },
        SILVER_MINHASH_INDEX: {
            **batch,
            "lsh_params": index["lsh_params"][0] if index.height else None,
        },
        SILVER_MINHASH_BANDS: batch,
    }


def _bronze_rows(
    lake: LakeResource, tables: FormatTables, batch_id: str
) -> tuple[int | None, pl.DataFrame]:
    """The batch's rows of the format's bronze table at its current version (a column its contract
    gained since the table was written: null); none while it does not exist."""
    version = lake.version(*tables.bronze.path)
    rows = (
        None
        if version is None
        else lake.read(*tables.bronze.path, version=version, where=pl.col("batch_id") == batch_id)
    )
    schema = polars_schema(tables.bronze_contract)
    if rows is not None and set(schema) <= set(rows.columns):
        return version, rows
    return version, _concat(tables.bronze_contract, [] if rows is None else [rows])


def _concat(model, frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Every format's rows in one frame with every column of ``model`` (null where a format has
    none)."""
    return pl.concat([pl.DataFrame(schema=polars_schema(model)), *frames], how="diagonal_relaxed")


def _log_stages(
    context: AssetExecutionContext, curated: CuratedFormats, lookup_report: dict
) -> None:
    if "tasks" in lookup_report:
        context.log.info(
            f"index lookup: {curated.index_lookup}; tasks: {lookup_report['tasks']}, on "
            f"{lookup_report['ran_on']}"
        )
    for fmt, batch in curated.formats.items():
        context.log.info(f"{fmt.name} index lookup: {batch.index_lookup}")
        for stage, counters in batch.stages.items():
            context.log.info(f"{fmt.name} {stage}: {counters}")


def _format_metadata(bronze: pl.DataFrame, kept: pl.DataFrame, curated: CuratedBatch) -> dict:
    return {
        "bronze_rows": bronze.height,
        "input_chars": text_chars(bronze),
        "silver_rows": kept.height,
        "output_chars": text_chars(kept),  # what the snapshot cadence weighs
        "rejected_rows": bronze.height - kept.height,
        "pass_rate": round(kept.height / bronze.height, 4) if bronze.height else None,
        "stages": table_metadata(_stage_table(curated.stages)),
        "language_mix": curated.stages["language"].get("language_mix", {}),
        "scorers": _scorer_metadata(curated.stages),
    }


def _scorer_metadata(stages: dict[str, dict]) -> dict:
    """Per scorer: where its model ran, how many processes loaded it, and its records/s."""
    return {
        name.removeprefix("score_"): {
            "ran_on": engine_used(counters),
            "model_loads": counters["model_loads"],
            "records": counters["rows_in"],
            "records_per_second": round(counters["rows_in"] / max(counters["seconds"], 1e-9), 1),
        }
        for name, counters in stages.items()
        if name.startswith("score_")
    }


def _kept_metadata(kept: pl.DataFrame, curated: CuratedBatch) -> dict:
    """The kept rows by source, and what the pair rules watch for a format they judge."""
    if "pair_sides" not in curated.stages:
        return {"kept_by_source": _by_source(kept)}
    return {
        "kept_by_source": _by_source(kept),
        "prompts": kept["prompt_hash"].n_unique(),
        "length_ratio_beyond_4x": curated.stages["pair_sides"]["length_ratio_beyond_4x"],
    }  # DPO's length bias


def _by_source(kept: pl.DataFrame):
    return table_metadata(kept.group_by("source").len("rows").sort("source"))


def _lookup_metadata(curated: CuratedFormats, lookup_report: dict) -> dict:
    records = curated.formats[SFT_TABLES.fmt]
    return {
        "block_stages_ran_on": engine_used(records.stages["normalize"]),
        # the sizer spreads these over a cluster's cores
        "block_stage_seconds": records.block_stage_seconds,
        "block_wall_seconds": records.block_wall_seconds,
        "index_keys_looked_up": curated.index_lookup["keys"],
        "index_entries_found": curated.index_lookup["entries_found"],
        "index_lookup_seconds": curated.index_lookup["seconds"],
        "index_lookup_ran_on": lookup_report.get("ran_on", "nothing to look up"),
        "index_lookup_tasks": lookup_report.get("tasks", "none"),
        # what the sizer spreads over a cluster: the lookup tasks' own seconds, the wall spent on
        # them, a task a band and slice
        "index_lookup_task_seconds": round(lookup_report.get("task_seconds", 0.0), 3),
        "index_lookup_wait_seconds": round(lookup_report.get("wait_seconds", 0.0), 3),
        "index_lookup_bands": lookup_report.get("bands", 0),
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
