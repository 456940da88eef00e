"""The RL prompt bank: prompts with an answer a rule can check, each naming its verifier and ground
truth.

Two kinds of candidates: silver records whose answer is a bare integer (``int_equal``; the batch
path already curated them), and the seeded tasks of ``lib.rl.tasks``. Every candidate goes through
the batch path's own decontamination and quality stages (``lib.silver.curation.after_dedup``),
shaped as an sft record whose response is the ground truth. The quality rules are written for prose
answers, so generated tasks are judged with thresholds for terse answers (``TASK_QUALITY``, the
per-source override the quality gate already has; a ``PIPELINE_QUALITY_THRESHOLDS`` entry for the
source wins). A prompt the bank holds twice is kept once. Nothing is dropped silently: every
candidate is a row, ``status`` ``in_bank`` or the stage that removed it, with its evidence.
"""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from pipeline_assets.lib.gold.splits import VALIDATION, assign_split
from pipeline_assets.lib.rl.tasks import HELD_OUT, TRAIN, generate_tasks
from pipeline_assets.lib.silver.curation import SilverConfig, after_dedup
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import hash_of
from pipeline_assets.lib.silver.quality import QualityThresholds
from pipeline_assets.lib.stages import run_in_process

TASK_SOURCE = "rl_tasks"  # the generated tasks' source
IN_BANK = "in_bank"
DUPLICATE = "duplicate_prompt"
BANK_COLUMNS = (
    "prompt_id",
    "source",
    "task",
    "prompt",
    "ground_truth",
    "verifier",
    "split",
    "status",
    "evidence",
)
# Answers of one to five words, digits or spaced letters: the prose rules' word counts and letter
# shares would reject every one; length, symbol and runaway-repetition limits still hold.
TASK_QUALITY = QualityThresholds(
    min_words=1,
    min_mean_word_length=1,
    min_alpha_word_fraction=0.0,
    max_top_2gram_char_fraction=1.0,
    max_duplicate_5gram_char_fraction=1.0,
)
_INTEGER_ANSWER = r"^[+-]?[0-9]+$"
_SPLIT_SALT = (
    "rl-tasks-v1"  # the generator's: a prompt is on one side of the split wherever it came from
)
_ROWS_PER_BLOCK = 50_000


def checkable_silver(records: pl.DataFrame, held_out_fraction: float) -> pl.DataFrame:
    """Silver records whose answer is a bare integer, as bank candidates checked by
    ``int_equal``."""
    integers = records.filter(pl.col("response").str.strip_chars().str.contains(_INTEGER_ANSWER))
    candidates = integers.select(
        "prompt",
        "source",
        task=pl.lit("silver:integer"),
        ground_truth=pl.col("response").str.strip_chars(),
        verifier=pl.lit("int_equal"),
    )
    return _with_ids_and_split(candidates, held_out_fraction)


def generated_tasks(n: int, seed: int, held_out_fraction: float) -> pl.DataFrame:
    """The seeded tasks, as bank candidates."""
    tasks = generate_tasks(n, seed, held_out_fraction)
    return tasks.select(
        "prompt_id",
        source=pl.lit(TASK_SOURCE),
        *("task", "prompt", "ground_truth", "verifier", "split"),
    )


def curate_bank(
    candidates: pl.DataFrame, eval_index: EvalNgramIndex, config: SilverConfig
) -> pl.DataFrame:
    """Every candidate with its ``status``: ``in_bank``, ``duplicate_prompt``, or the stage of the
    batch path that removed it (``decontaminated``, ``quality:<rule>``), with the evidence."""
    repeated = pl.int_range(pl.len()).over("prompt_id") > 0
    first, duplicates = candidates.filter(~repeated), candidates.filter(repeated)
    judged = run_in_process(
        after_dedup(_with_task_quality(config), eval_index), as_records(first), _ROWS_PER_BLOCK
    )
    removed = (
        pl.concat(list(judged.removed.values()), how="diagonal_relaxed") if judged.removed else None
    )
    frames = [
        _bank_rows(judged.kept, IN_BANK, None),
        _bank_rows(
            as_records(duplicates),
            DUPLICATE,
            pl.lit("a candidate with the same prompt comes first"),
        ),
    ]
    if removed is not None and removed.height:
        frames.append(_bank_rows(removed, pl.col("stage"), pl.col("evidence")))
    return pl.concat(frames).sort("prompt_id", "status")


def _with_ids_and_split(candidates: pl.DataFrame, held_out_fraction: float) -> pl.DataFrame:
    split = assign_split(
        candidates.with_columns(prompt_id=hash_of("prompt")),
        held_out_fraction,
        salt=_SPLIT_SALT,
        key="prompt",
    )
    return split.with_columns(
        pl.when(pl.col("split") == VALIDATION)
        .then(pl.lit(HELD_OUT))
        .otherwise(pl.lit(TRAIN))
        .alias("split")
    )


def _with_task_quality(config: SilverConfig) -> SilverConfig:
    return replace(
        config, quality_by_source={TASK_SOURCE: TASK_QUALITY, **config.quality_by_source}
    )


def as_records(candidates: pl.DataFrame) -> pl.DataFrame:
    """Candidates shaped as the sft records the batch path's stages read: the ground truth is the
    response."""
    return candidates.rename({"prompt_id": "record_id", "ground_truth": "response"}).with_columns(
        system=pl.lit(None, pl.String)
    )


def _bank_rows(
    records: pl.DataFrame, status: str | pl.Expr, evidence: pl.Expr | None
) -> pl.DataFrame:
    """``records`` (shaped by ``as_records``) back as bank rows with their status and evidence."""
    return records.select(
        prompt_id="record_id",
        source="source",
        task="task",
        prompt="prompt",
        ground_truth="response",
        verifier="verifier",
        split="split",
        status=pl.lit(status) if isinstance(status, str) else status,
        evidence=pl.lit(None, pl.String) if evidence is None else evidence.cast(pl.String),
    )
