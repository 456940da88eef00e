"""The pipeline sizer: from measured stages to a prediction for a corpus of any size.

Each stage's wall time is modelled as ``fixed * materializations + per_unit * work`` (silver's
lookup in the index of the batches before it is fitted apart, on its tasks' seconds against the
index rows it searched),
fitted by least squares on what its past materializations recorded (their own work and wall
seconds). Work is the text a data stage read (characters), or, for training and evaluation, the
model FLOPs of the tokens trained (6 x parameters a token) or scored (2 x parameters a token), so
a bigger preset is predicted at its own speed, not at the calibration's. A target corpus (records,
average characters) is turned into each stage's work with the ratios the newest snapshot measured
(how much text survives silver, tokens per character, the validation share), then into time with the
stage's parallelism:

- bronze and gold/sequences (a shard per batch): batches run side by side, one process per
  ``calibration_cores`` cores;
- silver: batches run one at a time (each dedups against the ones before it: the "silver" pool). Its
  workers' part (prepare: reading the batch's bronze files and every per-record stage; write: each
  share's rows split by the decision and written) is fitted apart, on its tasks' own seconds summed,
  and spread over all the target's cores when a batch runs on Ray (at least ``ray_min_rows`` rows);
  so is its index lookup, a task a band and slice of ROWS_PER_LOOKUP_TASK earlier rows (batch k
  searches the k before it); the rest runs in the step's process: the decision on the batch's keys
  (exact and near dedup against what the lookup found, pair rules), fitted apart on its own
  seconds (its rate), and the Delta commits and the rest of the step (a fixed time a batch: at a
  calibration's sizes its growth, if any, is lost in its runs' spread);
- gold/tokenizer (a capped sample): one process, as fast as the one measured;
- evaluation (a capped sample): on GPUs, one rank a GPU at the training speed a GPU has (a forward
  pass: a third of a training token's FLOPs); without GPUs one process, as measured;
- training: data parallel over the GPUs (or the measured CPU ranks when there are no GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl

from pipeline_assets.lib.ops.cost import Prices, bottleneck
from pipeline_assets.lib.silver.dedup import ROWS_PER_LOOKUP_TASK
from pipeline_assets.lib.stages import RAY_MIN_ROWS

BATCHES, SEQUENTIAL, SINGLE, DEVICES = (
    "batches in parallel",
    "batches one at a time",
    "one process",
    "data parallel",
)
STAGES = {  # stage -> (unit of work, parallelism)
    "bronze": ("characters", BATCHES),
    "silver": ("characters", SEQUENTIAL),
    "gold/tokenizer": ("characters", SINGLE),
    "gold/sequences": ("characters", BATCHES),
    "training": ("tokens", DEVICES),
    "evaluation": ("tokens", SINGLE),
}
POINTS = {
    "stage": pl.String,
    "materializations": pl.Int64,
    "work": pl.Float64,
    "wall_seconds": pl.Float64,
    "history": pl.Float64,
}  # history: rows of the earlier batches' index a silver batch read (0 elsewhere)
TRAIN_FLOPS_PER_PARAMETER, EVAL_FLOPS_PER_PARAMETER = (
    6,
    2,
)  # a token's forward + backward, forward only


@dataclass(frozen=True)
class Removals:
    """What silver's decision removes, as shares of the records that reach dedup: exact copies,
    near copies, and records a per-record stage rejected (the decision applies their verdict).
    A calibration's runs give them; the decision's rate is measured on a batch that has them."""

    exact: float
    near: float
    per_record: float


@dataclass(frozen=True)
class StageFit:
    """wall = fixed_seconds * materializations + seconds_per_unit * work + seconds_per_history_row *
    history."""

    fixed_seconds: float
    seconds_per_unit: float
    points: int
    note: str
    seconds_per_history_row: float = 0.0

    def seconds(self, materializations: float, work: float, history: float = 0.0) -> float:
        return (
            self.fixed_seconds * materializations
            + self.seconds_per_unit * work
            + self.seconds_per_history_row * history
        )


def fit_per_materialization(points: pl.DataFrame, note: str) -> StageFit:
    """A stage whose work does not grow with its input: the median of its runs, a materialization
    each."""
    return StageFit(float(points["wall_seconds"].median()), 0.0, len(points), note)


def fit_measured(points: Iterable[tuple[float, float]]) -> StageFit:
    """``fit_stage`` on (work, seconds) points measured once each, outside any materialization."""
    return fit_stage(
        pl.DataFrame(
            [
                {"stage": "measured", "materializations": 1, "work": work, "wall_seconds": seconds}
                for work, seconds in points
            ],
            schema=POINTS,
        )
    )


def fit_stage(points: pl.DataFrame) -> StageFit:
    """Non-negative least squares on (materializations, work) -> wall seconds. Runs of the same size
    (a partition materialized again) count once, at their median: one slow run does not tilt the
    line. With a single size seen, the fixed part cannot be told from the rate, and all the time is
    charged to the rate (which over-predicts a larger corpus slightly: the safe side)."""
    if "history" in points.columns and points["history"].fill_null(0).max() > 0:
        with_history = _fit_with_history(points)
        if with_history is not None:
            return with_history
    runs = len(points)
    points = points.group_by("materializations", "work").agg(pl.median("wall_seconds")).sort("work")
    n = points["materializations"].cast(pl.Float64).to_numpy()
    work = points["work"].to_numpy()
    wall = points["wall_seconds"].to_numpy()
    if len(points) == 0 or work.sum() <= 0:
        raise ValueError("no measurement with any work in it")
    ratios = np.unique(np.round(work / n, 6))
    if len(ratios) < 2:
        return StageFit(
            0.0,
            float(wall.sum() / work.sum()),
            len(points),
            "one size measured: no fixed part fitted",
        )
    (fixed, rate), *_ = np.linalg.lstsq(np.column_stack([n, work]), wall, rcond=None)
    if rate <= 0:  # time does not grow with work here: all fixed
        return StageFit(
            float(wall.sum() / n.sum()), 0.0, len(points), "no growth with work measured"
        )
    if fixed < 0:
        return StageFit(
            0.0,
            float((work @ wall) / (work @ work)),
            len(points),
            "fixed part fitted below zero: rate only",
        )
    return StageFit(
        float(fixed), float(rate), len(points), f"fitted on {len(points)} sizes ({runs} runs)"
    )


def _fit_with_history(points: pl.DataFrame) -> StageFit | None:
    """The three-term fit; None when it is not determined or a term comes out negative (then the
    two-term fit stands)."""
    runs = len(points)
    points = points.group_by("materializations", "work", "history").agg(pl.median("wall_seconds"))
    design = np.column_stack(
        [
            points["materializations"].cast(pl.Float64).to_numpy(),
            points["work"].to_numpy(),
            points["history"].to_numpy(),
        ]
    )
    if len(points) < 3 or np.linalg.matrix_rank(design) < 3:
        return None
    (fixed, rate, per_row), *_ = np.linalg.lstsq(
        design, points["wall_seconds"].to_numpy(), rcond=None
    )
    if min(fixed, rate, per_row) < 0:
        return None
    return StageFit(
        float(fixed),
        float(rate),
        len(points),
        f"fitted on {len(points)} sizes ({runs} runs), with the index read",
        float(per_row),
    )


@dataclass(frozen=True)
class Calibration:
    """What the measured run says about the data and the machine it ran on."""

    fits: dict[str, StageFit]
    avg_chars: float  # per landed record
    silver_keep: float  # characters reaching gold / characters landed
    tokens_per_char: float
    validation_share: float  # of the snapshot's tokens
    eval_set_tokens: float  # the eval sets' tokens, scored by every model
    cores: int  # cores of the machine one measured process ran on
    train_ranks: int
    train_gpus: int
    validation_fraction: float
    parameters: (
        int  # of the model the measured training run trained (training's and evaluation's FLOPs)
    )
    silver_row_keep: float = 1.0  # silver rows / bronze rows: what a batch adds to the dedup index
    tokenizer_sample_chars: float = math.inf  # the tokenizer trains on at most this many characters
    eval_max_tokens: float = math.inf  # validation tokens evaluation scores per model
    silver_blocks: StageFit | None = (
        None  # silver's block stages on their own seconds; None: inside silver's fit
    )
    silver_lookup: StageFit | None = (
        None  # its index lookup's task seconds against the earlier rows it searched
    )
    lookup_bands: int = 0  # lookup tasks a slice of the index (its bands and the exact hash's)
    silver_decision: StageFit | None = (
        None  # the step's decision on its own seconds, per character; None: inside silver's fit
    )


@dataclass(frozen=True)
class Target:
    records: int
    cpu_cores: int
    gpus: int
    avg_chars: float | None = None  # None: the calibration's
    batch_records: int = 1_000_000
    epochs: float = 1.0
    train_tokens: float | None = None  # None: epochs over the training split
    models_scored: int = 2  # the candidate and the champion; 1 for a first model
    gpu_tokens_per_second: float | None = (
        None  # per GPU; None: measured if the calibration had GPUs
    )
    parameters: int | None = None  # of the model to train (its preset); None: the calibration's
    ray_min_rows: int = (
        RAY_MIN_ROWS  # batches this large run their block stages on Ray (0: a Ray cluster, always)
    )


def predict(calibration: Calibration, target: Target, prices: Prices) -> tuple[pl.DataFrame, dict]:
    """Per stage: its work, how it runs, predicted wall seconds and cost; and the totals."""
    c = calibration
    chars = target.records * (target.avg_chars or c.avg_chars)
    batches = max(1, math.ceil(target.records / target.batch_records))
    gold_chars = chars * c.silver_keep
    tokens = gold_chars * c.tokens_per_char
    train_tokens = (
        target.train_tokens
        if target.train_tokens is not None
        else target.epochs * tokens * (1 - c.validation_share)
    )
    scored = target.models_scored * (
        min(tokens * c.validation_share, c.eval_max_tokens) + c.eval_set_tokens
    )
    side_by_side = min(batches, max(1, target.cpu_cores // max(c.cores, 1)))
    parameters = target.parameters or c.parameters
    kept_per_batch = target.records / batches * c.silver_row_keep
    rows = [
        _cpu_row("bronze", c.fits["bronze"], batches, chars, c.cores, side_by_side),
        _silver_row(
            c, target, batches, chars, history=kept_per_batch * batches * (batches - 1) / 2
        ),  # batch k reads the k before it
        _cpu_row(
            "gold/tokenizer",
            c.fits["gold/tokenizer"],
            1,
            min(gold_chars * (1 - c.validation_fraction), c.tokenizer_sample_chars),
            c.cores,
            1,
        ),
        _cpu_row(
            "gold/sequences", c.fits["gold/sequences"], batches, gold_chars, c.cores, side_by_side
        ),
        _training_row(c, target, train_tokens, TRAIN_FLOPS_PER_PARAMETER * parameters),
        _evaluation_row(c, target, scored, parameters),
    ]
    table = (
        pl.DataFrame(rows)
        .with_columns(
            cost_usd=prices.cost(pl.col("cpu_core_seconds"), pl.col("gpu_seconds")),
        )
        .with_columns(share_of_wall=pl.col("wall_seconds") / pl.col("wall_seconds").sum())
    )
    total_cost = float(table["cost_usd"].sum())
    totals = {
        "records": target.records,
        "characters": chars,
        "batches": batches,
        "dataset_tokens": tokens,
        "train_tokens": train_tokens,
        "cpu_cores": target.cpu_cores,
        "gpus": target.gpus,
        "wall_seconds": float(table["wall_seconds"].sum()),
        "cost_usd": total_cost,
        "usd_per_million_tokens": total_cost / max(tokens, 1) * 1e6,
        "bottleneck": bottleneck(table),
    }
    return table, totals


def _cpu_row(
    stage: str,
    fit: StageFit,
    materializations: int,
    work: float,
    cores: int,
    side_by_side: int,
    history: float = 0.0,
    flops_per_work: float = 1.0,
) -> dict:
    """Materializations split the work evenly; ``side_by_side`` of them run at once, ``cores`` each.
    ``history``: index rows read in all; ``flops_per_work``: the fit's units per unit of work."""
    rounds = math.ceil(materializations / side_by_side)
    seconds = rounds * fit.seconds(
        1, work * flops_per_work / materializations, history / materializations
    )
    return _row(
        stage,
        work,
        f"{side_by_side} x {cores} cores" if side_by_side > 1 else f"{cores} cores",
        seconds,
        cpu_core_seconds=seconds * cores * side_by_side,
        gpu_seconds=0.0,
    )


