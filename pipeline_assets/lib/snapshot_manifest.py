"""A data snapshot is a manifest of gold shards: which ingest batches' shards of gold/sequences, at
which Delta version of that table, tokenized with which tokenizer version. Cutting one reads no
token; a trainer reads only the rows it asks for.

gold/sequences holds one shard per ingest batch, each split of a shard numbered 0..n-1 on its own
(``sequence_index``). A snapshot's global order, per split, is its shards in manifest order (the
batches' arrival order) laid end to end: global index = the shard's offset + its local index.
Manifest row N is the N-th append to gold/snapshots, so it is Delta version N of that table and
the snapshot is ``gold-v<N>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import polars as pl

from pipeline_assets.lib import uris
from pipeline_assets.lib.splits import SPLITS

SEQUENCES_TABLE = ("gold", "sequences")
MANIFEST_TABLE = ("gold", "snapshots")
SNAPSHOT_PREFIX = "gold-v"


def snapshot_key(number: int) -> str:
    return f"{SNAPSHOT_PREFIX}{number}"


def snapshot_number(key: str) -> int:
    """``gold-v<N>`` -> N."""
    if not key.startswith(SNAPSHOT_PREFIX) or not key[len(SNAPSHOT_PREFIX):].isdigit():
        raise ValueError(f"{key!r} is not a data snapshot key ({SNAPSHOT_PREFIX}<N>)")
    return int(key[len(SNAPSHOT_PREFIX):])


def shard_counts(sequences: pl.LazyFrame, batches: list[str]) -> pl.DataFrame:
    """Per (batch_id, split, tokenizer_version) of these batches' shards: rows and the lowest and highest
    sequence_index (small columns only)."""
    return (sequences.filter(pl.col("batch_id").is_in(batches))
            .group_by("batch_id", "split", "tokenizer_version")
            .agg(n=pl.len(), low=pl.col("sequence_index").min(), high=pl.col("sequence_index").max())
            .collect(engine="streaming"))


class SplitLayout:
    """One split of a snapshot: its shards end to end, global index = offset + local index."""

    def __init__(self, split: str, batches: tuple[str, ...], counts: tuple[int, ...]):
        self.split, self.batches = split, batches
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.cumsum(self.counts) - self.counts

    @property
    def n_sequences(self) -> int:
        return int(self.counts.sum())

    def local(self, indexes: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Per shard holding some of these global indexes: (its place in the manifest, the distinct local indexes)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if indexes.size and (indexes.min() < 0 or indexes.max() >= self.n_sequences):
            raise IndexError(f"{self.split} has {self.n_sequences} sequences, asked for {indexes.min()}..{indexes.max()}")
        shard = np.searchsorted(self.starts, indexes, side="right") - 1
        return [(int(k), np.unique(indexes[shard == k]) - self.starts[k]) for k in np.unique(shard)]

    def take(self, sequences: pl.LazyFrame, indexes: np.ndarray, columns: list[str]) -> pl.DataFrame:
        """The rows at these global indexes, in this order, with ``sequence_index`` global. Each shard's
        read is pruned to its partition and its range of local indexes (its row groups)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        parts = []
        for k, local in self.local(indexes):
            low, high = int(local[0]), int(local[-1])
            rows = sequences.filter((pl.col("batch_id") == self.batches[k]) & (pl.col("split") == self.split)
                                    & pl.col("sequence_index").is_between(low, high))
            if high - low + 1 != local.size:
                rows = rows.filter(pl.col("sequence_index").is_in(local.tolist()))
            offset = int(self.starts[k])
            parts.append(rows.select("sequence_index", *columns).collect().with_columns(pl.col("sequence_index") + offset))
        if not parts:
            return sequences.select("sequence_index", *columns).head(0).collect()
        found = pl.DataFrame({"sequence_index": indexes}).join(pl.concat(parts), on="sequence_index", how="inner",
                                                              maintain_order="left")
        if found.height != indexes.size:
            raise ValueError(f"{self.split}: asked for {indexes.size} sequences, gold/sequences holds {found.height} of them "
                             "at the snapshot's version")
        return found


