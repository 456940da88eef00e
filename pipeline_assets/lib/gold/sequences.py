"""Gold's assembly: encoded records per split -> packed, shuffled sequences, and their
statistics."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial

import numpy as np
import polars as pl

from pipeline_assets.lib.formats import SFT, RecordFormat
from pipeline_assets.lib.gold.conversations import DEFAULT_LOSS, format_messages
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.packing import (
    PackingPlan,
    pack,
    packed_frame,
    plan_best_fit_decreasing,
    shuffle_sequences,
)
from pipeline_assets.lib.gold.splits import SPLITS, assign_split
from pipeline_assets.lib.stages import Stage

# Rows per Parquet row group of gold/sequences, and the block a training rank reads at once: a
# block's read touches its own row groups only (about 19 MB at 512 tokens), not the whole file.
SEQUENCES_PER_BLOCK = 4096
SCORED_COLUMNS = (
    "input_ids",
    "loss_mask",
    "position_ids",
    "record_ids",
)  # what a packed row is scored on
SFT_OBJECTIVE = SFT.objective  # the formats gold/sequences packs
LONG_RECORD_MODES = ("truncate", "drop")
DEFAULT_LONG_RECORDS = "truncate"  # PIPELINE_LONG_RECORDS
LEFT_OUT_SCHEMA = pl.Schema(
    {
        "record_id": pl.String,
        "split": pl.String,
        "n_tokens": pl.Int32,
        "prompt_tokens": pl.Int32,
        "reason": pl.String,
    }
)


@dataclass(frozen=True)
class FittedRecords:
    # every record fits in seq_len with its whole prompt and >= 1 response token
    records: pl.DataFrame
    left_out: pl.DataFrame  # LEFT_OUT_SCHEMA; reason: prompt_too_long | too_long | turn_too_long
    truncated_documents: int


def fit_long_records(encoded: pl.DataFrame, seq_len: int, mode: str) -> FittedRecords:
    """Make every encoded record fit one sequence without losing its prompt, so packing never
    splits a record and trains a response piece with no prompt before it.

    A record whose prompt (everything before its first trained token) fills ``seq_len`` on its own
    is left out as ``prompt_too_long``. A longer record is left out as ``too_long`` (``drop``), or
    cut (``truncate``): an sft record's response loses its end; a conversation (``whole_turns``
    true) is cut after the last trained assistant turn that ends within ``seq_len``, never inside
    a turn, and left out as ``turn_too_long`` when its first trained turn does not end there.
    Without a ``whole_turns`` column every record is an sft record.
    """
    if mode not in LONG_RECORD_MODES:
        raise ValueError(
            f"PIPELINE_LONG_RECORDS must be one of {', '.join(map(repr, LONG_RECORD_MODES))}, not "
            f"{mode!r}"
        )
    whole_turns = pl.col("whole_turns") if "whole_turns" in encoded.columns else pl.lit(False)
    long = pl.col("n_tokens") > seq_len
    turn_cut = pl.Series("turn_cut", _turn_cuts(encoded, seq_len), dtype=pl.Int32)
    reason = (
        pl.when(pl.col("prompt_tokens") >= seq_len)
        .then(pl.lit("prompt_too_long"))
        .when(long & (mode == "drop"))
        .then(pl.lit("too_long"))
        .when(long & whole_turns & pl.col("turn_cut").is_null())
        .then(pl.lit("turn_too_long"))
    )
    judged = encoded.with_columns(
        turn_cut, prompt_tokens=pl.col("loss_mask").list.arg_max().cast(pl.Int32)
    ).with_columns(reason=reason)
    kept = judged.filter(pl.col("reason").is_null())
    truncated = int((kept["n_tokens"] > seq_len).sum())
    cut = (
        pl.when(long & whole_turns)
        .then(pl.col("turn_cut"))
        .otherwise(pl.min_horizontal("n_tokens", pl.lit(seq_len, pl.Int32)))
    )
    fitted = (
        kept.with_columns(cut=cut)
        .with_columns(
            pl.col("input_ids").list.head(pl.col("cut")),
            pl.col("loss_mask").list.head(pl.col("cut")),
            n_tokens=pl.col("cut"),
            n_response_tokens=pl.when(long)
            .then(pl.col("loss_mask").list.head(pl.col("cut")).list.sum())
            .otherwise(pl.col("n_response_tokens"))
            .cast(pl.Int32),
        )
        .drop("reason", "prompt_tokens", "turn_cut", "cut")
    )
    left_out = (
        judged.filter(pl.col("reason").is_not_null())
        .select(LEFT_OUT_SCHEMA.names())
        .cast(dict(LEFT_OUT_SCHEMA))
    )
    return FittedRecords(records=fitted, left_out=left_out, truncated_documents=truncated)


def _turn_cuts(encoded: pl.DataFrame, seq_len: int) -> list[int | None]:
    """Per record, where a conversation longer than ``seq_len`` is cut: the end of its last trained
    turn (a run of the loss mask, closed by its end-of-turn token) within ``seq_len``; None for
    every other record, and for a conversation whose first trained turn ends past it."""
    cuts: list[int | None] = [None] * encoded.height
    if "whole_turns" not in encoded.columns:
        return cuts
    long = encoded.select(
        (pl.col("whole_turns") & (pl.col("n_tokens") > seq_len)).arg_true()
    ).to_series()
    for row, mask in zip(long, encoded["loss_mask"].gather(long), strict=True):
        window = mask[: seq_len + 1].to_numpy()
        ends = np.flatnonzero((window[:-1] == 1) & (window[1:] == 0)) + 1
        cuts[row] = int(ends[-1]) if len(ends) else None
    return cuts


def gold_records(
    silver: pl.DataFrame, fmt: RecordFormat, validation_fraction: float, search_fraction: float
) -> pl.DataFrame:
    """A format's silver rows as gold tokenizes them: record_id, messages (an sft-shaped record as
    [system], user and its judged answer), source, split and whole_turns (a conversation, cut only
    between turns). The split is decided by the hash of the format's ``split_key``: an sft
    record's content, a conversation's first user turn, so that variants of one conversation
    share a side."""
    if fmt.objective != SFT_OBJECTIVE:
        raise ValueError(f"format {fmt.name!r} is not trained with sft's loss")
    rows = assign_split(
        silver.sort("record_id"),
        validation_fraction,
        key=fmt.split_key,
        search_fraction=search_fraction,
    )
    return format_messages(rows, fmt).with_columns(
        rows.select("source", "split"), whole_turns=pl.lit(fmt.turns is not None)
    )


def tokenize_stage(spec: EncoderSpec, loss: str = DEFAULT_LOSS) -> Stage:
    """Gold's block stage: records (record_id, messages, source, split, whole_turns) -> their
    encodings (``lib.gold.tokenizer.ENCODED_SCHEMA`` plus source, split and whole_turns), the loss
    on the assistant turns ``loss`` names, in the block's order. It removes nothing; an engine
    runs it block by block, here or on Ray."""
    return Stage("tokenize", partial(_tokenize_block, spec=spec, loss=loss))


def _tokenize_block(
    block: pl.DataFrame, spec: EncoderSpec, loss: str
) -> tuple[pl.DataFrame, None, dict]:
    encoded = chat_encoder(spec).encode_conversations(block.select("record_id", "messages"), loss)
    encoded = encoded.with_columns(block.select("source", "split", "whole_turns"))
    return encoded, None, {"tokens": int(encoded["n_tokens"].sum())}


def shard_seed(seed: int, batch_id: str) -> int:
    """The shuffle seed of one batch's shard: a rebuild of the batch shuffles it the same way, and
    no two batches share an order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{batch_id}".encode()).digest()[:4], "big")


