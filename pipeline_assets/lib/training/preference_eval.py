"""How a DPO model judges held-out preference pairs: implicit reward margins, accuracy, per source.

A packed preference row holds pair ``k``'s chosen answer as document ``2k`` and its rejected answer
as document ``2k + 1``. With the policy's and the reference's summed response log-probabilities per
document, pair ``k``'s implicit reward margin is

    beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))

and the model prefers the chosen answer when the margin is positive. Preference accuracy is the
share of pairs with a positive margin (a tie counts as wrong, as in the trainer's
``rewards/accuracies``).
"""

from __future__ import annotations

import polars as pl

OVERALL = "overall"
SOURCE_PREFIX = "source:"
SLICE_SCHEMA = {
    "slice": pl.String,
    "pairs": pl.Int64,
    "preference_accuracy": pl.Float64,
    "mean_margin": pl.Float64,
}


def pair_margins(rows: pl.DataFrame, beta: float) -> pl.DataFrame:
    """rows: ``pair_ids`` (list), ``policy_logps`` and ``reference_logps`` (lists, one value per
    document) -> one row per pair: pair_id, chosen_reward, rejected_reward, margin. A ValueError
    names the first row whose lists do not hold two documents per pair."""
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    _check_two_documents_a_pair(rows)
    sides = {
        f"{model}_{side}": pl.col(f"{model}_logps").list.gather_every(2, offset=offset)
        for model in ("policy", "reference")
        for side, offset in (("chosen", 0), ("rejected", 1))
    }
    pairs = rows.select(pl.col("pair_ids").alias("pair_id"), **sides).explode("pair_id", *sides)
    return pairs.select(
        "pair_id",
        chosen_reward=beta * (pl.col("policy_chosen") - pl.col("reference_chosen")),
        rejected_reward=beta * (pl.col("policy_rejected") - pl.col("reference_rejected")),
    ).with_columns(margin=pl.col("chosen_reward") - pl.col("rejected_reward"))


def preference_slices(margins: pl.DataFrame, sources: pl.DataFrame) -> pl.DataFrame:
    """margins: pair_id, margin; sources: pair_id, source -> per slice (``overall``, then
    ``source:<name>`` sorted): pairs, preference_accuracy, mean_margin. A ValueError when a pair has
    no source."""
    labelled = margins.join(sources.select("pair_id", "source"), on="pair_id", how="left")
    unknown = labelled.filter(pl.col("source").is_null())
    if unknown.height:
        raise ValueError(f"{unknown.height} pair(s) have no source, e.g. {unknown['pair_id'][0]}")
    overall = _summary(labelled).with_columns(slice=pl.lit(OVERALL))
    per_source = _summary(labelled, by="source").with_columns(
        slice=pl.lit(SOURCE_PREFIX) + pl.col("source")
    )
    return pl.concat(
        [overall.select(*SLICE_SCHEMA), per_source.sort("slice").select(*SLICE_SCHEMA)]
    ).cast(SLICE_SCHEMA)


def within_tolerance(candidate_loss: float, champion_loss: float, tolerance: float) -> bool:
    """Whether the candidate's loss is at most ``tolerance`` (relative) above the champion's."""
    return (candidate_loss - champion_loss) / champion_loss <= tolerance


def _summary(labelled: pl.DataFrame, by: str | None = None) -> pl.DataFrame:
    aggregates = [
        pl.len().alias("pairs"),
        (pl.col("margin") > 0).mean().alias("preference_accuracy"),
        pl.col("margin").mean().alias("mean_margin"),
    ]
    if by is None:
        return labelled.select(aggregates)
    return labelled.group_by(by).agg(aggregates)


def _check_two_documents_a_pair(rows: pl.DataFrame) -> None:
    pairs = rows["pair_ids"].list.len()
    for column in ("policy_logps", "reference_logps"):
        wrong = rows.filter(rows[column].list.len() != 2 * pairs)
        if wrong.height:
            row = wrong.row(0, named=True)
            raise ValueError(
                f"a row lists {len(row['pair_ids'])} pair(s) but {len(row[column])} {column}: "
                "a packed row holds a chosen and a rejected document per pair"
            )