def _silver_row(c: Calibration, target: Target, batches: int, chars: float, history: float) -> dict:
    """One batch after another: each batch's decision and commits in the step's process, its
    prepare and write tasks and its index lookup on every core of the target when the batch is large
    enough for Ray (else in that process too)."""
    per_batch_chars = chars / batches
    driver = c.fits["silver"].seconds(1, per_batch_chars, history / batches)
    if c.silver_decision is not None:
        driver += c.silver_decision.seconds(1, per_batch_chars)
    on_ray = target.records / batches >= target.ray_min_rows
    cores = target.cpu_cores if on_ray else 1
    block_core_seconds = c.silver_blocks.seconds(1, per_batch_chars) if c.silver_blocks else 0.0
    kept_per_batch = target.records / batches * c.silver_row_keep
    lookups = [
        _lookup_seconds(c, batch * kept_per_batch, cores) for batch in range(1, batches)
    ]  # the first has no history
    lookup_wall, lookup_core_seconds = (
        sum(wall for wall, _ in lookups),
        sum(work for _, work in lookups),
    )
    seconds = batches * (driver + block_core_seconds / cores) + lookup_wall
    runs_on = (
        f"{c.cores} + {target.cpu_cores} on Ray"
        if on_ray and (c.silver_blocks or c.silver_lookup)
        else f"{c.cores} cores"
    )
    return _row(
        "silver",
        chars,
        runs_on,
        seconds,
        cpu_core_seconds=batches * (driver * c.cores + block_core_seconds) + lookup_core_seconds,
        gpu_seconds=0.0,
    )


