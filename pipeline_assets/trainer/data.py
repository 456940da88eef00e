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

A preference snapshot (dpo-v<N>) is read the same way, stream and cache included: each block of its
rows comes with the reference model's log-probability of every document, taken from
gold/reference_logps (at a pinned Delta version) with the same ``SplitLayout.take``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import polars as pl
import torch

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.manifest import (
    PREFERENCE_SNAPSHOTS,
    Manifest,
    SplitLayout,
    read_manifest,
    sequences_scan,
)
from pipeline_assets.lib.gold.sequences import SEQUENCES_PER_BLOCK
from pipeline_assets.lib.gold.splits import SPLITS

COLUMNS = ("input_ids", "loss_mask", "position_ids")
STREAM_BLOCK = (
    SEQUENCES_PER_BLOCK  # the unit of the stream's shuffle and of reading: gold's row groups
)
CACHED_BLOCKS = 4
REFERENCE_TABLE = ("gold", "reference_logps")
LOGPS_COLUMN = (
    "reference_logps"  # per row, one value per document in row order (trainer.reference writes it)
)


class Rows(Protocol):
    """What a block of a split holds: rows that can be picked, joined and turned into a batch."""

    def __len__(self) -> int: ...

    def take(self, rows: np.ndarray) -> Rows: ...

    @staticmethod
    def concat(parts: list) -> Rows: ...

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]: ...


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

    def take(self, rows: np.ndarray) -> PackedSequences:
        return PackedSequences(*(getattr(self, name)[rows] for name in COLUMNS))

    @staticmethod
    def concat(parts: list[PackedSequences]) -> PackedSequences:
        return PackedSequences(
            *(np.concatenate([getattr(part, name) for part in parts]) for name in COLUMNS)
        )

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)).to(device),
            "loss_mask": torch.from_numpy(self.loss_mask).to(device),
            "position_ids": torch.from_numpy(self.position_ids.astype(np.int64)).to(device),
        }

    def batch(self, indexes: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        return self.take(indexes).tensors(device)


@dataclass(frozen=True)
class PreferenceRows:
    """Packed preference rows and the reference model's log-probability of each of their
    documents."""

    sequences: PackedSequences
    reference_logps: (
        np.ndarray
    )  # (documents,) float64: row 0's documents in row order, then row 1's, ...
    documents: np.ndarray  # (N,) int64: documents per row

    def __len__(self) -> int:
        return len(self.sequences)

    def take(self, rows: np.ndarray) -> PreferenceRows:
        starts = np.cumsum(self.documents) - self.documents
        counts = self.documents[rows]
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        logps = self.reference_logps[np.repeat(starts[rows], counts) + within]
        return PreferenceRows(self.sequences.take(rows), logps, counts)

    @staticmethod
    def concat(parts: list[PreferenceRows]) -> PreferenceRows:
        return PreferenceRows(
            PackedSequences.concat([part.sequences for part in parts]),
            np.concatenate([part.reference_logps for part in parts]),
            np.concatenate([part.documents for part in parts]),
        )

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The sequences' tensors and ``reference_logps``: (documents,) float64, in
        ``document_logps`` order."""
        return {
            **self.sequences.tensors(device),
            "reference_logps": torch.from_numpy(self.reference_logps).to(device),
        }


class SplitRows:
    """One split of a snapshot, global ``sequence_index`` 0..n-1 over its shards, read a block at a
    time by ``read`` (global indexes -> their rows), the most recently used CACHED_BLOCKS blocks
    kept."""

    def __init__(
        self,
        read: Callable[[np.ndarray], Rows],
        n_sequences: int,
        split: str,
        block: int = STREAM_BLOCK,
        cached_blocks: int = CACHED_BLOCKS,
    ):
        self._read, self.n_sequences, self.split = read, n_sequences, split
        self.block, self.cached_blocks = block, cached_blocks
        self._cache: OrderedDict[int, Rows] = OrderedDict()
        self.blocks_read = 0

    def __len__(self) -> int:
        return self.n_sequences

    @property
    def cached_sequences(self) -> int:
        return sum(len(block) for block in self._cache.values())

    def batch(self, indexes: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        """The rows at these positions (sequence_index values), in this order, as tensors."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if not indexes.size:
            return self._read(indexes).tensors(device)
        if indexes.min() < 0 or indexes.max() >= self.n_sequences:
            raise IndexError(
                f"{self.split} has {self.n_sequences} sequences, "
                f"asked for {indexes.min()}..{indexes.max()}"
            )
        blocks, offsets = np.divmod(indexes, self.block)
        numbers = np.unique(blocks)
        parts = [self._block(int(number)).take(offsets[blocks == number]) for number in numbers]
        gathered = parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)
        gathered_from = np.concatenate([np.flatnonzero(blocks == number) for number in numbers])
        return gathered.take(np.argsort(gathered_from)).tensors(device)

    def _block(self, number: int) -> Rows:
        if number in self._cache:
            self._cache.move_to_end(number)
            return self._cache[number]
        first = number * self.block
        rows = self._read(np.arange(first, min(first + self.block, self.n_sequences)))
        self._cache[number] = rows
        self.blocks_read += 1
        while len(self._cache) > self.cached_blocks:
            self._cache.popitem(last=False)
        return rows


