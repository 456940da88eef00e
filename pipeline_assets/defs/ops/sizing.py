"""The sizer's calibration: every stage's past materializations, read from the Dagster instance."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import polars as pl
from dagster import DagsterInstance

from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_REPORT,
    GOLD_SNAPSHOTS,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.ops.stages import PIPELINE_STAGES
from pipeline_assets.defs.snapshots import latest_per_partition, materialization_history
from pipeline_assets.lib.ops.sizing import (
    EVAL_FLOPS_PER_PARAMETER,
    POINTS,
    TRAIN_FLOPS_PER_PARAMETER,
    Calibration,
    Removals,
    StageFit,
    fit_per_materialization,
    fit_stage,
)

_FLOPS_PER_PARAMETER = {
    "training": TRAIN_FLOPS_PER_PARAMETER,
    "evaluation": EVAL_FLOPS_PER_PARAMETER,
}
_SILVER_BLOCKS = "silver/workers"  # prepare and write tasks
_SILVER_LOOKUP = "silver/index lookup"
_SILVER_DECISION = "silver/decision"  # the step's decision on the keys, per record
_MEASURED = {  # stage -> (asset, the metadata field holding its work)
    stage.name: (stage.asset, stage.work) for stage in PIPELINE_STAGES
}


def calibrate(
    instance: DagsterInstance,
    validation_fraction: float,
    tokenizer_sample_chars: float = math.inf,
    eval_max_tokens: float = math.inf,
    measure_lookup: Callable[[], tuple[Sequence[tuple[int, float]], int]] | None = None,
    measure_decision: Callable[[Removals], Sequence[tuple[int, float]]] | None = None,
) -> Calibration:
    """Fit every stage on its past runs; take the data's ratios from the newest snapshot. Silver's
    index lookup is fitted on its runs' lookups together with ``measure_lookup``'s, called once
    the runs are found: ((indexed records, task seconds) on indexes large enough to show its rate
    a row, which a calibration's are not; the bands it searched, a task each a slice). Its
    decision likewise with ``measure_decision``'s ((records, seconds) on batches large enough to
    show its rate a record, with the removals the runs made)."""
    history = {
        key: materialization_history(instance, key)
        for key in [*(key for key, _ in _MEASURED.values()), GOLD_SNAPSHOTS]
    }
    parameters = {
        m["partition"]: m["parameters"]
        for m in reversed(history[TRAINING_CHECKPOINT])
        if m.get("parameters")
    }
    points = pl.DataFrame(
        [
            point
            for stage, (key, work) in _MEASURED.items()
            for point in _points(stage, history[key], work, parameters)
        ],
        schema=POINTS,
    )
    blocks = points.filter(pl.col("stage") == _SILVER_BLOCKS)
    lookups = points.filter(pl.col("stage") == _SILVER_LOOKUP)
    decisions = points.filter(pl.col("stage") == _SILVER_DECISION)
    points = points.filter(
        ~pl.col("stage").is_in([_SILVER_BLOCKS, _SILVER_LOOKUP, _SILVER_DECISION])
    )
    missing = [stage for stage in _MEASURED if points.filter(pl.col("stage") == stage).is_empty()]
    if missing:
        raise ValueError(
            f"no measured run of {', '.join(missing)} to calibrate on: run the pipeline once "
            "(pipeline-assets run, or make demo), with this version of the code, then size"
        )
    measured_lookups, measured_lookup_bands = measure_lookup() if measure_lookup else ([], 0)
    lookups = pl.concat(
        [
            lookups,
            pl.DataFrame(
                [_point(_SILVER_LOOKUP, rows, seconds) for rows, seconds in measured_lookups],
                schema=POINTS,
            ),
        ]
    )
    silver = latest_per_partition(history[SILVER_RECORDS])
    if measure_decision is not None and not decisions.is_empty():
        chars_per_record = sum(m.get("input_chars") or 0 for m in silver) / max(
            sum(m.get("bronze_rows") or 0 for m in silver), 1
        )
        measured = [
            _point(_SILVER_DECISION, records * chars_per_record, seconds)
            for records, seconds in measure_decision(removals(silver))
        ]
        decisions = pl.concat([decisions, pl.DataFrame(measured, schema=POINTS)])
    decided = not decisions.is_empty()
    fits = {
        stage: _fit(stage, points.filter(pl.col("stage") == stage), decided) for stage in _MEASURED
    }

    gold = _newest_with(
        history[GOLD_SNAPSHOTS], "input_chars"
    )  # the newest snapshot: its shards' sums
    bronze = latest_per_partition(history[BRONZE_RECORDS])
    landed_chars = sum(m.get("input_chars") or 0 for m in bronze)
    landed_records = sum(m.get("lines_read") or 0 for m in bronze)
    training, evaluation = (
        _newest_with(history[TRAINING_CHECKPOINT], "parameters"),
        _newest_with(history[EVALUATION_REPORT], "tokens_scored"),
    )
    return Calibration(
        fits=fits,
        avg_chars=landed_chars / max(landed_records, 1),
        silver_keep=gold["input_chars"] / max(landed_chars, 1),
        tokens_per_char=gold["tokens"] / max(gold["input_chars"], 1),
        validation_share=(gold.get("validation_tokens") or 0) / max(gold["tokens"], 1),
        eval_set_tokens=float(evaluation.get("eval_set_tokens") or 0),
        cores=int(bronze[0].get("cpu_cores") or 1),
        train_ranks=int(training.get("world_size") or 1),
        train_gpus=int(training.get("gpus") or 0),
        validation_fraction=validation_fraction,
        tokenizer_sample_chars=tokenizer_sample_chars,
        eval_max_tokens=eval_max_tokens,
        parameters=int(training["parameters"]),
        silver_blocks=fit_stage(blocks) if not blocks.is_empty() else None,
        silver_lookup=fit_stage(lookups) if not lookups.is_empty() else None,
        silver_decision=fit_stage(decisions) if not decisions.is_empty() else None,
        lookup_bands=max(
            [measured_lookup_bands, *(int(m.get("index_lookup_bands") or 0) for m in silver)]
        ),
        silver_row_keep=sum(m.get("silver_rows") or 0 for m in silver)
        / max(sum(m.get("bronze_rows") or 0 for m in silver), 1),
    )


def removals(silver: list[dict]) -> Removals:
    """What silver's decision removed in ``silver`` (materializations), as shares of the records
    that reached exact dedup: its stages table's rows summed over the runs."""
    removed: dict[str, int] = {}
    reached, after_dedup = 0, set()
    for m in silver:
        rows = [record.data for record in m["stages"].records] if m.get("stages") else []
        names = [row["stage"] for row in rows]
        if "near_dedup" not in names:
            continue
        after_dedup.update(names[names.index("near_dedup") + 1 :])
        for row in rows:
            removed[row["stage"]] = removed.get(row["stage"], 0) + int(row["removed"])
            reached += int(row["rows_in"]) if row["stage"] == "exact_dedup" else 0
    reached = max(reached, 1)
    return Removals(
        removed.get("exact_dedup", 0) / reached,
        removed.get("near_dedup", 0) / reached,
        sum(removed.get(stage, 0) for stage in after_dedup) / reached,
    )


