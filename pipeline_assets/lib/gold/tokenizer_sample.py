"""The tokenizer's training sample: silver's training split, capped in characters.

Training records are ranked by a salted xxh3 of their content (silver's ``exact_hash``, as the
split is) and taken in ascending rank while their texts total at most the cap: a bottom-k sample
by hash. A record's rank depends on its content alone, so the sample is the same on every run
and in whatever order silver's rows are read; when batches arrive, a record leaves the sample
only when new records ranking lower take its place under the cap.

Memory follows the cap, not silver: the scan reads ids, hashes and text lengths to pick the
sample, then the texts of the sampled records alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
import polars_hash as plh

from pipeline_assets.lib.formats import SFT, record_chars
from pipeline_assets.lib.gold.splits import TRAIN, assign_split

# not the split's salt: the sample must not lean to one end of the split's hash range
_SALT = "tokenizer-sample-v1"


@dataclass(frozen=True)
class TokenizerSample:
    records: (
        pl.DataFrame
    )  # record_id and the text columns of the sampled records, in ascending rank
    chars: int  # characters of their texts
    train_records: int  # records in the training split, sampled or not
    train_chars: int
    max_chars: int  # the cap


def sample_for_tokenizer(
    silver: pl.LazyFrame, max_chars: int, validation_fraction: float, search_fraction: float
) -> TokenizerSample:
    """The training-split records of ``silver`` (record_id, exact_hash and the text columns) whose
    texts total at most ``max_chars`` characters, lowest rank first."""
    if max_chars < 1:
        raise ValueError(
            f"the tokenizer sample's cap must be at least 1 character, got {max_chars}"
        )
    train = _ranked_training_records(silver, validation_fraction, search_fraction)
    picked, totals = pl.collect_all(
        [_lowest_ranks_within(train, max_chars), _totals(train)], engine="streaming"
    )
    return TokenizerSample(
        records=_texts_of(silver, picked),
        chars=int(picked["chars"].sum()),
        train_records=int(totals["records"][0]),
        train_chars=int(totals["chars"][0] or 0),
        max_chars=max_chars,
    )


def _ranked_training_records(
    silver: pl.LazyFrame, validation_fraction: float, search_fraction: float
) -> pl.LazyFrame:
    """record_id, rank, chars of every training-split record: no text column is kept."""
    keyed = silver.select("record_id", "exact_hash", chars=record_chars().cast(pl.Int64))
    return (
        assign_split(keyed, validation_fraction, search_fraction=search_fraction)
        .filter(pl.col("split") == TRAIN)
        .select(
            "record_id",
            "chars",
            rank=plh.concat_str(pl.lit(_SALT), pl.col("exact_hash")).nchash.xxh3_64(),
        )
    )


def _lowest_ranks_within(train: pl.LazyFrame, max_chars: int) -> pl.LazyFrame:
    # record_id breaks ties in rank, so the order is total and the sample never depends on read
    # order
    return (
        train.sort("rank", "record_id")
        .filter(pl.col("chars").cum_sum() <= max_chars)
        .select("record_id", "chars")
    )


def _totals(train: pl.LazyFrame) -> pl.LazyFrame:
    return train.select(records=pl.len(), chars=pl.col("chars").sum())


def _texts_of(silver: pl.LazyFrame, picked: pl.DataFrame) -> pl.DataFrame:
    """The text columns of the picked records, in the order they were picked."""
    texts = (
        silver.filter(pl.col("record_id").is_in(picked["record_id"].implode()))
        .select("record_id", *SFT.text)
        .collect(engine="streaming")
    )
    return picked.select("record_id").join(texts, on="record_id", how="left", maintain_order="left")
