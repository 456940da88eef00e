"""A data snapshot's sequences (its manifest's gold shards), read a block at a time, and the
per-rank batches of a resumable stream.

The global order is a stream: epoch e visits the training sequences block by block (blocks of
STREAM_BLOCK consecutive ``sequence_index`` values, in an order seeded with (seed, e)), each block's
sequences in an order seeded with (seed, e, block). Gold already shuffles the sequences it packs, so
a block holds a random sample of the split. A position in the stream (sequences consumed) is the
whole loader state: resuming at position p, from any world size, continues the same order.

A rank holds at most CACHED_BLOCKS blocks of a split in memory, whatever the snapshot's size: the
ranks of one step read the same block (its row groups; Parquet reads no less) and keep the rows
they were dealt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from pipeline_assets.lib.gold import SEQUENCES_PER_BLOCK
from pipeline_assets.lib.snapshot_manifest import Manifest, SplitLayout, read_manifest, sequences_scan

COLUMNS = ("input_ids", "loss_mask", "position_ids")
STREAM_BLOCK = SEQUENCES_PER_BLOCK  # the unit of the stream's shuffle and of reading: gold's row groups
CACHED_BLOCKS = 4


@dataclass(frozen=True)
class PackedSequences:
    input_ids: np.ndarray  # (N, T) int32
    loss_mask: np.ndarray  # (N, T) bool
    position_ids: np.ndarray  # (N, T) int32

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.size)

    def batch(self, indexes: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(self.input_ids[indexes].astype(np.int64)).to(device),
            "loss_mask": torch.from_numpy(self.loss_mask[indexes]).to(device),
            "position_ids": torch.from_numpy(self.position_ids[indexes].astype(np.int64)).to(device),
        }


class SplitRows:
    """One split of a snapshot, global ``sequence_index`` 0..n-1 over its shards, read from Delta a
    block at a time (the most recently used CACHED_BLOCKS blocks kept)."""

    def __init__(self, scan: pl.LazyFrame, layout: SplitLayout, seq_len: int, describe: str,
                 vocab_size: int | None = None, block: int = STREAM_BLOCK, cached_blocks: int = CACHED_BLOCKS):
        self._scan, self.layout, self.split, self.seq_len = scan, layout, layout.split, seq_len
        self.n_sequences = layout.n_sequences
        self._describe, self.vocab_size, self.block, self.cached_blocks = describe, vocab_size, block, cached_blocks
        self._cache: OrderedDict[int, PackedSequences] = OrderedDict()
        self.blocks_read = 0

    def __len__(self) -> int:
        return self.n_sequences

    @property
    def cached_sequences(self) -> int:
        return sum(len(block) for block in self._cache.values())

    def batch(self, indexes: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        """The rows at these positions (sequence_index values), in this order, as tensors."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if indexes.size and (indexes.min() < 0 or indexes.max() >= self.n_sequences):
            raise IndexError(f"{self.split} has {self.n_sequences} sequences, asked for {indexes.min()}..{indexes.max()}")
        parts = {name: np.empty((indexes.size, self.seq_len), dtype=bool if name == "loss_mask" else np.int32) for name in COLUMNS}
        blocks, offsets = np.divmod(indexes, self.block)
        for number in np.unique(blocks):
            chosen = blocks == number
            rows = self._block(int(number))
            for name in COLUMNS:
                parts[name][chosen] = getattr(rows, name)[offsets[chosen]]
        return PackedSequences(**parts).batch(np.arange(indexes.size), device)

    def _block(self, number: int) -> PackedSequences:
        if number in self._cache:
            self._cache.move_to_end(number)
            return self._cache[number]
        first = number * self.block
        wanted = np.arange(first, min(first + self.block, self.n_sequences))
        try:
            frame = self.layout.take(self._scan, wanted, list(COLUMNS))
        except ValueError as exc:
            raise ValueError(f"{self._describe}: {exc}") from None
        lengths = frame["input_ids"].list.len()
        if lengths.min() != self.seq_len or lengths.max() != self.seq_len:
            raise ValueError(f"{self._describe} {self.split} sequences {first}..{wanted[-1]}: expected rows of {self.seq_len} "
                             f"tokens, found {lengths.min()}..{lengths.max()} (shards packed to other sequence lengths)")
        rows = PackedSequences(**{name: frame[name].list.to_array(self.seq_len).to_numpy() for name in COLUMNS})
        largest = int(rows.input_ids.max(initial=0))
        if self.vocab_size is not None and largest >= self.vocab_size:
            raise ValueError(f"{self._describe} holds token id {largest}, beyond --vocab-size {self.vocab_size}: "
                             "pass the tokenizer's vocabulary size")
        self._cache[number] = rows
        self.blocks_read += 1
        while len(self._cache) > self.cached_blocks:
            self._cache.popitem(last=False)
        return rows