def _points(stage: str, history: list[dict], work: str, parameters: dict[str, int]) -> list[dict]:
    """One point a materialization. Training's and evaluation's work in model FLOPs (the parameters
    of the partition's trained model; a run without them is left out); silver's with the index rows
    it read."""
    if stage == "silver":
        return _silver_points(history, work)
    points = []
    for m in history:
        if not m.get(work) or m.get("wall_seconds") is None:
            continue
        amount = float(m[work])
        if stage in _FLOPS_PER_PARAMETER:
            if not parameters.get(m["partition"]):
                continue
            amount *= _FLOPS_PER_PARAMETER[stage] * parameters[m["partition"]]
        points.append(_point(stage, amount, float(m["wall_seconds"])))
    return points


def _silver_points(history: list[dict], work: str) -> list[dict]:
    """Silver's own part (its wall less the wait on its workers' prepare and write tasks and on its
    index lookup's tasks, and less its decision: the commits and the rest of the step) and, apart,
    its decision's seconds (``_SILVER_DECISION``: per record, a rate the small batches of a
    calibration show, where the residual's is lost in its spread), its workers' task seconds
    (``_SILVER_BLOCKS``) and its lookup tasks' seconds against the other batches' index rows it
    searched (``_SILVER_LOOKUP``). Runs recorded before the block stages, the lookup tasks or the
    decision were timed count whole, with the index rows in silver's own fit, and only while no run
    was timed: the kinds do not mix in one fit."""
    earlier = _earlier_index_rows(history)
    timed = any(m.get("block_stage_seconds") is not None for m in history)
    looked_up = any(m.get("index_lookup_task_seconds") is not None for m in history)
    decided = any(m.get("decide_seconds") is not None for m in history)
    points = []
    for number, m in enumerate(history):
        if (
            not m.get(work)
            or m.get("wall_seconds") is None
            or (timed and m.get("block_stage_seconds") is None)
            or (looked_up and m.get("index_lookup_task_seconds") is None)
            or (decided and m.get("decide_seconds") is None)
        ):
            continue
        own = (
            float(m["wall_seconds"])
            - float(m.get("block_wall_seconds") or 0.0)
            - float(m.get("index_lookup_wait_seconds") or 0.0)
            - float(m.get("decide_seconds") or 0.0)
        )
        chars = float(m[work])
        history_rows = 0.0 if looked_up else float(earlier.get(number, 0))
        points.append(_point("silver", chars, own, history_rows))
        if timed:
            points.append(_point(_SILVER_BLOCKS, chars, float(m["block_stage_seconds"])))
        if decided:
            points.append(_point(_SILVER_DECISION, chars, float(m["decide_seconds"])))
        if looked_up and earlier.get(number):
            searched = float(earlier[number])
            points.append(_point(_SILVER_LOOKUP, searched, float(m["index_lookup_task_seconds"])))
    return points


def _fit(stage: str, points: pl.DataFrame, decided: bool) -> StageFit:
    """A stage's fit; silver's, once its decision is fitted apart, is what is left of its step (the
    commits): a fixed time a batch."""
    if stage == "silver" and decided:
        return fit_per_materialization(points, "a batch: its decision is fitted apart")
    return fit_stage(points)


def _point(stage: str, work: float, wall_seconds: float, history: float = 0.0) -> dict:
    """One materialization's point (``POINTS``)."""
    return {
        "stage": stage,
        "materializations": 1,
        "work": work,
        "wall_seconds": wall_seconds,
        "history": history,
    }


def _earlier_index_rows(history: list[dict]) -> dict[int, int]:
    """Per silver materialization (its place in the newest-first ``history``): the rows the other
    batches had in the index when it ran (each batch's latest kept rows before then)."""
    kept: dict[str, int] = {}
    earlier = {}
    for number in range(len(history) - 1, -1, -1):
        m = history[number]
        earlier[number] = sum(rows for batch, rows in kept.items() if batch != m["partition"])
        kept[m["partition"]] = int(m.get("silver_rows") or 0)
    return earlier


def _newest_with(history: list[dict], field: str) -> dict:
    return next(metadata for metadata in history if metadata.get(field))
