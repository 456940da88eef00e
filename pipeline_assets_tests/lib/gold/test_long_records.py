"""Records longer than the sequence length keep their prompt: truncated or dropped,
always counted."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline_assets.lib.gold.sequences import build_sequences, fit_long_records
from pipeline_assets.lib.gold.tokenizer import ENCODED_SCHEMA


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
