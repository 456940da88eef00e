"""Preference pairs packed into fixed-length rows for DPO, each pair whole in one row.

A pair (prompt, chosen, rejected) is one packing unit of two documents, laid end to end::

    | prefix  chosen | prefix  rejected | prefix  chosen | prefix  rejected | ... | pad pad pad |
    |<- pair A ----------------------->|<- pair B ----------------------->|     |<- tail ->|

- ``input_ids``: the tokens, ``pad_id`` on the tail.
- ``position_ids``: 0, 1, ... from the start of every document (the chosen and the rejected document
  of a pair each restart at 0, so neither sees the other), and 0, 1, ... again over the tail.
- ``loss_mask``: True on the response tokens only (``chosen_ids`` / ``rejected_ids``, which end with
  the END and EOS that ``chat_format.response_text`` adds), False on prefixes and on the tail.
- ``document_lengths``: the length of every document of the row in order (the tail is not listed:
  it is ``seq_len - sum``). A row holds an even number of documents: chosen, rejected, chosen,
  rejected, ..., so the trainer pairs document 2k with 2k + 1.
- ``pair_ids``: the pair of each unit, in row order (``pair_ids[k]`` owns documents 2k and 2k + 1).

These are the columns of gold's SFT rows (``lib.gold.sequences.pack_records``), with ``pair_ids`` in
place of ``record_ids``. Units are placed by the project's one packer (``lib.gold.packing``):
best-fit decreasing on the unit's total length, ``2 * prefix + chosen + rejected``. A pair longer
than ``seq_len`` is left out whole (reason ``too_long``), never cut on one side: a cut response
would change what is preferred.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from pipeline_assets.lib.gold.packing import (
    PackingPlan,
    pack,
    packed_frame,
    plan_best_fit_decreasing,
)

PAIR_COLUMNS = ("pair_id", "prefix_ids", "chosen_ids", "rejected_ids")
LEFT_OUT_SCHEMA = pl.Schema({"pair_id": pl.String, "n_tokens": pl.Int64, "reason": pl.String})
ROWS_SCHEMA = pl.Schema(
    {
        "input_ids": pl.List(pl.Int32),
        "loss_mask": pl.List(pl.Boolean),
        "position_ids": pl.List(pl.Int32),
        "document_lengths": pl.List(pl.Int32),
        "pair_ids": pl.List(pl.String),
    }
)


@dataclass(frozen=True)
class PackedPairs:
    rows: pl.DataFrame  # ROWS_SCHEMA, one row per packed sequence
    left_out: pl.DataFrame  # LEFT_OUT_SCHEMA, one row per pair that was not packed
    pairs_in: int
    pairs_packed: int
    pairs_too_long: int
    efficiency: float  # real tokens / (rows * seq_len)

    @property
    def counters(self) -> dict:
        return {
            "pairs_in": self.pairs_in,
            "pairs_packed": self.pairs_packed,
            "pairs_too_long": self.pairs_too_long,
            "rows": self.rows.height,
            "efficiency": self.efficiency,
        }


def pack_pairs(pairs: pl.DataFrame, seq_len: int, pad_id: int) -> PackedPairs:
    """Tokenized pairs (PAIR_COLUMNS) -> packed rows (see the module doc). The pairs are sorted by
    ``pair_id`` first, so the rows do not depend on the order the pairs arrive in."""
    pairs = _checked_pairs(pairs)
    unit_lengths = pair_lengths(pairs)
    fits = unit_lengths <= seq_len
    kept = pairs.filter(pl.Series(fits))
    left_out = pairs.filter(pl.Series(~fits)).select(
        "pair_id",
        n_tokens=pl.Series(unit_lengths[~fits], dtype=pl.Int64),
        reason=pl.lit("too_long"),
    )
    rows = _packed_rows(kept, unit_lengths[fits], seq_len, pad_id)
    real_tokens = int(unit_lengths[fits].sum())
    return PackedPairs(
        rows=rows,
        left_out=left_out.cast(dict(LEFT_OUT_SCHEMA)),
        pairs_in=pairs.height,
        pairs_packed=kept.height,
        pairs_too_long=left_out.height,
        efficiency=real_tokens / (rows.height * seq_len) if rows.height else 0.0,
    )


def pair_lengths(pairs: pl.DataFrame) -> np.ndarray:
    """int64 per pair: the tokens of its unit, prefix + chosen then prefix + rejected."""
    lengths = pairs.select(
        2 * pl.col("prefix_ids").list.len().cast(pl.Int64)
        + pl.col("chosen_ids").list.len()
        + pl.col("rejected_ids").list.len()
    )
    return lengths.to_series().to_numpy().astype(np.int64)


def _packed_rows(
    pairs: pl.DataFrame, unit_lengths: np.ndarray, seq_len: int, pad_id: int
) -> pl.DataFrame:
    if pairs.is_empty():
        return pl.DataFrame(schema=ROWS_SCHEMA)
    unit_plan = plan_best_fit_decreasing(unit_lengths, seq_len)
    documents = _documents(pairs)
    packed = pack(
        _document_plan(unit_plan, pairs),
        documents["input_ids"],
        documents["loss_mask"],
        seq_len,
        pad_id,
    )
    return (
        packed_frame(packed)
        .rename({"doc_lengths": "document_lengths"})
        .with_columns(
            pl.col("loss_mask").cast(pl.List(pl.Boolean)),
            pair_ids=_pair_ids_per_row(unit_plan, pairs["pair_id"]),
        )
    )


def _documents(pairs: pl.DataFrame) -> pl.DataFrame:
    """input_ids and loss_mask of every document: the chosen one of each pair, then the rejected
    ones (document i is pair i's chosen, n + i its rejected)."""
    zeros, ones = (pl.element() * 0).cast(pl.UInt8), (pl.element() * 0 + 1).cast(pl.UInt8)

    def document(response: str) -> pl.DataFrame:
        return pairs.select(
            input_ids=pl.concat_list("prefix_ids", response),
            loss_mask=pl.concat_list(
                pl.col("prefix_ids").list.eval(zeros), pl.col(response).list.eval(ones)
            ),
        )

    return pl.concat([document("chosen_ids"), document("rejected_ids")])


def _document_plan(unit_plan: PackingPlan, pairs: pl.DataFrame) -> PackingPlan:
    """The unit plan as a plan of documents: a pair's chosen document where its unit starts, its
    rejected document right after, so ``pack`` restarts positions at both."""
    prefix = pairs["prefix_ids"].list.len().to_numpy().astype(np.int64)
    chosen = prefix + pairs["chosen_ids"].list.len().to_numpy().astype(np.int64)
    rejected = prefix + pairs["rejected_ids"].list.len().to_numpy().astype(np.int64)
    n_documents = 2 * pairs.height
    return PackingPlan(
        sequence_of_doc=np.concatenate([unit_plan.sequence_of_doc, unit_plan.sequence_of_doc]),
        offset_in_sequence=np.concatenate(
            [unit_plan.offset_in_sequence, unit_plan.offset_in_sequence + chosen]
        ),
        piece_doc=np.arange(n_documents, dtype=np.int64),
        piece_start=np.zeros(n_documents, dtype=np.int64),
        piece_length=np.concatenate([chosen, rejected]),
        n_sequences=unit_plan.n_sequences,
        split_documents=0,
    )


def _pair_ids_per_row(unit_plan: PackingPlan, pair_ids: pl.Series) -> pl.Series:
    """Per row, the pair of each unit in the order the units sit in the row."""
    order = np.lexsort((unit_plan.offset_in_sequence, unit_plan.sequence_of_doc))
    units = pl.DataFrame(
        {"row": unit_plan.sequence_of_doc[order], "pair_id": pair_ids.gather(order)}
    )
    grouped = units.group_by("row", maintain_order=True).agg("pair_id")
    every_row = pl.DataFrame({"row": np.arange(unit_plan.n_sequences, dtype=np.int64)})
    return every_row.join(grouped, on="row", how="left").sort("row")["pair_id"].alias("pair_ids")


def _checked_pairs(pairs: pl.DataFrame) -> pl.DataFrame:
    """The pair columns, sorted by pair_id; a ValueError for a missing, null or empty part."""
    missing = [name for name in PAIR_COLUMNS if name not in pairs.columns]
    if missing:
        raise ValueError(f"pairs lack column(s) {', '.join(missing)}")
    pairs = pairs.select(PAIR_COLUMNS)
    if pairs["pair_id"].is_duplicated().any():
        raise ValueError(
            f"pair_id {pairs.filter(pl.col('pair_id').is_duplicated())['pair_id'][0]!r} appears "
            "twice"
        )
    for name in PAIR_COLUMNS:
        # A document needs a prefix (its first response token is predicted from it) and a response
        # (the trainer tells a document from the padding tail by its loss tokens).
        empty = pl.col(name).is_null() | (
            pl.col(name).list.len() == 0 if name != "pair_id" else pl.lit(False)
        )
        bad = pairs.filter(empty)
        if bad.height:
            raise ValueError(f"pair {bad['pair_id'][0]!r} has no {name}")
    return pairs.sort("pair_id")
