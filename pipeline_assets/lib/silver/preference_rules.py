"""The rules only preference pairs have, as silver stages: a pair must teach a preference.

- ``pair_sides`` (a block stage, after normalization): a pair with an empty side, with chosen equal
  to rejected, or with equal scores (a tie) teaches nothing; a length ratio beyond
  LENGTH_RATIO_STATISTIC is counted (length bias is DPO's known failure) and rejected only when a
  limit is set.
- ``contradictions`` (after exact dedup, across the batch and the earlier batches): the same pair
  labelled both ways. Within a batch both sides are rejected; against a pair an earlier batch kept,
  the new side is (the earlier one is in a published silver version and stays; the evidence names
  it).
- ``cap_per_prompt`` (last): several pairs for one prompt are legitimate, up to a cap counted over
  this batch and the pairs earlier batches kept for that prompt; the rest are rejected, the
  smallest record ids kept.

Every rule is a stage function (``lib.stages``): it returns (kept, rejected, details); rejected
rows carry ``evidence`` (JSON), and ``pair_sides`` writes their ``stage`` ("pair:<why>") itself.
"""

from __future__ import annotations

import math

import polars as pl

from pipeline_assets.lib.formats import PREFERENCE
from pipeline_assets.lib.silver.dedup import hash_in_context

MAX_PAIRS_PER_PROMPT = 8  # PIPELINE_MAX_PAIRS_PER_PROMPT
LENGTH_RATIO_STATISTIC = (
    4.0  # |log(len chosen / len rejected)| > log of this: counted, a drift statistic
)
PAIR_HASH_COLUMNS = ("prompt_hash", "flipped_hash")
PAIR_SIDES_REASON = "pair"  # a pair_sides reject's stage: "pair:<why>"
SIDES = ("prompt", "chosen", "rejected")


def pair_hashes() -> list[pl.Expr]:
    """The normalized prompt's hash, after its earlier turns when it has any (what the split and
    the cap go by: the same last question after other turns is another prompt), and the hash the
    same pair labelled the other way would have as its exact hash (``dedup.exact_hashes``)."""
    prompt, chosen, rejected = PREFERENCE.dedup
    return [
        hash_in_context(PREFERENCE.context, "prompt").alias("prompt_hash"),
        hash_in_context(PREFERENCE.context, prompt, rejected, chosen).alias("flipped_hash"),
    ]


def pair_sides(
    block: pl.DataFrame, max_length_ratio: float | None = None
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Reject empty sides, chosen == rejected and ties; measure every pair's length ratio."""
    log_ratio = (
        (pl.col("chosen").str.len_chars().cast(pl.Float64) / pl.col("rejected").str.len_chars())
        .log()
        .abs()
    )
    limit = math.log(max_length_ratio) if max_length_ratio else math.inf
    empty = pl.any_horizontal(pl.col(side).fill_null("").str.len_chars() == 0 for side in SIDES)
    reason = (
        pl.when(empty)
        .then(pl.lit(f"{PAIR_SIDES_REASON}:empty_side"))
        .when(pl.col("chosen") == pl.col("rejected"))
        .then(pl.lit(f"{PAIR_SIDES_REASON}:same_answer"))
        .when(pl.col("score_chosen") == pl.col("score_rejected"))
        .then(pl.lit(f"{PAIR_SIDES_REASON}:tie"))
        .when(pl.col("length_log_ratio") > limit)
        .then(pl.lit(f"{PAIR_SIDES_REASON}:length_ratio"))
    )
    evidence = pl.struct(
        reason=pl.col("stage"),
        score_chosen="score_chosen",
        score_rejected="score_rejected",
        chosen_chars=pl.col("chosen").str.len_chars(),
        rejected_chars=pl.col("rejected").str.len_chars(),
        length_log_ratio=pl.col("length_log_ratio").round(4),
    ).struct.json_encode()
    judged = block.with_columns(
        length_log_ratio=pl.when(empty).then(None).otherwise(log_ratio)
    ).with_columns(stage=reason)
    rejected = judged.filter(pl.col("stage").is_not_null()).with_columns(evidence=evidence)
    kept = judged.filter(pl.col("stage").is_null()).drop("stage")
    beyond = int((kept["length_log_ratio"] > math.log(LENGTH_RATIO_STATISTIC)).sum())
    return (
        kept,
        rejected,
        {
            "rejected_by_reason": dict(rejected.group_by("stage").len().iter_rows()),
            "length_ratio_beyond_4x": beyond,
        },
    )


def contradictions(
    batch: pl.DataFrame, history: pl.LazyFrame | None
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Pairs whose other labelling is in this batch (both rejected) or was kept by another batch."""
    here = batch.select(flipped_hash="exact_hash", other_id="record_id", other_batch="batch_id")
    earlier = _kept_elsewhere(history).select(
        flipped_hash="exact_hash", other_id="record_id", other_batch="batch_id"
    )
    others = (
        pl.concat([here, earlier])
        .sort("other_batch", "other_id")
        .unique("flipped_hash", keep="first", maintain_order=True)
    )
    judged = batch.join(others, on="flipped_hash", how="left", maintain_order="left")
    found = pl.col("other_id").is_not_null()
    rejected = judged.filter(found).with_columns(
        duplicate_of="other_id",
        evidence=pl.struct(
            labelled_the_other_way_by="other_id", in_batch="other_batch"
        ).struct.json_encode(),
    )
    kept = judged.filter(~found).select(batch.columns)
    against_other_batches = int((rejected["other_batch"] != rejected["batch_id"]).sum())
    return (
        kept,
        rejected.drop("other_id", "other_batch"),
        {"against_other_batches": against_other_batches},
    )


def cap_per_prompt(
    batch: pl.DataFrame, history: pl.LazyFrame | None, cap: int = MAX_PAIRS_PER_PROMPT
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Keep at most ``cap`` pairs a prompt, counting the pairs other batches kept for it first."""
    earlier = (
        _kept_elsewhere(history)
        .filter(pl.col("prompt_hash").is_not_null())
        .group_by("prompt_hash")
        .agg(earlier_pairs=pl.col("record_id").n_unique())
    )
    judged = batch.join(earlier, on="prompt_hash", how="left", maintain_order="left").with_columns(
        earlier_pairs=pl.col("earlier_pairs").fill_null(0).cast(pl.Int64),
        rank=pl.col("record_id").rank("ordinal").over("prompt_hash").cast(pl.Int64) - 1,
    )
    over = pl.col("earlier_pairs") + pl.col("rank") >= cap
    rejected = judged.filter(over).with_columns(
        evidence=pl.struct(
            "prompt_hash", "earlier_pairs", pairs_before_in_batch="rank", cap=pl.lit(cap)
        ).struct.json_encode(),
    )
    kept = judged.filter(~over).select(batch.columns)
    return (
        kept,
        rejected.drop("earlier_pairs", "rank"),
        {"prompts_capped": rejected["prompt_hash"].n_unique()},
    )


def _kept_elsewhere(history: pl.LazyFrame | None) -> pl.DataFrame:
    columns = {
        "record_id": pl.String,
        "batch_id": pl.String,
        "exact_hash": pl.String,
        "prompt_hash": pl.String,
    }
    if history is None or "prompt_hash" not in history.collect_schema():
        return pl.DataFrame(schema=columns)
    return history.select(list(columns)).collect()