def _lookup_seconds(c: Calibration, index_rows: float, cores: int) -> tuple[float, float]:
    """One batch's index lookup in ``index_rows`` earlier rows: (wall, core seconds), its tasks (a
    band and slice each) spread over ``cores``."""
    if c.silver_lookup is None or index_rows <= 0:
        return 0.0, 0.0
    core_seconds = c.silver_lookup.seconds(1, index_rows)
    tasks = max(c.lookup_bands, 1) * math.ceil(index_rows / ROWS_PER_LOOKUP_TASK)
    return core_seconds / min(tasks, cores), core_seconds


def _evaluation_row(c: Calibration, target: Target, scored: float, parameters: int) -> dict:
    fit = c.fits["evaluation"]
    if target.gpus == 0:
        return _cpu_row(
            "evaluation",
            fit,
            1,
            scored,
            c.cores,
            1,
            flops_per_work=EVAL_FLOPS_PER_PARAMETER * parameters,
        )
    train_tokens_per_second = _gpu_speed(c, target, TRAIN_FLOPS_PER_PARAMETER * parameters)
    tokens_per_second = (
        train_tokens_per_second * TRAIN_FLOPS_PER_PARAMETER / EVAL_FLOPS_PER_PARAMETER
    )
    seconds = fit.fixed_seconds + scored / (tokens_per_second * target.gpus)
    return _row(
        "evaluation",
        scored,
        f"{target.gpus} GPUs",
        seconds,
        0.0,
        seconds * target.gpus,
        parallelism=DEVICES,
    )


