"""Statistics the silver checks judge: pass rates per source against trailing batches, and why they
moved; the batch's drift against them."""

from __future__ import annotations

import polars as pl

from pipeline_assets.lib.drift import psi_categorical, psi_numeric
from pipeline_assets.lib.silver.quality import QUANTITIES

MIXES = ("source", "language")  # categorical: each one's mix
DRIFT_FEATURES = (*MIXES, *QUANTITIES)


def drift_scores(reference: pl.DataFrame, current: pl.DataFrame) -> dict[str, float]:
    """PSI of the batch's source mix, language mix and every quality-rule value against the
    trailing batches' (a row without a language, written before it was labelled, left out)."""
    scores = {
        f"{column}_mix": psi_categorical(
            reference[column].drop_nulls().to_list(), current[column].drop_nulls().to_list()
        )
        for column in MIXES
    }
    return scores | {
        q: psi_numeric(reference[q].to_numpy(), current[q].to_numpy()) for q in QUANTITIES
    }


def pass_rates(kept: pl.DataFrame, removed: pl.DataFrame) -> pl.DataFrame:
    """Per (batch_id, source): bronze rows, kept rows, pass rate. From counts: ``kept`` holds the
    kept rows per (batch_id, source) in its column ``kept``, ``removed`` the rejects per
    (batch_id, source, stage) in its column ``removed``."""
    rejected = removed.group_by("batch_id", "source").agg(rejected=pl.col("removed").sum())
    return (
        kept.join(rejected, on=["batch_id", "source"], how="full", coalesce=True)
        .with_columns(pl.col("kept", "rejected").fill_null(0).cast(pl.Int64))
        .with_columns(rows=pl.col("kept") + pl.col("rejected"))
        .with_columns(pass_rate=pl.col("kept") / pl.col("rows"))
        .sort("batch_id", "source")
    )


def pass_rate_drops(
    rates: pl.DataFrame, removed: pl.DataFrame, batch_id: str, trailing: int
) -> pl.DataFrame:
    """Per source of ``batch_id``: its pass rate, the median of its last ``trailing`` batches, the
    drop in points, and the stage whose share of removals grew most (what removed the
    difference)."""
    current = rates.filter(pl.col("batch_id") == batch_id).select("source", "rows", "pass_rate")
    earlier = (
        rates.filter(pl.col("batch_id") < batch_id)
        .sort("batch_id")
        .group_by("source")
        .agg(
            baseline=pl.col("pass_rate").tail(trailing).median(),
            baseline_batches=pl.col("pass_rate").tail(trailing).len(),
        )
    )
    blame = _stage_growth(rates, removed, batch_id, trailing)
    return (
        current.join(earlier, on="source", how="left")
        .with_columns(drop=pl.col("baseline") - pl.col("pass_rate"))
        .join(blame, on="source", how="left")
        .sort("source")
    )


def _stage_growth(
    rates: pl.DataFrame, removed: pl.DataFrame, batch_id: str, trailing: int
) -> pl.DataFrame:
    """Per source: the stage whose removed share (of the batch's rows) grew most against the
    trailing batches."""
    shares = removed.join(
        rates.select("batch_id", "source", "rows"), on=["batch_id", "source"]
    ).with_columns(share=pl.col("removed") / pl.col("rows"))
    now = shares.filter(pl.col("batch_id") == batch_id).select("source", "stage", now="share")
    recent_batches = (
        rates.filter(pl.col("batch_id") < batch_id)
        .select("source", "batch_id")
        .unique()
        .sort("batch_id")
        .group_by("source")
        .agg(pl.col("batch_id").tail(trailing))
        .explode("batch_id")
    )
    before = (
        shares.join(recent_batches, on=["source", "batch_id"])
        .group_by("source", "stage")
        .agg(before=pl.col("share").sum())
        .join(recent_batches.group_by("source").agg(n=pl.len()), on="source")
        .with_columns(before=pl.col("before") / pl.col("n"))
        .select("source", "stage", "before")
    )
    return (
        now.join(before, on=["source", "stage"], how="left")
        .with_columns(growth=pl.col("now") - pl.col("before").fill_null(0.0))
        .sort(["source", "growth", "stage"], descending=[False, True, False])
        .group_by("source", maintain_order=True)
        .agg(blamed_stage=pl.col("stage").first(), blamed_growth=pl.col("growth").first())
    )
