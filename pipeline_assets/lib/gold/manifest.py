"""A data snapshot is a manifest of gold shards: which ingest batches' shards of gold/sequences, at
which Delta version of that table, tokenized with which tokenizer version. Cutting one reads no
token; a trainer reads only the rows it asks for.

gold/sequences holds one shard per ingest batch, each split of a shard numbered 0..n-1 on its own
(``sequence_index``). A snapshot's global order, per split, is its shards in manifest order (the
batches' arrival order) laid end to end: global index = the shard's offset + its local index.
Manifest row N is the N-th append to gold/snapshots, so it is Delta version N of that table and
the snapshot is ``gold-v<N>``.

Preference snapshots are the same thing over gold/preference_sequences, their manifests in
gold/preference_snapshots, their keys ``dpo-v<N>``: a ``SnapshotKind`` names the tables and the
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import polars as pl

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.splits import SPLITS


@dataclass(frozen=True)
class SnapshotKind:
    """Which gold shards a kind of snapshot lists, where its manifests are, and how its keys
    read."""

    prefix: str
    sequences_table: tuple[str, str]
    manifest_table: tuple[str, str]

    @property
    def sequences_name(self) -> str:
        return "/".join(self.sequences_table)

    @property
    def manifest_name(self) -> str:
        return "/".join(self.manifest_table)


SFT_SNAPSHOTS = SnapshotKind("gold-v", ("gold", "sequences"), ("gold", "snapshots"))
PREFERENCE_SNAPSHOTS = SnapshotKind(
    "dpo-v", ("gold", "preference_sequences"), ("gold", "preference_snapshots")
)
SEQUENCES_TABLE, MANIFEST_TABLE, SNAPSHOT_PREFIX = (
    SFT_SNAPSHOTS.sequences_table,
    SFT_SNAPSHOTS.manifest_table,
    SFT_SNAPSHOTS.prefix,
)


def snapshot_key(number: int, kind: SnapshotKind = SFT_SNAPSHOTS) -> str:
    return f"{kind.prefix}{number}"


def snapshot_number(key: str, kind: SnapshotKind = SFT_SNAPSHOTS) -> int:
    """``gold-v<N>`` (``dpo-v<N>`` for preference snapshots) -> N."""
    if not key.startswith(kind.prefix) or not key[len(kind.prefix) :].isdigit():
        raise ValueError(f"{key!r} is not a data snapshot key ({kind.prefix}<N>)")
    return int(key[len(kind.prefix) :])


def shard_counts(sequences: pl.LazyFrame, batches: list[str]) -> pl.DataFrame:
    """Per (batch_id, split, tokenizer_version) of these batches' shards: rows and the lowest and
    highest sequence_index (small columns only)."""
    return (
        sequences.filter(pl.col("batch_id").is_in(batches))
        .group_by("batch_id", "split", "tokenizer_version")
        .agg(n=pl.len(), low=pl.col("sequence_index").min(), high=pl.col("sequence_index").max())
        .collect(engine="streaming")
    )


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
        """Per shard holding some of these global indexes: (its place in the manifest, the distinct
        local indexes)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if indexes.size and (indexes.min() < 0 or indexes.max() >= self.n_sequences):
            raise IndexError(
                f"{self.split} has {self.n_sequences} sequences, asked for "
                f"{indexes.min()}..{indexes.max()}"
            )
        shard = np.searchsorted(self.starts, indexes, side="right") - 1
        return [(int(k), np.unique(indexes[shard == k]) - self.starts[k]) for k in np.unique(shard)]

    def take(
        self, sequences: pl.LazyFrame, indexes: np.ndarray, columns: list[str]
    ) -> pl.DataFrame:
        """The rows at these global indexes, in this order, with ``sequence_index`` global. Each
        shard's read is pruned to its partition and its range of local indexes (its row groups)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        parts = []
        for k, local in self.local(indexes):
            low, high = int(local[0]), int(local[-1])
            rows = sequences.filter(
                (pl.col("batch_id") == self.batches[k])
                & (pl.col("split") == self.split)
                & pl.col("sequence_index").is_between(low, high)
            )
            if high - low + 1 != local.size:
                rows = rows.filter(pl.col("sequence_index").is_in(local.tolist()))
            offset = int(self.starts[k])
            parts.append(
                rows.select("sequence_index", *columns)
                .collect()
                .with_columns(pl.col("sequence_index") + offset)
            )
        if not parts:
            return sequences.select("sequence_index", *columns).head(0).collect()
        found = pl.DataFrame({"sequence_index": indexes}).join(
            pl.concat(parts), on="sequence_index", how="inner", maintain_order="left"
        )
        if found.height != indexes.size:
            raise ValueError(
                f"{self.split}: asked for {indexes.size} sequences, the shards hold {found.height} "
                "of them at the snapshot's version"
            )
        return found


@dataclass(frozen=True)
class Manifest:
    """One row of gold/snapshots (or gold/preference_snapshots)."""

    number: int
    sequences_version: int
    tokenizer_version: int
    seq_len: int
    batches: tuple[str, ...]
    counts: dict[str, tuple[int, ...]]  # per split, sequences per batch (manifest order)
    kind: SnapshotKind = SFT_SNAPSHOTS

    @property
    def key(self) -> str:
        return snapshot_key(self.number, self.kind)

    def split(self, split: str) -> SplitLayout:
        return SplitLayout(split, self.batches, self.counts[split])

    def sequences_by_split(self) -> dict[str, int]:
        return {split: int(sum(self.counts[split])) for split in SPLITS}

    def offsets(self) -> pl.DataFrame:
        """Per (batch_id, split): where its shard begins in the split's global order."""
        rows = [
            (b, split, int(start))
            for split in SPLITS
            for b, start in zip(self.batches, self.split(split).starts)
        ]
        return pl.DataFrame(
            rows,
            schema={"batch_id": pl.String, "split": pl.String, "offset": pl.Int64},
            orient="row",
        )

    def in_order(self, sequences: pl.LazyFrame) -> pl.LazyFrame:
        """The snapshot's rows with ``sequence_index`` global, in its defined order (split,
        sequence_index): Delta keeps rows, not their order. For reads of a whole snapshot (checks,
        tests); a trainer takes blocks with ``SplitLayout.take``."""
        return (
            sequences.join(self.offsets().lazy(), on=["batch_id", "split"])
            .with_columns(pl.col("sequence_index") + pl.col("offset"))
            .drop("offset")
            .sort("split", "sequence_index")
        )

    @classmethod
    def from_counts(
        cls,
        number: int,
        sequences_version: int,
        tokenizer_version: int,
        seq_len: int,
        batches: list[str],
        counts: pl.DataFrame,
        kind: SnapshotKind = SFT_SNAPSHOTS,
    ) -> "Manifest":
        """``counts`` from ``shard_counts``; every split of every shard must be numbered 0..n-1."""
        gaps = counts.filter((pl.col("low") != 0) | (pl.col("high") != pl.col("n") - 1))
        if not gaps.is_empty():
            bad = ", ".join(f"{b}/{s}" for b, s in gaps.select("batch_id", "split").iter_rows())
            raise ValueError(
                f"{kind.sequences_name} v{sequences_version}: sequence_index is not 0..n-1 in {bad}"
            )
        missing = sorted(set(batches) - set(counts["batch_id"]))
        if missing:
            raise ValueError(
                f"{kind.sequences_name} v{sequences_version} holds no shard of batch(es) "
                f"{', '.join(missing)}"
            )
        n = {(b, s): int(c) for b, s, c in counts.select("batch_id", "split", "n").iter_rows()}
        ordered = tuple(sorted(batches))
        return cls(
            number,
            sequences_version,
            tokenizer_version,
            seq_len,
            ordered,
            {split: tuple(n.get((b, split), 0) for b in ordered) for split in SPLITS},
            kind,
        )

    def frame(self, reason: str, created_at: datetime) -> pl.DataFrame:
        return pl.DataFrame(
            {
                "snapshot": [self.key],
                "number": [self.number],
                "sequences_version": [self.sequences_version],
                "tokenizer_version": [self.tokenizer_version],
                "seq_len": [self.seq_len],
                "batches": [list(self.batches)],
                **{f"{split}_sequences": [list(self.counts[split])] for split in SPLITS},
                "reason": [reason],
                "created_at": [created_at],
            },
            schema_overrides={
                "batches": pl.List(pl.String),
                **{f"{s}_sequences": pl.List(pl.Int64) for s in SPLITS},
            },
        )

    @classmethod
    def from_row(cls, row: dict, kind: SnapshotKind = SFT_SNAPSHOTS) -> "Manifest":
        return cls(
            int(row["number"]),
            int(row["sequences_version"]),
            int(row["tokenizer_version"]),
            int(row["seq_len"]),
            tuple(row["batches"]),
            {split: tuple(row[f"{split}_sequences"]) for split in SPLITS},
            kind,
        )