def build_sequences(
    encoded: pl.DataFrame, seq_len: int, seed: int, pad_id: int
) -> tuple[pl.DataFrame, dict]:
    """``encoded`` has record_id, split, input_ids, loss_mask, n_tokens (sorted by record_id, so the
    plan does not depend on the order silver stored its rows). Each split is packed best-fit
    decreasing, then shuffled with ``seed``."""
    frames, by_split, split_documents = [], {}, 0
    for number, split in enumerate(SPLITS):
        part = encoded.filter(pl.col("split") == split)
        if part.is_empty():
            by_split[split] = 0
            continue
        packed, plan = pack_records(part, seq_len, pad_id)
        order = shuffle_sequences(plan.n_sequences, seed + number)
        frames.append(
            packed[order].with_columns(
                split=pl.lit(split),
                sequence_index=pl.int_range(pl.len(), dtype=pl.Int64),
                real_tokens=pl.col("document_lengths").list.sum().cast(pl.Int32),
            )
        )
        by_split[split] = plan.n_sequences
        split_documents += plan.split_documents
    sequences = pl.concat(frames) if frames else pl.DataFrame()
    real = int(sequences["real_tokens"].sum()) if frames else 0
    efficiency = real / (sequences.height * seq_len) if frames else 0.0
    return sequences, {
        "efficiency": efficiency,
        "sequences_by_split": by_split,
        "split_documents": split_documents,
    }


