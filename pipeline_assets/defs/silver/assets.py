"""silver/records, silver/rejects, silver/minhash_index, silver/minhash_bands: one ingest batch, curated."""

import polars as pl
from dagster import AssetDep, AssetExecutionContext, AssetSpec, DagsterInstance, Failure, MaterializeResult, multi_asset

from pipeline_assets.contracts import MinhashBandEntry, MinhashIndexEntry, SilverRecord, SilverReject, conform, polars_schema, validate
from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    REFERENCE_EVAL_SETS,
    SILVER_MINHASH_BANDS,
    SILVER_MINHASH_INDEX,
    SILVER_RECORDS,
    SILVER_REJECTS,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.silver.lookup import index_lookup, write_bands
from pipeline_assets.defs.silver.order import batch_events, blocked_batches
from pipeline_assets.engine import BlockEngine, engine_used
from pipeline_assets.lib.decontam import EvalNgramIndex
from pipeline_assets.lib.silver import curate
from pipeline_assets.lib.silver_order import unsettled_before
from pipeline_assets.lib.sizing import text_chars
from pipeline_assets.resources import EvalSetsResource, LakeResource, SilverPolicy

_KINDS = {"delta", "polars"}
_DEPS = [AssetDep(BRONZE_RECORDS), AssetDep(REFERENCE_EVAL_SETS)]


def _spec(key, description: str) -> AssetSpec:
    # No automation condition: the silver_in_order sensor requests one batch at a time, oldest first.
    return AssetSpec(key, description=description, group_name="silver", kinds=_KINDS, deps=_DEPS)


