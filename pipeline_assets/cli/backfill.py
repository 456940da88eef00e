"""``pipeline-assets backfill-decontamination``: redo silver for every batch decontaminated against
other eval sets than the current ones, or scored by other quality models, oldest first, then cut
the next data snapshot."""

from __future__ import annotations

import logging

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, Definitions

from pipeline_assets.cli.headless import (
    RunOutcome,
    _execute,
    cut_snapshot_if_due,
    observe_eval_sets,
    observe_source,
)
from pipeline_assets.defs.keys import (
    GOLD_SEQUENCES,
    GOLD_SNAPSHOTS,
    REFERENCE_EVAL_SETS,
    REFERENCE_QUALITY_MODELS,
    SILVER_RECORDS,
)
from pipeline_assets.defs.silver.order import batch_events
from pipeline_assets.lib.silver.order import BatchEvents, Stage, stage, unsettled_before

log = logging.getLogger("pipeline_assets")

_TAGS = {"pipeline/trigger": "backfill-decontamination"}


def backfill_decontamination(defs: Definitions, instance: DagsterInstance) -> RunOutcome:
    """Observe the eval sets and the quality models; re-materialize silver, one batch at a time in
    arrival order, for every batch whose silver was decontaminated against another version of the
    sets or scored by other models; then rebuild their gold shards and cut a new snapshot of the
    records as they now stand. Batches not done in silver are left to silver_in_order and
    ``pipeline-assets run``, which use the current sets and models anyway."""
    outcome = RunOutcome()
    current = {REFERENCE_EVAL_SETS: observe_eval_sets(defs, instance, outcome)}
    if current[REFERENCE_EVAL_SETS] is None:
        if not outcome.failed_runs:
            raise ValueError("these definitions have no observable reference/eval_sets")
        return outcome
    current[REFERENCE_QUALITY_MODELS] = observe_source(
        defs, instance, outcome, REFERENCE_QUALITY_MODELS
    )
    if outcome.failed_runs:
        return outcome
    events = batch_events(instance, defs.resources["batch_gates"])
    batches = _silver_read_other_versions(
        instance, events, {key: version for key, version in current.items() if version}
    )
    log.info(
        "eval sets at data version %s, quality models at %s: %d silver batch(es) to redo",
        current[REFERENCE_EVAL_SETS][:12],
        (current[REFERENCE_QUALITY_MODELS] or "not observed")[:12],
        len(batches),
    )
    if batches:
        _require_settled_before(events, batches[-1])
    graph = defs.resolve_asset_graph()
    job = defs.resolve_implicit_global_asset_job_def()
    silver_keys = sorted(
        graph.get(SILVER_RECORDS).execution_set_asset_keys, key=lambda key: key.to_user_string()
    )
    for batch in batches:
        _execute(job, instance, silver_keys, outcome, partition=batch, tags=_TAGS)
    if graph.has(GOLD_SEQUENCES):
        for batch in batches:
            _execute(job, instance, [GOLD_SEQUENCES], outcome, partition=batch, tags=_TAGS)
    if batches and graph.has(GOLD_SNAPSHOTS):
        cut_snapshot_if_due(
            defs,
            instance,
            job,
            outcome,
            by_hand=f"backfill-decontamination: {len(batches)} batch(es) decontaminated against "
            "new eval sets or scored by new quality models",
        )
    return outcome


def _silver_read_other_versions(
    instance: DagsterInstance, events: list[BatchEvents], current: dict[AssetKey, str]
) -> list[str]:
    """Batches done in silver whose latest silver read another version of one of the ``current``
    sources (eval sets, quality models), oldest first."""
    done = {
        batch.batch_id: batch.silver.storage_id for batch in events if stage(batch) is Stage.DONE
    }
    if not done:
        return []
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=SILVER_RECORDS, storage_ids=list(done.values())),
        limit=len(done),
    ).records
    read = {r.partition_key: _upstream(r.asset_materialization.metadata) for r in records}
    return sorted(
        batch
        for batch in done
        if any(
            read.get(batch, {}).get(key.to_user_string()) != version
            for key, version in current.items()
        )
    )


def _upstream(metadata) -> dict:
    upstream = metadata.get("upstream_delta_versions")
    return {} if upstream is None else upstream.value


def _require_settled_before(events: list[BatchEvents], last: str) -> None:
    """Silver takes batches in arrival order: an earlier batch still pending or running would fail
    the redo."""
    unsettled = unsettled_before(events, last)
    if unsettled:
        named = ", ".join(f"{batch} ({state.value})" for batch, state in unsettled[:3])
        raise ValueError(
            f"{len(unsettled)} batch(es) are not through silver yet: {named}. Run "
            "`pipeline-assets run` (or let silver_in_order finish), then run "
            "backfill-decontamination again."
        )