@dataclass(frozen=True)
class Manifest:
    """One row of gold/snapshots."""

    number: int
    sequences_version: int
    tokenizer_version: int
    seq_len: int
    batches: tuple[str, ...]
    counts: dict[str, tuple[int, ...]]  # per split, sequences per batch (manifest order)

    @property
    def key(self) -> str:
        return snapshot_key(self.number)

    def split(self, split: str) -> SplitLayout:
        return SplitLayout(split, self.batches, self.counts[split])

    def sequences_by_split(self) -> dict[str, int]:
        return {split: int(sum(self.counts[split])) for split in SPLITS}

    def offsets(self) -> pl.DataFrame:
        """Per (batch_id, split): where its shard begins in the split's global order."""
        rows = [(b, split, int(start)) for split in SPLITS
                for b, start in zip(self.batches, self.split(split).starts)]
        return pl.DataFrame(rows, schema={"batch_id": pl.String, "split": pl.String, "offset": pl.Int64}, orient="row")

    def in_order(self, sequences: pl.LazyFrame) -> pl.LazyFrame:
        """The snapshot's rows with ``sequence_index`` global, in its defined order (split, sequence_index):
        Delta keeps rows, not their order. For reads of a whole snapshot (checks, tests); a trainer
        takes blocks with ``SplitLayout.take``."""
        return (sequences.join(self.offsets().lazy(), on=["batch_id", "split"])
                .with_columns(pl.col("sequence_index") + pl.col("offset")).drop("offset")
                .sort("split", "sequence_index"))

    @classmethod
    def from_counts(cls, number: int, sequences_version: int, tokenizer_version: int, seq_len: int,
                    batches: list[str], counts: pl.DataFrame) -> "Manifest":
        """``counts`` from ``shard_counts``; every split of every shard must be numbered 0..n-1."""
        gaps = counts.filter((pl.col("low") != 0) | (pl.col("high") != pl.col("n") - 1))
        if not gaps.is_empty():
            bad = ", ".join(f"{b}/{s}" for b, s in gaps.select("batch_id", "split").iter_rows())
            raise ValueError(f"gold/sequences v{sequences_version}: sequence_index is not 0..n-1 in {bad}")
        missing = sorted(set(batches) - set(counts["batch_id"]))
        if missing:
            raise ValueError(f"gold/sequences v{sequences_version} holds no shard of batch(es) {', '.join(missing)}")
        n = {(b, s): int(c) for b, s, c in counts.select("batch_id", "split", "n").iter_rows()}
        ordered = tuple(sorted(batches))
        return cls(number, sequences_version, tokenizer_version, seq_len, ordered,
                   {split: tuple(n.get((b, split), 0) for b in ordered) for split in SPLITS})

    def frame(self, reason: str, created_at: datetime) -> pl.DataFrame:
        return pl.DataFrame({
            "snapshot": [self.key], "number": [self.number], "sequences_version": [self.sequences_version],
            "tokenizer_version": [self.tokenizer_version], "seq_len": [self.seq_len], "batches": [list(self.batches)],
            **{f"{split}_sequences": [list(self.counts[split])] for split in SPLITS},
            "reason": [reason], "created_at": [created_at],
        }, schema_overrides={"batches": pl.List(pl.String), **{f"{s}_sequences": pl.List(pl.Int64) for s in SPLITS}})

    @classmethod
    def from_row(cls, row: dict) -> "Manifest":
        return cls(int(row["number"]), int(row["sequences_version"]), int(row["tokenizer_version"]), int(row["seq_len"]),
                   tuple(row["batches"]), {split: tuple(row[f"{split}_sequences"]) for split in SPLITS})


def read_manifest(lake_uri: str, number: int) -> Manifest:
    """Manifest row ``number`` (gold-v<number>), read at the table's version ``number``."""
    uri = uris.join(lake_uri, *MANIFEST_TABLE)
    try:
        rows = pl.scan_delta(uri, version=number, storage_options=uris.delta_storage_options(lake_uri))
        found = rows.filter(pl.col("number") == number).collect()
    except Exception as exc:  # no table, or no such version: deltalake and polars raise their own types
        raise ValueError(f"no data snapshot {snapshot_key(number)}: {uri} has no version {number} ({exc})") from exc
    if found.height != 1:
        raise ValueError(f"{uri} v{number} has {found.height} rows numbered {number}")
    return Manifest.from_row(found.row(0, named=True))


def sequences_scan(lake_uri: str, manifest: Manifest) -> pl.LazyFrame:
    """gold/sequences at the manifest's version, only its shards."""
    scan = pl.scan_delta(uris.join(lake_uri, *SEQUENCES_TABLE), version=manifest.sequences_version,
                         storage_options=uris.delta_storage_options(lake_uri))
    return scan.filter(pl.col("batch_id").is_in(list(manifest.batches)))