@dataclass(frozen=True)
class SequenceReader:
    """Reads the packed rows of one split at given global indexes from the snapshot's shards."""

    scan: pl.LazyFrame  # the shard table at the manifest's version, only its shards
    layout: SplitLayout
    seq_len: int
    describe: str
    vocab_size: int | None = None

    def __call__(self, indexes: np.ndarray) -> PackedSequences:
        return self.sequences(self.frame(indexes))

    def frame(self, indexes: np.ndarray, extra: tuple[str, ...] = ()) -> pl.DataFrame:
        try:
            return self.layout.take(self.scan, indexes, [*COLUMNS, *extra])
        except ValueError as exc:
            raise ValueError(f"{self.describe}: {exc}") from None

    def sequences(self, frame: pl.DataFrame) -> PackedSequences:
        """The frame's rows as arrays; a ValueError for rows of another length or a token beyond the
        vocabulary."""
        lengths = frame["input_ids"].list.len()
        if frame.height and (lengths.min() != self.seq_len or lengths.max() != self.seq_len):
            where = f"{frame['sequence_index'][0]}..{frame['sequence_index'][-1]}"
            raise ValueError(
                f"{self.describe} {self.layout.split} sequences {where}: expected rows of "
                f"{self.seq_len} tokens, found {lengths.min()}..{lengths.max()} "
                "(shards packed to other sequence lengths)"
            )
        rows = PackedSequences(
            **{name: frame[name].list.to_array(self.seq_len).to_numpy() for name in COLUMNS}
        )
        largest = int(rows.input_ids.max(initial=0))
        if self.vocab_size is not None and largest >= self.vocab_size:
            raise ValueError(
                f"{self.describe} holds token id {largest}, beyond --vocab-size {self.vocab_size}: "
                "pass the tokenizer's vocabulary size"
            )
        return rows


@dataclass(frozen=True)
class ReferenceLogps:
    """gold/reference_logps at a pinned Delta version, only one preference snapshot's rows."""

    uri: str
    version: int
    snapshot: str
    model: str  # the reference model that scored them, e.g. "sft-model/3"
    scan: pl.LazyFrame

    @property
    def describe(self) -> str:
        return f"gold/reference_logps v{self.version} ({self.snapshot})"