def pack_records(
    records: pl.DataFrame, seq_len: int, pad_id: int
) -> tuple[pl.DataFrame, PackingPlan]:
    """Records (record_id, input_ids, loss_mask, n_tokens) packed best-fit decreasing into rows of
    ``seq_len``: input_ids, loss_mask, position_ids (restarting at every piece), document_lengths
    and record_ids (the record of each piece, in order). The one packing rule of gold and
    evaluation."""
    plan = plan_best_fit_decreasing(records["n_tokens"].to_numpy(), seq_len)
    packed = packed_frame(pack(plan, records["input_ids"], records["loss_mask"], seq_len, pad_id))
    return packed.rename({"doc_lengths": "document_lengths"}).with_columns(
        pl.col("loss_mask").cast(pl.List(pl.Boolean)),
        record_ids=_record_ids_per_sequence(plan, records["record_id"].to_numpy()),
    ), plan


def pack_documents(encoded: pl.DataFrame, max_len: int, pad_id: int) -> pl.DataFrame:
    """encoded: record_id, input_ids, loss_mask (one document a row, e.g. eval-set items) -> packed
    rows as ``pack_records`` makes them, each document cut to ``max_len`` tokens first (it still
    attends only to itself): short items padded one to a row would cost ``max_len`` positions
    each."""
    cut = (
        encoded.with_columns(
            pl.col("input_ids").list.head(max_len), pl.col("loss_mask").list.head(max_len)
        )
        .with_columns(n_tokens=pl.col("input_ids").list.len())
        .filter(pl.col("n_tokens") > 0)
    )
    packed, _ = pack_records(cut, max_len, pad_id)
    return packed


def _record_ids_per_sequence(plan, record_ids: np.ndarray) -> pl.Series:
    """Per sequence, the record of each piece, in the order the pieces sit in the sequence."""
    order = np.lexsort((plan.offset_in_sequence, plan.sequence_of_doc))
    pieces = pl.DataFrame(
        {
            "sequence": plan.sequence_of_doc[order],
            # typed: no piece (an empty input) would otherwise make an object column
            "record_id": pl.Series(record_ids[plan.piece_doc[order]], dtype=pl.String),
        }
    )
    grouped = pieces.group_by("sequence", maintain_order=True).agg("record_id")
    every = pl.DataFrame({"sequence": np.arange(plan.n_sequences)})
    return (
        every.join(grouped, on="sequence", how="left")
        .sort("sequence")["record_id"]
        .alias("record_ids")
    )


def token_statistics(encoded: pl.DataFrame) -> dict:
    """Tokens in total and per source, and the tokens-per-record distribution."""
    by_source = (
        encoded.group_by("source")
        .agg(
            records=pl.len(),
            tokens=pl.col("n_tokens").sum(),
            response_tokens=pl.col("n_response_tokens").sum(),
        )
        .with_columns(tokens_per_record=(pl.col("tokens") / pl.col("records")).round(1))
        .sort("source")
    )
    lengths = encoded["n_tokens"]
    quantiles = (
        {f"p{q}": float(lengths.quantile(q / 100)) for q in (5, 25, 50, 75, 95, 99)}
        if lengths.len()
        else {}
    )
    return {
        "tokens": int(lengths.sum()),
        "by_source": by_source,
        "per_record_quantiles": {**quantiles, "max": int(lengths.max() or 0)},
    }
