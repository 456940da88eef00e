"""Records longer than the sequence length keep their prompt: truncated or dropped, always
counted; a conversation is cut only between turns."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.sequences import build_sequences, fit_long_records
from pipeline_assets.lib.gold.tokenizer import ENCODED_SCHEMA, tokenizer_to_json, train_bpe
from pipeline_assets_tests.lib.gold.conversation_frames import conversations, turns
from pipeline_assets_tests.lib.gold.test_conversations import trained_spans


def _encoded(shapes: dict[str, tuple[int, int]]) -> pl.DataFrame:
    """record_id -> (prompt tokens, response tokens); prompt ids count from 1000, response
    ids from 1."""
    rows = []
    for record_id, (prompt, response) in shapes.items():
        ids = list(range(1000, 1000 + prompt)) + list(range(1, 1 + response))
        rows.append(
            {
                "record_id": record_id,
                "input_ids": ids,
                "loss_mask": [0] * prompt + [1] * response,
                "n_tokens": prompt + response,
                "n_response_tokens": response,
            }
        )
    return pl.DataFrame(rows, schema=ENCODED_SCHEMA).with_columns(
        split=pl.lit("train"), source=pl.lit("s")
    )


SHAPES = {"fits": (10, 20), "long": (12, 100), "huge_prompt": (40, 5), "prompt_fills_row": (32, 3)}


def test_truncate_keeps_the_whole_prompt_and_cuts_the_response():
    fitted = fit_long_records(_encoded(SHAPES), seq_len=32, mode="truncate")
    kept = {row["record_id"]: row for row in fitted.records.iter_rows(named=True)}
    assert sorted(kept) == ["fits", "long"] and fitted.truncated_documents == 1
    long = kept["long"]
    assert long["input_ids"] == list(range(1000, 1012)) + list(range(1, 21))
    assert long["loss_mask"] == [0] * 12 + [1] * 20
    assert (long["n_tokens"], long["n_response_tokens"]) == (32, 20)
    assert kept["fits"]["n_tokens"] == 30
    assert fitted.left_out.sort("record_id").select("record_id", "reason").rows() == [
        ("huge_prompt", "prompt_too_long"),
        ("prompt_fills_row", "prompt_too_long"),
    ]


def test_drop_leaves_long_records_out_and_names_them():
    fitted = fit_long_records(_encoded(SHAPES), seq_len=32, mode="drop")
    assert fitted.records["record_id"].to_list() == ["fits"] and fitted.truncated_documents == 0
    assert fitted.left_out.sort("record_id").select(
        "record_id", "reason", "n_tokens", "prompt_tokens"
    ).rows() == [
        ("huge_prompt", "prompt_too_long", 45, 40),
        ("long", "too_long", 112, 12),
        ("prompt_fills_row", "prompt_too_long", 35, 32),
    ]


def test_no_packed_piece_trains_a_response_without_its_prompt():
    for mode in ("truncate", "drop"):
        fitted = fit_long_records(_encoded(SHAPES), seq_len=32, mode=mode)
        sequences, packing = build_sequences(fitted.records, seq_len=32, seed=1, pad_id=0)
        assert packing["split_documents"] == 0
        for ids, mask, lengths in sequences.select(
            "input_ids", "loss_mask", "document_lengths"
        ).iter_rows():
            start = 0
            for length in lengths:
                piece_ids, piece_mask = (
                    np.array(ids[start : start + length]),
                    np.array(mask[start : start + length]),
                )
                assert piece_ids[0] == 1000 and not piece_mask[0], (
                    "every piece opens with its prompt"
                )
                start += length


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="PIPELINE_LONG_RECORDS.*'truncate', 'drop'"):
        fit_long_records(_encoded(SHAPES), seq_len=32, mode="split")


def _conversations(shapes: dict[str, list[tuple[int, bool]]]) -> pl.DataFrame:
    """record_id -> pieces (tokens, trained) in order: context ids count from 1000, trained ids
    from 1; every record a conversation (whole_turns)."""
    rows = []
    for record_id, pieces in shapes.items():
        ids, mask = [], []
        for length, trained in pieces:
            ids += list(range(1 if trained else 1000, (1 if trained else 1000) + length))
            mask += [int(trained)] * length
        rows.append(
            {
                "record_id": record_id,
                "input_ids": ids,
                "loss_mask": mask,
                "n_tokens": len(ids),
                "n_response_tokens": sum(mask),
            }
        )
    return pl.DataFrame(rows, schema=ENCODED_SCHEMA).with_columns(
        split=pl.lit("train"), source=pl.lit("chats"), whole_turns=pl.lit(True)
    )


CONVERSATION_SHAPES = {
    "fits": [(5, False), (6, True), (4, False), (6, True)],
    "cut_after_two": [(5, False), (6, True), (4, False), (6, True), (4, False), (20, True)],
    "second_ends_at_the_edge": [
        (10, False),
        (6, True),
        (4, False),
        (12, True),
        (3, False),
        (5, True),
    ],
    "first_turn_too_long": [(5, False), (40, True), (3, False), (2, True)],
    "context_fills_row": [(32, False), (3, True)],
}


def test_a_long_conversation_is_cut_after_its_last_whole_assistant_turn():
    encoded = pl.concat(
        [
            _conversations(CONVERSATION_SHAPES),
            _encoded({"sft": (12, 100)}).with_columns(whole_turns=pl.lit(False)),
        ]
    )
    fitted = fit_long_records(encoded, seq_len=32, mode="truncate")
    kept = {row["record_id"]: row for row in fitted.records.iter_rows(named=True)}
    assert sorted(kept) == ["cut_after_two", "fits", "second_ends_at_the_edge", "sft"]
    assert fitted.truncated_documents == 3
    cut = kept["cut_after_two"]
    assert cut["loss_mask"] == [0] * 5 + [1] * 6 + [0] * 4 + [1] * 6, "never inside a turn"
    assert (cut["n_tokens"], cut["n_response_tokens"]) == (21, 12)
    edge = kept["second_ends_at_the_edge"]
    assert (edge["n_tokens"], edge["n_response_tokens"]) == (32, 18)
    assert kept["fits"]["n_tokens"] == 21 and kept["sft"]["n_tokens"] == 32, "sft: cut response"
    assert fitted.left_out.sort("record_id").select(
        "record_id", "reason", "prompt_tokens"
    ).rows() == [
        ("context_fills_row", "prompt_too_long", 32),
        ("first_turn_too_long", "turn_too_long", 5),
    ]


def test_drop_leaves_every_long_conversation_out_whole():
    fitted = fit_long_records(_conversations(CONVERSATION_SHAPES), seq_len=32, mode="drop")
    assert fitted.records["record_id"].to_list() == ["fits"] and fitted.truncated_documents == 0
    assert dict(fitted.left_out.select("record_id", "reason").iter_rows()) == {
        "cut_after_two": "too_long",
        "second_ends_at_the_edge": "too_long",
        "first_turn_too_long": "too_long",
        "context_fills_row": "prompt_too_long",
    }


@pytest.mark.parametrize("loss", ["all", "last"])
def test_a_real_cut_conversation_ends_on_a_whole_answer(loss):
    answers = [f"Answer number {k} says a few words about order {k}." for k in range(6)]
    messages = [
        turn
        for k, answer in enumerate(answers)
        for turn in (("user", f"And what about order {k}?"), ("assistant", answer))
    ]
    tokenizer = train_bpe([text for _, text in messages] * 5, vocab_size=300)
    encoder = chat_encoder(EncoderSpec(tokenizer_to_json(tokenizer)))
    encoded = encoder.encode_conversations(conversations({"long": turns(*messages)}), loss)
    seq_len = int(encoded["n_tokens"][0]) * 2 // 3
    encoded = encoded.with_columns(split=pl.lit("train"), whole_turns=pl.lit(True))
    fitted = fit_long_records(encoded, seq_len, "truncate")
    if loss == "last":  # every turn before the final answer is its context: it fills the row
        assert fitted.records.is_empty()
        assert fitted.left_out["reason"].to_list() == ["prompt_too_long"]
        return
    (row,) = fitted.records.iter_rows(named=True)
    text = tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    assert text.endswith(".<|end|>") and "<|eos|>" not in text, "cut after a turn's <|end|>"
    kept = text.count("<|assistant|>")
    assert 1 <= kept < len(answers) and row["n_tokens"] <= seq_len
    spans = [encoder.decode(span) for span in trained_spans(row["input_ids"], row["loss_mask"])]
    assert spans == answers[:kept]