@dataclass(frozen=True)
class PreferenceReader:
    """Reads preference rows with their reference log-probabilities: both with the same
    ``SplitLayout.take``."""

    sequences: SequenceReader
    reference: ReferenceLogps

    def __call__(self, indexes: np.ndarray) -> PreferenceRows:
        frame = self.sequences.frame(indexes, ("document_lengths",))
        logps = self._reference_frame(indexes)[LOGPS_COLUMN]
        documents = frame["document_lengths"].list.len().cast(pl.Int64).to_numpy()
        scored = logps.list.len().fill_null(-1).cast(pl.Int64).to_numpy()  # -1: no list at all
        mismatched = np.flatnonzero(scored != documents)
        if mismatched.size:
            bad = int(mismatched[0])
            raise ValueError(
                f"{self.reference.describe}: {self.sequences.layout.split} sequence {indexes[bad]} "
                f"has {documents[bad]} documents but {max(scored[bad], 0)} reference "
                "log-probabilities: redo the reference pass for this snapshot"
            )
        values = logps.explode()
        if values.null_count():
            raise ValueError(
                f"{self.reference.describe}: a null reference log-probability in "
                f"{self.sequences.layout.split} sequences {indexes[0]}..{indexes[-1]}"
            )
        return PreferenceRows(
            self.sequences.sequences(frame), values.to_numpy().astype(np.float64), documents
        )

    def _reference_frame(self, indexes: np.ndarray) -> pl.DataFrame:
        try:
            return self.sequences.layout.take(self.reference.scan, indexes, [LOGPS_COLUMN])
        except ValueError as exc:
            raise ValueError(
                f"{self.reference.describe} lacks reference log-probabilities of rows it should "
                f"hold ({exc}): redo the reference pass for this snapshot"
            ) from None


@dataclass(frozen=True)
class Snapshot:
    train: SplitRows
    validation: SplitRows
    search: SplitRows
    seq_len: int
    manifest: Manifest
    reference: ReferenceLogps | None = None  # a preference snapshot's reference log-probabilities

    def held_out(self, split: str) -> SplitRows:
        """The held-out split a loss is measured on: validation (the promotion gate's rows) or
        search."""
        return {"validation": self.validation, "search": self.search}[split]

    def about(self) -> dict:
        """What names the data a run trained on (tags, the export's config, the run's metadata)."""
        about = {"data_snapshot": self.manifest.key}
        if self.reference:
            about |= {
                "reference_model": self.reference.model,
                "reference_logps_version": self.reference.version,
            }
        return about

    def inputs(self, lake_uri: str) -> list[tuple[str, int, str]]:
        """(table URI, Delta version, description) of every table the run reads rows from."""
        kind, manifest = self.manifest.kind, self.manifest
        shards = (
            f"{kind.sequences_name}@v{manifest.sequences_version}, {len(manifest.batches)} shard(s)"
        )
        inputs = [
            (
                uris.join(lake_uri, *kind.sequences_table),
                manifest.sequences_version,
                f"{manifest.key}: {shards}",
            )
        ]
        if self.reference:
            inputs.append(
                (
                    self.reference.uri,
                    self.reference.version,
                    f"{manifest.key}: gold/reference_logps@v{self.reference.version} "
                    f"({self.reference.model})",
                )
            )
        return inputs


def read_snapshot(
    lake_uri: str,
    number: int,
    vocab_size: int | None = None,
    block: int = STREAM_BLOCK,
    cached_blocks: int = CACHED_BLOCKS,
) -> Snapshot:
    """Data snapshot gold-v<number>: its manifest's shards of gold/sequences, exactly as the pinned
    Delta version holds them, each split in global sequence_index order; only the manifest is read
    here, the rows when a batch asks for them (a block with a token id beyond ``vocab_size`` is an
    error)."""
    manifest = _with_sequences(read_manifest(lake_uri, number))
    readers = _sequence_readers(lake_uri, manifest, vocab_size)
    parts = {
        split: SplitRows(
            readers[split], readers[split].layout.n_sequences, split, block, cached_blocks
        )
        for split in SPLITS
    }
    return Snapshot(**parts, seq_len=manifest.seq_len, manifest=manifest)


def read_preference_snapshot(
    lake_uri: str,
    number: int,
    reference_version: int,
    vocab_size: int | None = None,
    block: int = STREAM_BLOCK,
    cached_blocks: int = CACHED_BLOCKS,
) -> Snapshot:
    """Preference snapshot dpo-v<number>, read as ``read_snapshot`` reads gold-v<N>; every row comes
    with its reference log-probabilities from gold/reference_logps at ``reference_version``. Fails
    here when that version does not hold one reference model's values for every row of the snapshot,
    and when a block is read if a row's values are missing or not one per document."""
    manifest = _with_sequences(read_manifest(lake_uri, number, PREFERENCE_SNAPSHOTS))
    reference = open_reference_logps(lake_uri, reference_version, manifest)
    readers = _sequence_readers(lake_uri, manifest, vocab_size)
    parts = {
        split: SplitRows(
            PreferenceReader(readers[split], reference),
            readers[split].layout.n_sequences,
            split,
            block,
            cached_blocks,
        )
        for split in SPLITS
    }
    return Snapshot(**parts, seq_len=manifest.seq_len, manifest=manifest, reference=reference)


