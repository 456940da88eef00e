"""The trainer's data in-process: the resumable stream, per-rank batches, validation shards, pinned
snapshots."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.manifest import read_manifest
from pipeline_assets.trainer.data import (
    PackedSequences,
    Snapshot,
    SplitRows,
    rank_micro_batches,
    read_snapshot,
    stream_indexes,
    validation_shard,
)
from pipeline_assets_tests.trainer.synthetic import write_synthetic_gold

SEQ_LEN = 32
N = 37


def test_stream_is_deterministic_for_a_seed():
    assert np.array_equal(stream_indexes(N, 7, 5, 100), stream_indexes(N, 7, 5, 100))


def test_each_epoch_of_the_stream_is_a_permutation():
    for epoch in range(3):
        assert np.array_equal(np.sort(stream_indexes(N, 7, epoch * N, N)), np.arange(N))


def test_epochs_are_shuffled_differently():
    epochs = [stream_indexes(N, 7, epoch * N, N) for epoch in range(3)]

    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])


def test_different_seeds_give_different_streams():
    assert not np.array_equal(stream_indexes(N, 7, 0, N), stream_indexes(N, 8, 0, N))


@pytest.mark.parametrize("split_at", [1, 7, 23, 99])
def test_stream_read_in_two_pieces_equals_one_read(split_at):
    start, count = 30, 100
    whole = stream_indexes(N, 7, start, count)
    pieces = np.concatenate(
        [
            stream_indexes(N, 7, start, split_at),
            stream_indexes(N, 7, start + split_at, count - split_at),
        ]
    )

    assert np.array_equal(pieces, whole)


def test_stream_of_no_sequences_is_an_error():
    with pytest.raises(ValueError, match="no training sequences"):
        stream_indexes(0, 7, 0, 4)


@pytest.mark.parametrize(
    "world_size, micro_batch_size, grad_accum_steps", [(1, 4, 3), (2, 2, 3), (4, 1, 3), (4, 3, 1)]
)
@pytest.mark.parametrize("position", [0, 30, 111])
def test_ranks_together_read_the_global_batch_in_stream_order(
    world_size, micro_batch_size, grad_accum_steps, position
):
    global_batch = micro_batch_size * grad_accum_steps * world_size
    assert global_batch == 12

    per_rank = [
        rank_micro_batches(N, 7, position, rank, world_size, micro_batch_size, grad_accum_steps)
        for rank in range(world_size)
    ]

    assert all(len(batches) == grad_accum_steps for batches in per_rank)
    assert all(len(batch) == micro_batch_size for batches in per_rank for batch in batches)
    concatenated = np.concatenate([batch for batches in per_rank for batch in batches])
    assert np.array_equal(concatenated, stream_indexes(N, 7, position, global_batch))


@pytest.mark.parametrize("block", [4, 10, 37, 4096])
def test_the_stream_visits_one_block_at_a_time(block):
    epoch = stream_indexes(N, 7, 0, N, block=block)
    assert np.array_equal(np.sort(epoch), np.arange(N))
    visited = epoch // block
    assert (np.diff(visited) != 0).sum() == -(-N // block) - 1, (
        "each block's sequences are consecutive in the stream"
    )
    again = stream_indexes(N, 7, N, N, block=block)
    assert np.array_equal(np.sort(again), np.arange(N)) and (
        N <= block or not np.array_equal(again // block, visited)
    )


def test_ranks_read_distinct_sequences_within_an_epoch():
    batches = [rank_micro_batches(N, 7, 0, rank, 4, 2, 2) for rank in range(4)]
    ranks = [set(np.concatenate(b).tolist()) for b in batches]

    assert sum(len(r) for r in ranks) == len(set().union(*ranks)) == 16


@pytest.mark.parametrize(
    "n_sequences, limit, world_size", [(10, 7, 3), (5, 100, 2), (9, 9, 4), (2, 10, 4)]
)
def test_validation_shards_are_disjoint_and_cover_the_first_limit(n_sequences, limit, world_size):
    shards = [validation_shard(n_sequences, limit, rank, world_size) for rank in range(world_size)]
    together = np.concatenate(shards)

    assert len(together) == len(set(together.tolist()))
    assert np.array_equal(np.sort(together), np.arange(min(n_sequences, limit)))
    assert all(np.all(shard % world_size == rank) for rank, shard in enumerate(shards))


@pytest.fixture(scope="module")
def lake_uri(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("data") / "lake")
    assert write_synthetic_gold(uri, n_records=200, seq_len=SEQ_LEN, seed=0, shards=3) == 0
    assert write_synthetic_gold(uri, n_records=200, seq_len=SEQ_LEN, seed=1, shards=3) == 1
    return uri


def _snapshot_rows(lake_uri: str, number: int) -> pl.DataFrame:
    """The snapshot's rows as Delta holds them at its manifest's version."""
    manifest = read_manifest(lake_uri, number)
    return pl.read_delta(
        uris.join(lake_uri, "gold", "sequences"), version=manifest.sequences_version
    )


def _delta_rows(lake_uri: str, number: int, split: str) -> pl.DataFrame:
    """A split in its defined global order: the shards in batch order, each in its own
    sequence_index order."""
    return (
        _snapshot_rows(lake_uri, number)
        .filter(pl.col("split") == split)
        .sort("batch_id", "sequence_index")
    )


def _as_array(frame: pl.DataFrame, column: str, dtype) -> np.ndarray:
    return np.array(frame[column].to_list(), dtype=dtype)


def _all_rows(rows: SplitRows) -> dict[str, np.ndarray]:
    return {
        name: tensor.numpy()
        for name, tensor in rows.batch(np.arange(len(rows)), torch.device("cpu")).items()
    }


@pytest.mark.parametrize("split", ["train", "validation", "search"])
def test_read_snapshot_returns_the_pinned_versions_rows_in_order(lake_uri, split):
    rows: SplitRows = getattr(read_snapshot(lake_uri, 0, block=16), split)
    expected = _delta_rows(lake_uri, 0, split)

    assert len(rows) == expected.height > 0
    assert expected["batch_id"].n_unique() == 3, "the split's rows come from three shards"
    got = _all_rows(rows)
    assert np.array_equal(got["input_ids"], _as_array(expected, "input_ids", np.int64))
    assert np.array_equal(got["loss_mask"], _as_array(expected, "loss_mask", bool))
    assert np.array_equal(got["position_ids"], _as_array(expected, "position_ids", np.int64))


def test_read_snapshot_batches_have_the_sequence_shape_and_dtypes(lake_uri):
    snapshot = read_snapshot(lake_uri, 0)

    assert isinstance(snapshot, Snapshot)
    assert snapshot.seq_len == SEQ_LEN
    for rows in (snapshot.train, snapshot.validation, snapshot.search):
        batch = rows.batch(np.array([len(rows) - 1, 0]), torch.device("cpu"))
        assert all(tensor.shape == (2, SEQ_LEN) for tensor in batch.values())
        assert batch["input_ids"].dtype == batch["position_ids"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.bool


def test_read_snapshot_splits_every_row_into_train_validation_or_search(lake_uri):
    snapshot = read_snapshot(lake_uri, 0)
    rows = _snapshot_rows(lake_uri, 0)

    assert len(snapshot.train) == rows.filter(pl.col("split") == "train").height
    assert len(snapshot.validation) == rows.filter(pl.col("split") == "validation").height
    assert len(snapshot.search) == rows.filter(pl.col("split") == "search").height
    assert len(snapshot.train) + len(snapshot.validation) + len(snapshot.search) == rows.height
    assert len(snapshot.train) > len(snapshot.validation)


def test_read_snapshot_at_another_version_differs(lake_uri):
    first, second = read_snapshot(lake_uri, 0), read_snapshot(lake_uri, 1)
    expected = _delta_rows(lake_uri, 1, "train")

    assert np.array_equal(
        _all_rows(second.train)["input_ids"], _as_array(expected, "input_ids", np.int64)
    )
    assert len(first.train) != len(second.train) or not np.array_equal(
        _all_rows(first.train)["input_ids"], _all_rows(second.train)["input_ids"]
    )


def test_a_rank_holds_a_bounded_number_of_blocks_over_a_whole_epoch(lake_uri):
    train = read_snapshot(lake_uri, 0, block=8, cached_blocks=2).train
    blocks = -(-len(train) // 8)
    assert blocks > 4
    expected = _all_rows(read_snapshot(lake_uri, 0).train)["input_ids"]
    for start in range(0, len(train), 6):  # the first epoch, six sequences a step
        indexes = stream_indexes(len(train), 7, start, min(6, len(train) - start), block=8)
        assert np.array_equal(
            train.batch(indexes, torch.device("cpu"))["input_ids"].numpy(), expected[indexes]
        )
        assert train.cached_sequences <= 2 * 8
    assert train.blocks_read <= 2 * blocks, (
        "a step's rows come from one or two blocks: each is read about once per epoch"
    )


def test_a_token_beyond_the_vocabulary_is_an_error_when_its_block_is_read(lake_uri):
    snapshot = read_snapshot(lake_uri, 0, vocab_size=3)
    with pytest.raises(ValueError, match="beyond --vocab-size 3"):
        snapshot.train.batch(np.array([0]), torch.device("cpu"))


def test_batch_returns_the_requested_rows_as_tensors():
    rng = np.random.default_rng(0)
    packed = PackedSequences(
        input_ids=rng.integers(0, 64, (5, 8)).astype(np.int32),
        loss_mask=rng.random((5, 8)) < 0.5,
        position_ids=np.tile(np.arange(8, dtype=np.int32), (5, 1)),
    )
    rows = np.array([3, 0, 3])

    batch = packed.batch(rows, torch.device("cpu"))

    assert batch["input_ids"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.bool
    assert all(tensor.shape == (3, 8) for tensor in batch.values())
    assert np.array_equal(batch["input_ids"].numpy(), packed.input_ids[rows])
    assert np.array_equal(batch["loss_mask"].numpy(), packed.loss_mask[rows])
    assert np.array_equal(batch["position_ids"].numpy(), packed.position_ids[rows])