def read_manifest(lake_uri: str, number: int, kind: SnapshotKind = SFT_SNAPSHOTS) -> Manifest:
    """Manifest row ``number`` (gold-v<number>, or dpo-v<number>), read at the table's version
    ``number``."""
    uri = uris.join(lake_uri, *kind.manifest_table)
    try:
        rows = pl.scan_delta(
            uri, version=number, storage_options=uris.delta_storage_options(lake_uri)
        )
        found = rows.filter(pl.col("number") == number).collect()
    except (
        Exception
    ) as exc:  # no table, or no such version: deltalake and polars raise their own types
        raise ValueError(
            f"no data snapshot {snapshot_key(number, kind)}: {uri} has no version {number} ({exc})"
        ) from exc
    if found.height != 1:
        raise ValueError(f"{uri} v{number} has {found.height} rows numbered {number}")
    return Manifest.from_row(found.row(0, named=True), kind)


def sequences_scan(lake_uri: str, manifest: Manifest) -> pl.LazyFrame:
    """The manifest's shard table (gold/sequences, or gold/preference_sequences) at its version,
    only its shards."""
    scan = pl.scan_delta(
        uris.join(lake_uri, *manifest.kind.sequences_table),
        version=manifest.sequences_version,
        storage_options=uris.delta_storage_options(lake_uri),
    )
    return scan.filter(pl.col("batch_id").is_in(list(manifest.batches)))