def open_reference_logps(lake_uri: str, version: int, manifest: Manifest) -> ReferenceLogps:
    """gold/reference_logps at ``version``, filtered to the snapshot; a ValueError unless it holds
    one reference model's rows, as many per split as the manifest lists (only small columns are
    read)."""
    uri = uris.join(lake_uri, *REFERENCE_TABLE)
    try:
        table = pl.scan_delta(
            uri, version=version, storage_options=uris.delta_storage_options(lake_uri)
        )
        scan = table.filter(pl.col("snapshot") == manifest.key)
        counts = scan.group_by("reference_model", "split").agg(rows=pl.len()).collect()
    except (
        Exception
    ) as exc:  # no table, or no such version: deltalake and polars raise their own types
        raise ValueError(f"cannot read {uri} at version {version} ({exc})") from exc
    described = f"gold/reference_logps v{version}"
    models = sorted(counts["reference_model"].unique())
    if len(models) != 1:
        found = (
            f"those of {len(models)} reference models ({', '.join(models)})" if models else "none"
        )
        raise ValueError(
            f"{described} should hold one reference model's log-probabilities of {manifest.key}, "
            f"found {found}: run the reference pass for it"
        )
    held = dict(counts.select("split", "rows").iter_rows())
    expected = manifest.sequences_by_split()
    wrong = {
        split: (held.get(split, 0), n) for split, n in expected.items() if held.get(split, 0) != n
    }
    if wrong:
        listed = ", ".join(
            f"{split}: {have} rows for {n} sequences" for split, (have, n) in wrong.items()
        )
        raise ValueError(
            f"{described} does not hold a row per sequence of {manifest.key} ({listed}): "
            "run the reference pass for it"
        )
    return ReferenceLogps(uri, version, manifest.key, models[0], scan)


def _with_sequences(manifest: Manifest) -> Manifest:
    if not any(manifest.sequences_by_split().values()):
        raise ValueError(f"{manifest.key} has no sequences")
    return manifest


def _sequence_readers(
    lake_uri: str, manifest: Manifest, vocab_size: int | None
) -> dict[str, SequenceReader]:
    scan = sequences_scan(lake_uri, manifest)
    describe = f"{manifest.key} ({manifest.kind.sequences_name} v{manifest.sequences_version})"
    return {
        split: SequenceReader(scan, manifest.split(split), manifest.seq_len, describe, vocab_size)
        for split in SPLITS
    }


def largest_token_id(lake_uri: str, manifest: Manifest) -> int:
    """The largest token id in the snapshot's shards (every split), read from its input_ids column
    alone: what the model's embedding must have rows for, known before training starts."""
    largest = (
        sequences_scan(lake_uri, manifest)
        .select(pl.col("input_ids").list.max().max())
        .collect()
        .item()
    )
    return -1 if largest is None else int(largest)


def stream_indexes(
    n_sequences: int, seed: int, start: int, count: int, block: int = STREAM_BLOCK
) -> np.ndarray:
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


def _epoch_order(
    n_sequences: int, seed: int, epoch: int, block: int, offsets: np.ndarray
) -> np.ndarray:
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


def rank_micro_batches(
    n_sequences: int,
    seed: int,
    position: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    grad_accum_steps: int,
) -> list[np.ndarray]:
    """This rank's micro-batches of the global batch starting at ``position``: disjoint across
    ranks."""
    per_rank = micro_batch_size * grad_accum_steps
    mine = stream_indexes(n_sequences, seed, position + rank * per_rank, per_rank)
    return np.split(mine, grad_accum_steps)


def validation_shard(n_sequences: int, limit: int, rank: int, world_size: int) -> np.ndarray:
    """The first ``limit`` validation sequences, dealt to ranks round-robin."""
    return np.arange(min(n_sequences, limit))[rank::world_size]
