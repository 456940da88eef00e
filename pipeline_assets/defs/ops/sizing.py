"""The sizer's calibration: every stage's past materializations, read from the Dagster instance."""

from __future__ import annotations

import polars as pl
from dagster import DagsterInstance

from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_REPORT,
    GOLD_SEQUENCES,
    GOLD_TOKENIZER,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.snapshots import latest_per_partition, materialization_history
from pipeline_assets.lib.sizing import POINTS, Calibration, fit_stage

# stage -> (asset, the metadata field holding its work); evaluation's work counts both models' tokens
_MEASURED = {
    "bronze": (BRONZE_RECORDS, "input_chars"),
    "silver": (SILVER_RECORDS, "input_chars"),
    "gold/tokenizer": (GOLD_TOKENIZER, "input_chars"),
    "gold/sequences": (GOLD_SEQUENCES, "input_chars"),
    "training": (TRAINING_CHECKPOINT, "tokens_trained"),
    "evaluation": (EVALUATION_REPORT, "tokens_scored"),
}


def calibrate(instance: DagsterInstance, validation_fraction: float) -> Calibration:
    """Fit every stage on its past runs; take the data's ratios from the newest snapshot."""
    history = {key: materialization_history(instance, key) for key, _ in _MEASURED.values()}
    points = pl.DataFrame(
        [point for stage, (key, work) in _MEASURED.items() for point in _points(stage, history[key], work)],
        schema=POINTS,
    )
    missing = [stage for stage in _MEASURED if points.filter(pl.col("stage") == stage).is_empty()]
    if missing:
        raise ValueError(f"no measured run of {', '.join(missing)} to calibrate on: run the pipeline once "
                         "(pipeline-assets run, or make demo), with this version of the code, then size")
    fits = {stage: fit_stage(points.filter(pl.col("stage") == stage)) for stage in _MEASURED}

    gold = _newest_with(history[GOLD_SEQUENCES], "input_chars")
    bronze = latest_per_partition(history[BRONZE_RECORDS])
    landed_chars = sum(m.get("input_chars") or 0 for m in bronze)
    landed_records = sum(m.get("lines_read") or 0 for m in bronze)
    training, evaluation = history[TRAINING_CHECKPOINT][0], _newest_with(history[EVALUATION_REPORT], "tokens_scored")
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
    )


def _points(stage: str, history: list[dict], work: str) -> list[dict]:
    return [{"stage": stage, "materializations": 1, "work": float(m[work]), "wall_seconds": float(m["wall_seconds"])}
            for m in history if m.get(work) and m.get("wall_seconds") is not None]


def _newest_with(history: list[dict], field: str) -> dict:
    return next(metadata for metadata in history if metadata.get(field))