@multi_asset(
    specs=[
        _spec(SILVER_RECORDS, "Normalized, exact and near deduplicated, decontaminated, quality-gated records."),
        _spec(SILVER_REJECTS, "Every record silver removed, with the stage that removed it and the evidence."),
        _spec(SILVER_MINHASH_INDEX, "Exact hashes, MinHash signatures and LSH band keys of kept records."),
        _spec(SILVER_MINHASH_BANDS, "The index's keys by band (and the exact hashes' first 60 bits, band -1), "
              "partitioned by band: what a new batch is joined with, a task a band."),
    ],
    partitions_def=ingest_batches,
    pool="silver",  # one batch at a time: each dedups against the index the others wrote
)
def silver(context: AssetExecutionContext, lake: LakeResource, eval_sets: EvalSetsResource, silver_policy: SilverPolicy,
           ray_engine: BlockEngine):
    stopwatch = Stopwatch()
    batch_id = context.partition_key
    _require_earlier_batches(context.instance, batch_id)
    bronze_version = lake.version("bronze", "records")
    bronze = lake.read("bronze", "records", version=bronze_version, where=pl.col("batch_id") == batch_id)
    eval_files = eval_sets.files()
    eval_index = EvalNgramIndex.build(eval_sets.items(eval_files), silver_policy.decontam_config())
    look_up, lookup_report = index_lookup(context, lake, ray_engine, batch_rows=bronze.height,
                                          excluded=_left_out_of_dedup(context, batch_id),
                                          config=silver_policy.silver_config().minhash)
    context.log.info(
        f"batch {batch_id}: {bronze.height} bronze rows (bronze/records v{bronze_version}); "
        f"{len(eval_files)} eval set file(s), {len(eval_index)} n-grams"
    )

    curated = curate(bronze, look_up, eval_index, silver_policy.silver_config(), ray_engine.run)
    context.log.info(f"index lookup: {curated.index_lookup}, {lookup_report.get('tasks', 0)} task(s) on "
                     f"{lookup_report.get('ran_on', 'nothing')}")
    for stage, counters in curated.stages.items():
        context.log.info(f"{stage}: {counters}")

    kept = validate(conform(curated.kept, SilverRecord), SilverRecord)
    rejects = validate(conform(curated.rejects, SilverReject), SilverReject)
    index = validate(conform(curated.index, MinhashIndexEntry), MinhashIndexEntry)
    if bronze.height != kept.height + rejects.height:
        raise RuntimeError(f"accounting broken: {bronze.height} bronze rows != {kept.height} kept + {rejects.height} rejected")
    commits = {  # add_columns: an index written before response_signature existed takes the column
        key: lake.replace_partition(*key.path, frame, column="batch_id", value=batch_id, add_columns=True)
        for key, frame in ((SILVER_RECORDS, kept), (SILVER_REJECTS, rejects), (SILVER_MINHASH_INDEX, index))
    }
    commits[SILVER_MINHASH_BANDS] = write_bands(lake, index, batch_id)

    upstream = {"bronze/records": bronze_version, "reference/eval_sets": eval_sets.fingerprint(eval_files),
                **lookup_report.get("versions", {})}
    shared = {
        "batch_id": batch_id,
        "bronze_rows": bronze.height,
        "input_chars": text_chars(bronze),
        "silver_rows": kept.height,
        "output_chars": text_chars(kept),  # what the snapshot cadence weighs
        "rejected_rows": rejects.height,
        "pass_rate": round(kept.height / bronze.height, 4) if bronze.height else None,
        "stages": table_metadata(_stage_table(curated.stages)),
        "block_stages_ran_on": engine_used(curated.stages["normalize"]),
        "block_stage_seconds": curated.block_stage_seconds,  # the sizer spreads these over a cluster's cores
        "block_wall_seconds": curated.block_wall_seconds,
        "index_keys_looked_up": curated.index_lookup["keys"],
        "index_entries_found": curated.index_lookup["entries_found"],
        "index_lookup_seconds": curated.index_lookup.get("seconds", 0.0),
        "index_lookup_ran_on": lookup_report.get("ran_on", "nothing to look up"),
        # what the sizer spreads over a cluster: the lookup tasks' own seconds, the wall spent on them, a task a band and slice
        "index_lookup_task_seconds": round(lookup_report.get("task_seconds", 0.0), 3),
        "index_lookup_wait_seconds": round(lookup_report.get("wait_seconds", 0.0), 3),
        "index_lookup_bands": lookup_report.get("bands", 0),
    }
    extra = {
        SILVER_RECORDS: {"kept_by_source": table_metadata(kept.group_by("source").len("rows").sort("source"))},
        SILVER_REJECTS: {"rejected_by_stage": table_metadata(rejects.group_by("source", "stage").len("rows").sort("source", "stage"))},
        SILVER_MINHASH_INDEX: {"lsh_params": index["lsh_params"][0] if index.height else None},
        SILVER_MINHASH_BANDS: {},
    }
    contracts = {SILVER_RECORDS: SilverRecord, SILVER_REJECTS: SilverReject, SILVER_MINHASH_INDEX: MinhashIndexEntry,
                 SILVER_MINHASH_BANDS: MinhashBandEntry}
    for key, model in contracts.items():
        yield MaterializeResult(
            asset_key=key,
            metadata={
                **delta_write_metadata(
                    commits[key], polars_schema(model), upstream_versions=upstream,
                    input_bytes=int(bronze.estimated_size()), stopwatch=stopwatch,
                ),
                **shared,
                **extra[key],
            },
        )


def _require_earlier_batches(instance: DagsterInstance, batch_id: str) -> None:
    """Batches go through silver in arrival order (silver_in_order requests them so); a run by hand
    out of order fails at once, naming the earlier batches that are neither done nor excluded."""
    unsettled = unsettled_before(batch_events(instance), batch_id)
    if not unsettled:
        return
    named = ", ".join(f"{batch} ({stage.value})" for batch, stage in unsettled[:3]) + (", ..." if len(unsettled) > 3 else "")
    raise Failure(
        allow_retries=False,
        description=f"silver takes batches in arrival order, and {len(unsettled)} batch(es) before {batch_id} are neither "
        f"done nor excluded: {named}. Materialize those first (the silver_in_order sensor and pipeline-assets run go "
        "oldest first).",
    )


def _left_out_of_dedup(context: AssetExecutionContext, batch_id: str) -> list[str]:
    """The batch itself and blocked batches: their records never reach gold, so they must not reject a
    later copy. A batch re-run after later ones dedups against those too."""
    blocked = sorted(blocked_batches(context.instance) - {batch_id})
    if blocked:
        context.log.info(f"dedup leaves out {len(blocked)} blocked batch(es): {', '.join(blocked)}")
    return [batch_id, *blocked]


def _stage_table(stages: dict[str, dict]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {"stage": name, "rows_in": c.get("rows_in", c.get("rows")), "removed": c.get("rejected", 0), "seconds": c["seconds"]}
            for name, c in stages.items()
        ]
    )
