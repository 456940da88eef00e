"""Sequence packing: split policy, both planners' invariants, best fit against a
reference, pack()."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline_assets.lib.gold.packing import (
    PackingPlan,
    doc_lengths_column,
    first_fit_rows,
    pack,
    packed_frame,
    packing_floor,
    plan_best_fit_decreasing,
    plan_greedy_sequential,
    shuffle_sequences,
    split_long_documents,
)

PLANNERS = [plan_best_fit_decreasing, plan_greedy_sequential]
PAD = -7  # never a real token id below, so padding is told apart from tokens


def _edge_lengths(seed: int, n: int, seq_len: int) -> np.ndarray:
    """Random lengths that always include 1, seq_len, seq_len + 1 and multiples of seq_len."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * seq_len, n)
    edges = [1, seq_len, seq_len + 1, 2 * seq_len, max(seq_len - 1, 1), 3 * seq_len + 2]
    return rng.permutation(np.concatenate([lengths, edges]))


def _realistic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Lognormal, median 150 tokens, clipped to [8, 2000]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 8, 2000).astype(np.int64)


def _documents(lengths: np.ndarray, seed: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids unique across all documents (1, 2, 3, ...) and a random 0/1 loss mask."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(lengths)
    ids = [np.arange(end - length + 1, end + 1) for end, length in zip(ends, lengths, strict=True)]
    masks = [rng.integers(0, 2, length).astype(np.uint8) for length in lengths]
    return ids, masks


def _reference_best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit decreasing by its definition: scan every open sequence for each piece."""
    _, _, piece_length = split_long_documents(lengths, seq_len)
    sequence = np.empty(piece_length.size, dtype=np.int64)
    offset = np.empty(piece_length.size, dtype=np.int64)
    used: list[int] = []
    for piece in np.argsort(-piece_length, kind="stable"):
        length = int(piece_length[piece])
        fitting = [(seq_len - u, s) for s, u in enumerate(used) if seq_len - u >= length]
        if fitting:
            _, chosen = min(fitting)  # least room, then lowest sequence index
        else:
            chosen = len(used)
            used.append(0)
        sequence[piece], offset[piece] = chosen, used[chosen]
        used[chosen] += length
    return sequence, offset, len(used)


# --- split policy -------------------------------------------------------------------------------


def test_split_covers_long_documents_with_consecutive_pieces():
    seq_len = 10
    lengths = np.array([3, 10, 11, 25, 1, 20])
    piece_doc, piece_start, piece_length = split_long_documents(lengths, seq_len)
    assert piece_doc.tolist() == [0, 1, 2, 2, 3, 3, 3, 4, 5, 5]
    assert piece_start.tolist() == [0, 0, 0, 10, 0, 10, 20, 0, 0, 10]
    assert piece_length.tolist() == [3, 10, 10, 1, 10, 10, 5, 1, 10, 10]
    assert plan_best_fit_decreasing(lengths, seq_len).split_documents == 3


@pytest.mark.parametrize("seed", range(3))
def test_split_pieces_tile_every_document(seed):
    seq_len = 32
    lengths = _edge_lengths(seed, 300, seq_len)
    piece_doc, piece_start, piece_length = split_long_documents(lengths, seq_len)
    assert (piece_length >= 1).all() and (piece_length <= seq_len).all()
    assert (
        np.bincount(piece_doc, weights=piece_length, minlength=lengths.size).tolist()
        == lengths.tolist()
    )
    next_start = piece_start + piece_length
    same_doc = piece_doc[1:] == piece_doc[:-1]
    assert (piece_start[1:][same_doc] == next_start[:-1][same_doc]).all()
    assert (piece_start[1:][~same_doc] == 0).all() and piece_start[0] == 0
    assert (piece_length[:-1][same_doc] == seq_len).all()  # only a document's last piece is short
    for planner in PLANNERS:
        assert planner(lengths, seq_len).split_documents == int((lengths > seq_len).sum())


@pytest.mark.parametrize("bad", [[5, 0, 3], [4, -2]])
def test_empty_or_negative_documents_are_rejected(bad):
    for planner in PLANNERS:
        with pytest.raises(ValueError, match="length"):
            planner(np.array(bad), 8)


# --- planners -----------------------------------------------------------------------------------


def _assert_layout(plan: PackingPlan, lengths: np.ndarray, seq_len: int) -> None:
    """No piece crosses a sequence boundary, no sequence overflows, no two pieces overlap."""
    assert (plan.offset_in_sequence >= 0).all()
    assert (plan.offset_in_sequence + plan.piece_length <= seq_len).all()
    assert plan.sequence_of_doc.min() == 0 and plan.sequence_of_doc.max() == plan.n_sequences - 1
    covered = np.zeros((plan.n_sequences, seq_len), dtype=np.int64)
    for sequence, offset, length in zip(
        plan.sequence_of_doc, plan.offset_in_sequence, plan.piece_length, strict=True
    ):
        covered[sequence, offset : offset + length] += 1
    assert covered.max() == 1
    assert covered.sum() == lengths.sum()


def _assert_packed(plan: PackingPlan, packed: dict, ids, masks, seq_len: int) -> None:
    """Every piece's tokens and mask sit where the plan says, in order; the rest is padding."""
    real = np.zeros((plan.n_sequences, seq_len), dtype=bool)
    for piece in range(plan.piece_length.size):
        sequence, offset = plan.sequence_of_doc[piece], plan.offset_in_sequence[piece]
        start, length, doc = (
            plan.piece_start[piece],
            plan.piece_length[piece],
            plan.piece_doc[piece],
        )
        cells = slice(offset, offset + length)
        assert (
            packed["input_ids"][sequence, cells].tolist()
            == ids[doc][start : start + length].tolist()
        )
        assert (
            packed["loss_mask"][sequence, cells].tolist()
            == masks[doc][start : start + length].tolist()
        )
        assert packed["position_ids"][sequence, cells].tolist() == list(range(length))
        real[sequence, cells] = True
    assert (packed["input_ids"][~real] == PAD).all()
    assert (packed["loss_mask"][~real] == 0).all()
    every_token = np.sort(packed["input_ids"][real])
    assert every_token.tolist() == list(
        range(1, sum(len(doc) for doc in ids) + 1)
    )  # each exactly once


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize(("seed", "seq_len"), [(0, 16), (1, 16), (2, 64), (3, 7), (4, 1)])
def test_planner_invariants_hold_after_packing(planner, seed, seq_len):
    lengths = _edge_lengths(seed, 200, seq_len)
    plan = planner(lengths, seq_len)
    _assert_layout(plan, lengths, seq_len)
    ids, masks = _documents(lengths, seed)
    packed = pack(plan, ids, masks, seq_len, pad_id=PAD)
    assert (
        packed["input_ids"].shape == (plan.n_sequences, seq_len)
        and packed["input_ids"].dtype == np.int32
    )
    assert packed["loss_mask"].dtype == np.uint8 and packed["position_ids"].dtype == np.int32
    _assert_packed(plan, packed, ids, masks, seq_len)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_len", [8, 50, 512])
def test_best_fit_matches_the_definition(seed, seq_len):
    rng = np.random.default_rng(seed)
    short_and_long = [rng.integers(1, seq_len // 3 + 2, 150), rng.integers(1, 2 * seq_len, 60)]
    lengths = rng.permutation(np.concatenate(short_and_long))
    plan = plan_best_fit_decreasing(lengths, seq_len)
    sequence, offset, n_sequences = _reference_best_fit(lengths, seq_len)
    assert plan.n_sequences == n_sequences
    assert plan.sequence_of_doc.tolist() == sequence.tolist()
    assert plan.offset_in_sequence.tolist() == offset.tolist()


def test_small_examples_by_hand():
    lengths = np.array([3, 5, 2, 6])
    greedy = plan_greedy_sequential(lengths, 8)
    assert greedy.sequence_of_doc.tolist() == [0, 0, 1, 1]
    assert greedy.offset_in_sequence.tolist() == [0, 3, 0, 2]
    # Longest first: 6 -> new 0 (room 2), 5 -> new 1 (room 3), 3 -> 1 (least room that fits),
    # 2 -> 0.
    best_fit = plan_best_fit_decreasing(lengths, 8)
    assert best_fit.sequence_of_doc.tolist() == [1, 1, 0, 0]
    assert best_fit.offset_in_sequence.tolist() == [5, 0, 6, 0]
    assert best_fit.n_sequences == 2 and best_fit.efficiency(8) == 1.0
    # Ties on length go by document index: the three 4s fill sequences 0, 0, 1 in document order.
    ties = plan_best_fit_decreasing(np.array([4, 4, 4]), 8)
    assert ties.sequence_of_doc.tolist() == [0, 0, 1] and ties.offset_in_sequence.tolist() == [
        0,
        4,
        0,
    ]


@pytest.mark.parametrize("planner", PLANNERS)
def test_plans_are_deterministic(planner):
    lengths = _realistic_lengths(5000, seed=3)
    first, second = planner(lengths, 512), planner(lengths.copy(), 512)
    for name in (
        "sequence_of_doc",
        "offset_in_sequence",
        "piece_doc",
        "piece_start",
        "piece_length",
    ):
        assert np.array_equal(getattr(first, name), getattr(second, name))
        assert getattr(first, name).dtype == np.int64
    assert (first.n_sequences, first.split_documents) == (
        second.n_sequences,
        second.split_documents,
    )


def test_shuffle_is_a_seeded_permutation():
    order = shuffle_sequences(1000, seed=11)
    assert sorted(order.tolist()) == list(range(1000))
    assert np.array_equal(order, shuffle_sequences(1000, seed=11))
    assert not np.array_equal(order, shuffle_sequences(1000, seed=12))
    assert np.array_equal(order, np.random.default_rng(11).permutation(1000))


def test_best_fit_beats_greedy_on_realistic_lengths():
    lengths = _realistic_lengths(50_000)
    best_fit, greedy = plan_best_fit_decreasing(lengths, 512), plan_greedy_sequential(lengths, 512)
    print(
        f"efficiency: best-fit decreasing {best_fit.efficiency(512):.4f}, greedy "
        f"{greedy.efficiency(512):.4f}"
    )
    assert best_fit.efficiency(512) >= 0.995
    assert greedy.efficiency(512) <= best_fit.efficiency(512) - 0.05
    assert best_fit.n_sequences >= -(-int(lengths.sum()) // 512)  # never below the lower bound


def test_empty_input_gives_no_sequences():
    plan = plan_best_fit_decreasing(np.array([], dtype=np.int64), 16)
    assert plan.n_sequences == 0 and plan.efficiency(16) == 0.0
    packed = pack(plan, [], [], 16)
    assert packed["input_ids"].shape == (0, 16)
    assert packed["doc_lengths_offsets"].tolist() == [0]


def test_no_documents_pack_to_an_empty_typed_frame():
    """Evaluation packs the eval-set items, which a user may not have: none is zero rows, not an
    error (the record ids once came out as an object column polars cannot group)."""
    from pipeline_assets.lib.gold.sequences import pack_documents

    none = pl.DataFrame(
        schema={
            "record_id": pl.String,
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.Boolean),
        }
    )
    packed = pack_documents(none, 64, PAD)
    assert packed.height == 0 and packed.schema["record_ids"] == pl.List(pl.String)


# --- pack() -------------------------------------------------------------------------------------


def test_polars_list_input_packs_like_numpy_input():
    lengths = _edge_lengths(5, 100, 24)
    ids, masks = _documents(lengths)
    plan = plan_best_fit_decreasing(lengths, 24)
    from_numpy = pack(plan, ids, masks, 24, pad_id=PAD)
    from_polars = pack(
        plan, pl.Series(ids, dtype=pl.List(pl.Int64)), pl.Series(masks), 24, pad_id=PAD
    )
    for name, array in from_numpy.items():
        assert np.array_equal(array, from_polars[name]), name


def test_doc_lengths_describe_each_sequence_and_position_ids():
    lengths = np.array([3, 5, 2, 6, 9])
    plan = plan_best_fit_decreasing(lengths, 8)  # pieces 8+1 | 6 5 3 2 -> [8] [6,2] [5,3] [1]
    ids, masks = _documents(lengths)
    packed = pack(plan, ids, masks, 8, pad_id=PAD)
    assert packed["doc_lengths"].tolist() == [8, 6, 2, 5, 3, 1]
    assert packed["doc_lengths_offsets"].tolist() == [0, 1, 3, 5, 6]
    assert packed["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert packed["position_ids"][3].tolist() == [
        0,
        0,
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # padding is one more segment
    column = doc_lengths_column(packed)
    assert column.dtype == pl.List(pl.Int32)
    assert column.to_list() == [[8], [6, 2], [5, 3], [1]]
    frame = packed_frame(packed)
    assert frame.schema == pl.Schema(
        {
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.UInt8),
            "position_ids": pl.List(pl.Int32),
            "doc_lengths": pl.List(pl.Int32),
        }
    )
    assert frame["input_ids"].to_list()[3] == [int(ids[4][-1])] + [PAD] * 7


def test_doc_lengths_match_the_plan_on_random_lengths():
    lengths = _edge_lengths(9, 300, 40)
    plan = plan_best_fit_decreasing(lengths, 40)
    packed = pack(plan, *_documents(lengths), 40)
    column = doc_lengths_column(packed).to_list()
    for sequence, row in enumerate(column):
        in_sequence = plan.sequence_of_doc == sequence
        by_offset = np.argsort(plan.offset_in_sequence[in_sequence])
        assert row == plan.piece_length[in_sequence][by_offset].tolist()
        segment_starts = np.flatnonzero(packed["position_ids"][sequence] == 0)
        padding = 40 - sum(row)
        assert (
            segment_starts.tolist() == (np.cumsum([0, *row])[: len(row) + (padding > 0)]).tolist()
        )


def test_pack_rejects_inputs_that_do_not_match_the_plan():
    lengths = np.array([4, 6])
    plan = plan_best_fit_decreasing(lengths, 8)
    ids, masks = _documents(lengths)
    with pytest.raises(ValueError, match="differ in length"):
        pack(plan, ids, [masks[0], masks[1][:-1]], 8)
    with pytest.raises(ValueError, match="cover"):
        pack(plan, [ids[0], ids[1][:-1]], [masks[0], masks[1][:-1]], 8)
    with pytest.raises(ValueError, match="only 0 and 1"):
        pack(plan, ids, [masks[0], np.full(6, 2)], 8)
    with pytest.raises(ValueError, match="more than 4 tokens"):
        pack(plan, ids, masks, 4)


def test_pack_rejects_overlapping_pieces():
    lengths = np.array([4, 3])
    plan = plan_greedy_sequential(lengths, 8)
    overlapping = PackingPlan(
        sequence_of_doc=plan.sequence_of_doc,
        offset_in_sequence=np.array([0, 2]),
        piece_doc=plan.piece_doc,
        piece_start=plan.piece_start,
        piece_length=plan.piece_length,
        n_sequences=plan.n_sequences,
        split_documents=0,
    )
    with pytest.raises(ValueError, match="overlap"):
        pack(overlapping, *_documents(lengths), 8)


def _first_fit_by_definition(lengths: list[int], seq_len: int) -> int:
    rooms: list[int] = []
    for length in lengths:
        fit = next((i for i, room in enumerate(rooms) if room >= length), None)
        if fit is None:
            rooms.append(seq_len - length)
        else:
            rooms[fit] -= length
    return len(rooms)


@pytest.mark.parametrize("seed", range(30))
def test_first_fit_rows_match_the_definition(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(8, 300))
    lengths = rng.integers(1, seq_len + 1, size=int(rng.integers(0, 400)))
    assert first_fit_rows(lengths, seq_len) == _first_fit_by_definition(lengths.tolist(), seq_len)


def test_packing_floor_of_uniform_short_documents():
    """1,000 answers of about 75 tokens in rows of 512: no packing reaches 0.98, and best-fit
    decreasing needs no more rows than first-fit; the lower bound is the tokens alone."""
    lengths = np.random.default_rng(0).integers(70, 81, size=1000)
    plan = plan_best_fit_decreasing(lengths, 512)
    floor = packing_floor(plan.piece_length, 512)
    assert floor.lower_bound_rows == -(-int(lengths.sum()) // 512)
    assert floor.lower_bound_rows <= plan.n_sequences <= floor.first_fit_rows
    assert plan.efficiency(512) < 0.98
    one_per_row = packing_floor(lengths, 512)
    assert (
        1000 > one_per_row.first_fit_rows
    )  # a broken packer that puts each answer in its own row exceeds the floor
