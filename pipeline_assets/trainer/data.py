"""Gold sequences at a pinned Delta version, and the per-rank batches of a resumable stream.

The global order is a stream: epoch e is a permutation of the training sequences seeded with
(seed, e), and the stream is the epochs end to end. A position in the stream (sequences consumed)
is the whole loader state: resuming at position p, from any world size, continues the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold import in_snapshot_order

COLUMNS = ("input_ids", "loss_mask", "position_ids")


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


@dataclass(frozen=True)
class Snapshot:
    train: PackedSequences
    validation: PackedSequences
    search: PackedSequences
    seq_len: int

    def held_out(self, split: str) -> PackedSequences:
        """The held-out split a loss is measured on: validation (the promotion gate's rows) or search."""
        return {"validation": self.validation, "search": self.search}[split]


def sequences_table_uri(lake_uri: str) -> str:
    return uris.join(lake_uri, "gold", "sequences")


def read_snapshot(lake_uri: str, version: int) -> Snapshot:
    """gold/sequences exactly as Delta version ``version`` holds it, in (split, sequence_index) order."""
    scan = pl.scan_delta(sequences_table_uri(lake_uri), version=version, storage_options=uris.delta_storage_options(lake_uri))
    frame = in_snapshot_order(scan, COLUMNS)
    if frame.is_empty():
        raise ValueError(f"gold/sequences v{version} has no rows")
    seq_len = int(frame["input_ids"].list.len().max())
    if frame["input_ids"].list.len().min() != seq_len:
        raise ValueError(f"gold/sequences v{version} mixes sequence lengths")
    return Snapshot(train=_packed(frame, "train", seq_len), validation=_packed(frame, "validation", seq_len),
                    search=_packed(frame, "search", seq_len), seq_len=seq_len)


def _packed(frame: pl.DataFrame, split: str, seq_len: int) -> PackedSequences:
    part = frame.filter(pl.col("split") == split)
    arrays = {name: part[name].list.to_array(seq_len).to_numpy() for name in COLUMNS}
    if part.is_empty():
        arrays = {name: np.zeros((0, seq_len), dtype=bool if name == "loss_mask" else np.int32) for name in COLUMNS}
    return PackedSequences(**arrays)


def stream_indexes(n_sequences: int, seed: int, start: int, count: int) -> np.ndarray:
    """Positions [start, start + count) of the stream, as sequence indexes."""
    if n_sequences == 0:
        raise ValueError("the snapshot has no training sequences")
    positions = np.arange(start, start + count)
    epochs, offsets = np.divmod(positions, n_sequences)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(n_sequences)
        chosen = epochs == epoch
        out[chosen] = order[offsets[chosen]]
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
