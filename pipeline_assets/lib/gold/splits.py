"""The train/validation/search split: a record's side is a function of its content alone.

A threshold on a stable hash keeps every record on the same side in every data snapshot, so a
validation record never becomes a training record when later batches arrive; since the hash
ignores the source, each source gets the validation fraction in expectation (metadata reports
the realized share per source).

Validation takes the bottom of the hash range and search (the rows hyperparameter search selects
on, kept apart from the promotion gate's validation rows) the top: each split only ever trades
records with train, so adding or resizing the search split leaves validation exactly as it was.
"""

from __future__ import annotations

from typing import TypeVar

import polars as pl
import polars_hash as plh

TRAIN, VALIDATION, SEARCH = "train", "validation", "search"
SPLITS = (TRAIN, VALIDATION, SEARCH)  # the order gold packs them in (and seeds their shuffles by)
_BUCKETS = 1_000_000
Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


def assign_split(
    frame: Frame,
    validation_fraction: float,
    salt: str = "split-v1",
    key: str = "exact_hash",
    search_fraction: float = 0.0,
) -> Frame:
    """``frame`` plus ``split`` (train / validation / search), from xxh3 of salt + ``key``. The
    default key is the record's content (silver's exact-dedup hash), not its id: the same text lands
    in the same split however and whenever it was ingested (a rebuild, another store), and never
    moves from validation to train."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {validation_fraction}")
    if not 0.0 <= search_fraction < 1.0 - validation_fraction:
        raise ValueError(
            "search fraction must be in [0, 1 - validation fraction = "
            f"{1 - validation_fraction:g}), got {search_fraction}"
        )
    bucket = plh.concat_str(pl.lit(salt), pl.col(key)).nchash.xxh3_64() % _BUCKETS
    return frame.with_columns(
        split=pl.when(bucket < int(validation_fraction * _BUCKETS))
        .then(pl.lit(VALIDATION))
        .when(bucket >= _BUCKETS - int(search_fraction * _BUCKETS))
        .then(pl.lit(SEARCH))
        .otherwise(pl.lit(TRAIN))
    )


def split_shares(frame: pl.DataFrame) -> pl.DataFrame:
    """Per source: rows and the realized validation and search shares."""
    return (
        frame.group_by("source")
        .agg(
            rows=pl.len(),
            validation=(pl.col("split") == VALIDATION).sum(),
            search=(pl.col("split") == SEARCH).sum(),
        )
        .with_columns(
            validation_share=pl.col("validation") / pl.col("rows"),
            search_share=pl.col("search") / pl.col("rows"),
        )
        .sort("source")
    )