@dataclass(frozen=True)
class Snapshot:
    train: SplitRows
    validation: SplitRows
    search: SplitRows
    seq_len: int
    manifest: Manifest

    def held_out(self, split: str) -> SplitRows:
        """The held-out split a loss is measured on: validation (the promotion gate's rows) or search."""
        return {"validation": self.validation, "search": self.search}[split]


def read_snapshot(lake_uri: str, number: int, vocab_size: int | None = None,
                  block: int = STREAM_BLOCK, cached_blocks: int = CACHED_BLOCKS) -> Snapshot:
    """Data snapshot gold-v<number>: its manifest's shards of gold/sequences, exactly as the pinned
    Delta version holds them, each split in global sequence_index order; only the manifest is read
    here, the rows when a batch asks for them (a block with a token id beyond ``vocab_size`` is an error)."""
    manifest = read_manifest(lake_uri, number)
    if not any(manifest.sequences_by_split().values()):
        raise ValueError(f"{manifest.key} has no sequences")
    scan = sequences_scan(lake_uri, manifest)
    describe = f"{manifest.key} (gold/sequences v{manifest.sequences_version})"
    parts = {split: SplitRows(scan, manifest.split(split), manifest.seq_len, describe, vocab_size, block, cached_blocks)
             for split in ("train", "validation", "search")}
    return Snapshot(**parts, seq_len=manifest.seq_len, manifest=manifest)


def stream_indexes(n_sequences: int, seed: int, start: int, count: int, block: int = STREAM_BLOCK) -> np.ndarray:
    """Positions [start, start + count) of the stream, as sequence indexes."""
    if n_sequences == 0:
        raise ValueError("the snapshot has no training sequences")
    positions = np.arange(start, start + count)
    epochs, offsets = np.divmod(positions, n_sequences)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        out[chosen] = _epoch_order(n_sequences, seed, int(epoch), block, offsets[chosen])
    return out


def _epoch_order(n_sequences: int, seed: int, epoch: int, block: int, offsets: np.ndarray) -> np.ndarray:
    """The sequence at each offset of one epoch: blocks in a seeded order, each block's own
    sequences in a seeded order."""
    n_blocks = -(-n_sequences // block)
    block_order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    sizes = np.minimum(block, n_sequences - block_order * block)
    starts = np.cumsum(sizes) - sizes  # where each visited block begins in the epoch
    visit = np.searchsorted(starts, offsets, side="right") - 1
    out = np.empty(offsets.size, dtype=np.int64)
    for k in np.unique(visit):
        chosen = visit == k
        number = int(block_order[k])
        within = np.random.default_rng([seed, epoch, number]).permutation(int(sizes[k]))
        out[chosen] = number * block + within[offsets[chosen] - starts[k]]
    return out


def rank_micro_batches(n_sequences: int, seed: int, position: int, rank: int, world_size: int,
                       micro_batch_size: int, grad_accum_steps: int) -> list[np.ndarray]:
    """This rank's micro-batches of the global batch starting at ``position``: disjoint across ranks."""
    per_rank = micro_batch_size * grad_accum_steps
    mine = stream_indexes(n_sequences, seed, position + rank * per_rank, per_rank)
    return np.split(mine, grad_accum_steps)


def validation_shard(n_sequences: int, limit: int, rank: int, world_size: int) -> np.ndarray:
    """The first ``limit`` validation sequences, dealt to ranks round-robin."""
    return np.arange(min(n_sequences, limit))[rank::world_size]
