"""Preference pairs packed for DPO: each pair whole in one row, chosen then rejected, positions
restarting at every document, the loss on the responses only, best-fit decreasing over
pair units."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline_assets.lib.gold.packing import plan_best_fit_decreasing, plan_greedy_sequential
from pipeline_assets.lib.gold.preference_packing import (
    LEFT_OUT_SCHEMA,
    ROWS_SCHEMA,
    pack_pairs,
    pair_lengths,
)
from pipeline_assets_tests.lib.gold.tokenized_pairs import random_pairs as _pairs

SEQ_LEN, PAD_ID = 32, 0


def _random_shapes(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    return [
        (int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(1, 8)))
        for _ in range(n)
    ]


def _documents(row: dict) -> list[dict]:
    """A packed row cut at its document_lengths: ids, loss mask and positions of each document."""
    documents, start = [], 0
    for length in row["document_lengths"]:
        end = start + length
        documents.append(
            {name: row[name][start:end] for name in ("input_ids", "loss_mask", "position_ids")}
        )
        start = end
    return documents


def _by_id(pairs: pl.DataFrame) -> dict[str, dict]:
    return {pair["pair_id"]: pair for pair in pairs.iter_rows(named=True)}


@pytest.fixture(scope="module")
def pairs() -> pl.DataFrame:
    return _pairs(_random_shapes(40, seed=1), seed=2)


@pytest.fixture(scope="module")
def packed(pairs):
    return pack_pairs(pairs, SEQ_LEN, PAD_ID)


def test_rows_have_gold_columns_and_pair_ids(packed):
    assert packed.rows.schema == ROWS_SCHEMA
    assert packed.rows["input_ids"].list.len().unique().to_list() == [SEQ_LEN]
    assert (
        packed.rows["document_lengths"].list.len().to_list()
        == (2 * packed.rows["pair_ids"].list.len()).to_list()
    )


def test_each_row_holds_whole_pairs_chosen_then_rejected(pairs, packed):
    by_id = _by_id(pairs)
    for row in packed.rows.iter_rows(named=True):
        documents = _documents(row)
        for k, pair_id in enumerate(row["pair_ids"]):
            pair = by_id[pair_id]
            assert documents[2 * k]["input_ids"] == pair["prefix_ids"] + pair["chosen_ids"]
            assert documents[2 * k + 1]["input_ids"] == pair["prefix_ids"] + pair["rejected_ids"]


def test_positions_restart_at_every_document_and_over_the_tail(packed):
    for row in packed.rows.iter_rows(named=True):
        for document in _documents(row):
            assert document["position_ids"] == list(range(len(document["input_ids"])))
        used = sum(row["document_lengths"])
        assert row["position_ids"][used:] == list(range(SEQ_LEN - used))


def test_loss_mask_is_set_exactly_on_the_responses(pairs, packed):
    by_id = _by_id(pairs)
    for row in packed.rows.iter_rows(named=True):
        documents = _documents(row)
        for k, pair_id in enumerate(row["pair_ids"]):
            pair = by_id[pair_id]
            prefix = [False] * len(pair["prefix_ids"])
            assert documents[2 * k]["loss_mask"] == prefix + [True] * len(pair["chosen_ids"])
            assert documents[2 * k + 1]["loss_mask"] == prefix + [True] * len(pair["rejected_ids"])


def test_the_tail_is_padding_with_no_loss(packed):
    for row in packed.rows.iter_rows(named=True):
        used = sum(row["document_lengths"])
        assert row["input_ids"][used:] == [PAD_ID] * (SEQ_LEN - used)
        assert not any(row["loss_mask"][used:])


def test_every_pair_is_packed_once_or_left_out(pairs, packed):
    packed_ids = packed.rows["pair_ids"].explode().to_list()
    assert len(packed_ids) == len(set(packed_ids))
    assert sorted(packed_ids + packed.left_out["pair_id"].to_list()) == sorted(
        pairs["pair_id"].to_list()
    )
    assert packed.pairs_in == packed.pairs_packed + packed.pairs_too_long == pairs.height


def test_a_pair_longer_than_a_row_is_left_out_whole_and_one_exactly_a_row_long_is_kept():
    # 2 * 6 + 10 + 10 = 32 tokens: exactly a row; 2 * 6 + 10 + 11 = 33: one too many,
    # on one side only
    pairs = _pairs([(6, 10, 10), (6, 10, 11), (2, 3, 3)])

    packed = pack_pairs(pairs, SEQ_LEN, PAD_ID)

    assert packed.counters == {
        "pairs_in": 3,
        "pairs_packed": 2,
        "pairs_too_long": 1,
        "rows": 2,
        "efficiency": (32 + 10) / (2 * SEQ_LEN),
    }
    assert packed.left_out.schema == LEFT_OUT_SCHEMA
    assert packed.left_out.to_dicts() == [{"pair_id": "p01", "n_tokens": 33, "reason": "too_long"}]
    assert packed.rows["pair_ids"].to_list() == [["p00"], ["p02"]]
    assert packed.rows["document_lengths"][0].to_list() == [16, 16]


def test_rows_are_the_best_fit_decreasing_plan_of_the_pair_units(pairs, packed):
    units = pair_lengths(pairs)
    fitting = units[units <= SEQ_LEN]

    assert packed.rows.height == plan_best_fit_decreasing(fitting, SEQ_LEN).n_sequences
    assert packed.rows.height <= plan_greedy_sequential(fitting, SEQ_LEN).n_sequences
    assert packed.rows.height >= -(-int(fitting.sum()) // SEQ_LEN)
    assert packed.efficiency == pytest.approx(fitting.sum() / (packed.rows.height * SEQ_LEN))


def test_best_fit_decreasing_fills_rows_that_input_order_leaves_half_empty():
    # units of 12, 12, 12, 12, 20, 20, 20, 20: in input order two 12s share a row and each 20 has
    # its own; longest first, every 20 takes a 12 and the rows are full
    pairs = _pairs([(2, 4, 4)] * 4 + [(4, 6, 6)] * 4)

    packed = pack_pairs(pairs, SEQ_LEN, PAD_ID)

    assert plan_greedy_sequential(pair_lengths(pairs), SEQ_LEN).n_sequences == 6
    assert packed.rows.height == 4
    assert packed.efficiency == 1.0
    assert all(len(ids) == 2 for ids in packed.rows["pair_ids"].to_list())


def test_packing_is_deterministic_whatever_the_input_order(pairs, packed):
    shuffled = pairs.sample(fraction=1.0, shuffle=True, seed=7)
    again = pack_pairs(shuffled, SEQ_LEN, PAD_ID)

    assert again.rows.equals(packed.rows)
    assert again.left_out.equals(packed.left_out)
    assert again.counters == packed.counters


def test_no_pairs_give_no_rows():
    packed = pack_pairs(_pairs([]), SEQ_LEN, PAD_ID)

    assert packed.rows.schema == ROWS_SCHEMA and packed.rows.is_empty()
    assert packed.counters == {
        "pairs_in": 0,
        "pairs_packed": 0,
        "pairs_too_long": 0,
        "rows": 0,
        "efficiency": 0.0,
    }


@pytest.mark.parametrize("part", ["prefix_ids", "chosen_ids", "rejected_ids"])
def test_a_pair_with_an_empty_part_is_refused(part):
    empty = pl.lit([], dtype=pl.List(pl.Int64))
    pairs = _pairs([(2, 3, 3), (2, 3, 3)]).with_columns(
        pl.when(pl.col("pair_id") == "p01").then(empty).otherwise(pl.col(part)).alias(part)
    )

    with pytest.raises(ValueError, match=f"pair 'p01' has no {part}"):
        pack_pairs(pairs, SEQ_LEN, PAD_ID)


def test_a_duplicated_pair_id_is_refused():
    pairs = _pairs([(2, 3, 3), (2, 3, 3)]).with_columns(pair_id=pl.lit("same"))

    with pytest.raises(ValueError, match="pair_id 'same' appears twice"):
        pack_pairs(pairs, SEQ_LEN, PAD_ID)
