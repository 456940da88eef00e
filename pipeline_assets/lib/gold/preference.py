"""Gold for preference pairs: a batch's silver pairs tokenized, then packed per split and shuffled.

A pair renders as two documents sharing one prefix (the prompt up to the assistant's turn, in the
chat format or the base model's template, ``lib.gold.encoder``): prefix + chosen and prefix +
rejected, each response with the end of its turn; the loss mask covers the responses. A
conversational pair's prefix holds its earlier turns (``prompt_messages``) before the prompt, and
its answers are the conversation's last assistant turn, the only one in the loss.
``lib.gold.preference_packing`` keeps both documents of a pair in one row; a pair longer than the
sequence length is left out whole and counted. Splits are packed apart, as gold's
sft shards are, and each is shuffled with the shard's seed.
"""

from __future__ import annotations

from functools import partial

import polars as pl

from pipeline_assets.lib.formats import PREFERENCE, TURNS
from pipeline_assets.lib.gold.conversations import LAST, records_as_conversations
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.packing import shuffle_sequences
from pipeline_assets.lib.gold.preference_packing import LEFT_OUT_SCHEMA, ROWS_SCHEMA, pack_pairs
from pipeline_assets.lib.gold.splits import SPLITS
from pipeline_assets.lib.gold.tokenizer import check_required_text
from pipeline_assets.lib.stages import Stage

# PIPELINE_PREFERENCE_VALIDATION_FRACTION: held-out prompts that preference accuracy is judged on
VALIDATION_FRACTION = 0.10
CONTEXT = PREFERENCE.context
PAIR_INPUT = ("record_id", "system", CONTEXT, "prompt", "chosen", "rejected", "source", "split")


def tokenize_pairs_stage(spec: EncoderSpec) -> Stage:
    """Gold's block stage for pairs: PAIR_INPUT rows -> pair_id, prefix_ids, chosen_ids,
    rejected_ids, n_tokens (the pair's unit: two prefixes and both responses), source and split, in
    the block's order."""
    return Stage("tokenize", partial(_tokenize_pairs_block, spec=spec))


def _tokenize_pairs_block(
    block: pl.DataFrame, spec: EncoderSpec
) -> tuple[pl.DataFrame, None, dict]:
    encoder = chat_encoder(spec)
    sides = {
        side: encoder.encode_conversations(pair_side_conversations(block, side), loss=LAST)
        for side in ("chosen", "rejected")
    }
    # The prefix ends where the loss starts; the response is what the loss covers (a template's
    # text after the end-of-turn token, ChatML's newline, is left out of the pair).
    chosen, rejected = (
        encoded.select(
            prefix=pl.col("loss_mask").list.arg_max(),
            response="n_response_tokens",
            ids="input_ids",
        )
        for encoded in sides.values()
    )
    tokenized = pl.DataFrame(
        {
            "pair_id": block["record_id"],
            "prefix_ids": chosen.select(pl.col("ids").list.head(pl.col("prefix")))["ids"],
            "chosen_ids": _responses(chosen),
            "rejected_ids": _responses(rejected),
        }
    ).with_columns(block.select("source", "split"))
    tokenized = tokenized.with_columns(
        n_tokens=(
            2 * pl.col("prefix_ids").list.len()
            + pl.col("chosen_ids").list.len()
            + pl.col("rejected_ids").list.len()
        ).cast(pl.Int32)
    )
    return tokenized, None, {"tokens": int(tokenized["n_tokens"].sum())}


def pair_side_conversations(pairs: pl.DataFrame, side: str) -> pl.DataFrame:
    """record_id, messages: each pair as the conversation that ends with its ``side`` answer:
    [system], its earlier turns, the prompt as a user turn, the answer as the assistant turn."""
    check_required_text(pairs.select("prompt", response=side))
    record = pairs.select("record_id", "system", CONTEXT, "prompt", response=side)
    return records_as_conversations(record, context=CONTEXT)


def with_context_column(pairs: pl.DataFrame) -> pl.DataFrame:
    """Pairs read from a silver/preference_pairs written before pairs had earlier turns: their
    ``prompt_messages`` null."""
    if CONTEXT in pairs.columns:
        return pairs
    return pairs.with_columns(pl.lit(None, dtype=TURNS).alias(CONTEXT))


def _responses(encoded: pl.DataFrame) -> pl.Series:
    return encoded.select(pl.col("ids").list.slice(pl.col("prefix"), pl.col("response")))["ids"]


def build_pair_sequences(
    tokenized: pl.DataFrame, seq_len: int, seed: int, pad_id: int
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """(rows with split, sequence_index and real_tokens; the pairs left out, with their split;
    counters)."""
    frames, left_out, by_split, packed_pairs = [], [], {}, 0
    for number, split in enumerate(SPLITS):
        packed = pack_pairs(tokenized.filter(pl.col("split") == split), seq_len, pad_id)
        order = shuffle_sequences(packed.rows.height, seed + number)
        frames.append(
            packed.rows[order].with_columns(
                split=pl.lit(split),
                sequence_index=pl.int_range(pl.len(), dtype=pl.Int64),
                real_tokens=pl.col("document_lengths").list.sum().cast(pl.Int32),
            )
        )
        left_out.append(packed.left_out.with_columns(split=pl.lit(split)))
        by_split[split], packed_pairs = packed.rows.height, packed_pairs + packed.pairs_packed
    rows = pl.concat(frames) if frames else pl.DataFrame(schema=ROWS_SCHEMA)
    real = int(rows["real_tokens"].sum()) if rows.height else 0
    return (
        rows,
        pl.concat(left_out) if left_out else pl.DataFrame(schema=LEFT_OUT_SCHEMA),
        {
            "pairs_in": tokenized.height,
            "pairs_packed": packed_pairs,
            "pairs_too_long": tokenized.height - packed_pairs,
            "sequences_by_split": by_split,
            "efficiency": real / (rows.height * seq_len) if rows.height else 0.0,
        },
    )