def _training_row(
    c: Calibration, target: Target, train_tokens: float, flops_per_token: float
) -> dict:
    fit = c.fits["training"]
    if target.gpus == 0:  # as measured: the same CPU ranks, at the target model's FLOPs per token
        seconds = fit.seconds(1, train_tokens * flops_per_token)
        return _row(
            "training",
            train_tokens,
            f"{c.train_ranks} CPU rank(s)",
            seconds,
            seconds * c.cores,
            0.0,
        )
    seconds = fit.fixed_seconds + train_tokens / (
        _gpu_speed(c, target, flops_per_token) * target.gpus
    )
    return _row(
        "training", train_tokens, f"{target.gpus} GPUs", seconds, 0.0, seconds * target.gpus
    )


def _gpu_speed(c: Calibration, target: Target, flops_per_token: float) -> float:
    """Training tokens/s of one GPU: given, or measured by a calibration that trained on GPUs."""
    if target.gpu_tokens_per_second is not None:
        return target.gpu_tokens_per_second
    fit = c.fits["training"]
    if not c.train_gpus or fit.seconds_per_unit <= 0:
        raise ValueError(
            "the calibration trained on CPU: give the tokens/s one GPU reaches "
            "(--gpu-tokens-per-second)"
        )
    return 1.0 / (fit.seconds_per_unit * c.train_gpus * flops_per_token)


def _row(
    stage: str,
    work: float,
    runs_on: str,
    seconds: float,
    cpu_core_seconds: float,
    gpu_seconds: float,
    parallelism: str | None = None,
) -> dict:
    unit, parallelism = STAGES[stage][0], parallelism or STAGES[stage][1]
    return {
        "stage": stage,
        "work": float(work),
        "unit": unit,
        "parallelism": parallelism,
        "runs_on": runs_on,
        "wall_seconds": float(seconds),
        "cpu_core_seconds": float(cpu_core_seconds),
        "gpu_seconds": float(gpu_seconds),
    }


def transformer_flops_per_token(parameters: int, layers: int, width: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder from its parameter count: 6 per weight plus
    attention's scores (PaLM, app. B). The input embedding counts as weights: a slight overcount
    for untied models, whose lookup costs no multiply."""
    return 6 * parameters + 12 * layers * width * seq_len


def gpu_tokens_per_second(flops_per_token: float, peak_flops: float, mfu: float) -> float:
    """Tokens/s one GPU trains at a model FLOPs utilisation: an assumption, not a measurement."""
    return mfu * peak_flops / flops_per_token
