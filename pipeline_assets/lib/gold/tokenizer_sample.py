"""The tokenizer's training sample: silver's training split, capped in characters.

The sample is drawn from every format trained with sft's loss (sft records and conversations), so
a lake of conversations alone gets a tokenizer too. Each record is on the side of the split gold
puts it on (the hash of its format's ``split_key``); training records are ranked by a salted xxh3
of their content (silver's ``exact_hash``) and taken in ascending rank while their texts total at
most the cap: a bottom-k sample by hash. A record's rank depends on its content alone, so the
sample is the same on every run and in whatever order silver's rows are read; when batches arrive,
a record leaves the sample only when new records ranking lower take its place under the cap.

Memory follows the cap, not silver: the scan reads ids, hashes and text lengths to pick the
sample, then the texts of the sampled records alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import polars as pl
import polars_hash as plh

from pipeline_assets.lib.formats import RecordFormat, record_chars
from pipeline_assets.lib.gold.conversations import format_messages
from pipeline_assets.lib.gold.splits import TRAIN, assign_split

# not the split's salt: the sample must not lean to one end of the split's hash range
_SALT = "tokenizer-sample-v1"


@dataclass(frozen=True)
class TokenizerSample:
    # record_id and messages of the sampled records (an sft record as its one exchange), in
    # ascending rank
    records: pl.DataFrame
    chars: int  # characters of their texts
    train_records: int  # records in the training split, sampled or not
    train_chars: int
    max_chars: int  # the cap


def sample_for_tokenizer(
    silver: Mapping[RecordFormat, pl.LazyFrame],
    max_chars: int,
    validation_fraction: float,
    search_fraction: float,
) -> TokenizerSample:
    """The training-split records of each format's silver rows (record_id, exact_hash, the
    format's split key and text) whose texts total at most ``max_chars`` characters, lowest rank
    first."""
    if max_chars < 1:
        raise ValueError(
            f"the tokenizer sample's cap must be at least 1 character, got {max_chars}"
        )
    train = pl.concat(
        [
            _ranked_training_records(rows, fmt, validation_fraction, search_fraction)
            for fmt, rows in silver.items()
        ]
    )
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
    silver: pl.LazyFrame, fmt: RecordFormat, validation_fraction: float, search_fraction: float
) -> pl.LazyFrame:
    """record_id, rank, chars of every training-split record of one format: no text column is
    kept."""
    keyed = silver.select(
        "record_id",
        "exact_hash",
        pl.col(fmt.split_key).alias("_split_key"),
        chars=_chars(fmt).cast(pl.Int64),
    )
    return (
        assign_split(keyed, validation_fraction, key="_split_key", search_fraction=search_fraction)
        .filter(pl.col("split") == TRAIN)
        .select(
            "record_id",
            "chars",
            rank=plh.concat_str(pl.lit(_SALT), pl.col("exact_hash")).nchash.xxh3_64(),
        )
    )


def _chars(fmt: RecordFormat) -> pl.Expr:
    """Characters of a record's text: its turns' contents, or its text fields."""
    if fmt.turns is None:
        return record_chars(fmt.text)
    contents = pl.element().struct.field("content").str.len_chars()
    return pl.col(fmt.turns).list.eval(contents).list.sum()


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


def _texts_of(silver: Mapping[RecordFormat, pl.LazyFrame], picked: pl.DataFrame) -> pl.DataFrame:
    """The messages of the picked records, in the order they were picked."""
    ids = picked["record_id"].implode()
    texts = pl.concat(
        pl.collect_all(
            [
                format_messages(rows.filter(pl.col("record_id").is_in(ids)), fmt)
                for fmt, rows in silver.items()
            ],
            engine="streaming",
        )
    )
    return picked.select("record_id").join(texts, on="record_id", how="left", maintain_order="left")
