"""Gold's checks. Each shard (one batch's gold/sequences partition) is judged by the asset that
wrote it: contract and packing block, so a shard that fails one is left out of every snapshot. Each
snapshot (gold/snapshots) is judged when it is cut: token-length drift and token volume against the
previous snapshot, which report."""

from dataclasses import dataclass

import numpy as np
import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec

from pipeline_assets.contracts import GoldSequence
from pipeline_assets.defs.check_helpers import contract_check_result
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import GOLD_PREFERENCE_SEQUENCES, GOLD_SEQUENCES, GOLD_SNAPSHOTS
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.lib.drift import psi_numeric_counts
from pipeline_assets.lib.gold.packing import packing_floor

SHARD_CHECK_SPECS = [
    AssetCheckSpec(
        "contract",
        asset=GOLD_SEQUENCES,
        blocking=True,
        partitions_def=ingest_batches,
        description="The batch's shard satisfies the GoldSequence contract.",
    ),
    AssetCheckSpec(
        "packing_efficiency",
        asset=GOLD_SEQUENCES,
        blocking=True,
        partitions_def=ingest_batches,
        description="Packing wastes no rows that the documents' lengths would let it save: it "
        "reaches the required share of real tokens, or needs at most one row per split more than "
        "first-fit of the same pieces.",
    ),
]
PREFERENCE_SHARD_CHECK_SPECS = [
    AssetCheckSpec(
        "contract",
        asset=GOLD_PREFERENCE_SEQUENCES,
        blocking=True,
        partitions_def=ingest_batches,
        description="The batch's shard satisfies the GoldPreferenceSequence contract: two "
        "documents a pair.",
    ),
]


def snapshot_check_specs(key) -> list[AssetCheckSpec]:
    """The checks a snapshot asset (gold/snapshots, gold/preference_snapshots) judges as it cuts
    one."""
    return [
        AssetCheckSpec(
            "token_length_drift",
            asset=key,
            description="PSI of document token lengths against the previous snapshot.",
        ),
        AssetCheckSpec(
            "token_volume",
            asset=key,
            description="Real tokens are within tolerance of the previous snapshot's.",
        ),
    ]


SNAPSHOT_CHECK_SPECS = snapshot_check_specs(GOLD_SNAPSHOTS)


@dataclass(frozen=True)
class JudgedSnapshot:
    """What the packing check reads of a shard (bounded by its batch): piece lengths per split and
    its shape."""

    key: str
    document_lengths: np.ndarray  # every piece's length, row after row
    split_lengths: dict[str, np.ndarray]  # the same, per split: each split is packed on its own
    rows: int
    seq_len: int

    @classmethod
    def of(cls, key: str, sequences: pl.DataFrame | pl.LazyFrame) -> "JudgedSnapshot":
        pieces = (
            sequences.lazy()
            .select("split", "document_lengths")
            .explode("document_lengths")
            .drop_nulls()
            .collect()
        )
        rows, seq_len = (
            sequences.lazy()
            .select(rows=pl.len(), seq_len=pl.col("input_ids").list.len().max())
            .collect()
            .row(0)
        )
        splits = {
            split: part["document_lengths"].to_numpy()
            for (split,), part in pieces.group_by("split")
        }
        return cls(key, pieces["document_lengths"].to_numpy(), splits, int(rows), int(seq_len or 0))

    @property
    def real_tokens(self) -> int:
        return int(self.document_lengths.sum())


def judge_shard(sequences: pl.DataFrame, policy: GoldPolicy) -> list[AssetCheckResult]:
    """The blocking checks of one batch's shard: a shard that fails one is left out of every
    snapshot."""
    return [
        contract_check_result(sequences, GoldSequence, check_name="contract"),
        packing_result(JudgedSnapshot.of("shard", sequences), policy.min_packing_efficiency),
    ]


@dataclass(frozen=True)
class SnapshotLengths:
    """What drift and volume read of a whole snapshot: how many pieces of each token length it holds
    (a streaming count over its shards: memory bounded by seq_len, not by the snapshot)."""

    key: str
    counts: np.ndarray  # counts[n]: pieces of n tokens

    @classmethod
    def of(cls, key: str, sequences: pl.LazyFrame, seq_len: int) -> "SnapshotLengths":
        found = (
            sequences.select(pl.col("document_lengths").explode().alias("length"))
            .drop_nulls()
            .group_by("length")
            .len()
            .collect(engine="streaming")
        )
        counts = np.zeros(seq_len + 1, dtype=np.int64)
        counts[found["length"].to_numpy()] = found["len"].to_numpy()
        return cls(key, counts)

    @property
    def real_tokens(self) -> int:
        return int((self.counts * np.arange(self.counts.size)).sum())


def judge_snapshot(
    snapshot: SnapshotLengths, previous: SnapshotLengths | None, policy: GoldPolicy
) -> list[AssetCheckResult]:
    """Drift and volume of a snapshot against the previous one, each result naming the snapshot."""
    results = [
        _first_snapshot("token_length_drift")
        if previous is None
        else _drift_result(snapshot, previous, policy),
        _first_snapshot("token_volume")
        if previous is None
        else _volume_result(snapshot, previous, policy),
    ]
    return [_naming(result, snapshot.key) for result in results]


def packing_result(snapshot: JudgedSnapshot, minimum: float) -> AssetCheckResult:
    rows, seq_len = snapshot.rows, snapshot.seq_len
    efficiency = snapshot.real_tokens / (rows * seq_len) if rows and seq_len else 0.0
    floors = (
        [packing_floor(lengths, seq_len) for lengths in snapshot.split_lengths.values()]
        if seq_len
        else []
    )
    first_fit, lower_bound = (
        sum(f.first_fit_rows for f in floors),
        sum(f.lower_bound_rows for f in floors),
    )
    # Best-fit decreasing can lose a row to first-fit on some inputs; a broken packer loses many.
    allowed = first_fit + len(floors)
    passed = efficiency >= minimum or rows <= allowed
    verdict = (
        f"at least {minimum}"
        if efficiency >= minimum
        else f"below {minimum}, but {rows} rows where first-fit needs {first_fit} (allowed: one "
        f"more per split) and the tokens alone fill {lower_bound}: "
        f"{'what these lengths allow' if passed else 'packing is broken'}"
    )
    return AssetCheckResult(
        check_name="packing_efficiency",
        passed=passed,
        description=f"packing efficiency {efficiency:.4f} ({verdict})",
        metadata={
            "packing_efficiency": round(efficiency, 5),
            "rows": rows,
            "first_fit_rows": first_fit,
            "allowed_rows": allowed,
            "lower_bound_rows": lower_bound,
            "minimum": minimum,
        },
    )


def _drift_result(
    snapshot: SnapshotLengths, previous: SnapshotLengths, policy: GoldPolicy
) -> AssetCheckResult:
    size = max(snapshot.counts.size, previous.counts.size)  # two snapshots may differ in seq_len
    psi = psi_numeric_counts(
        np.pad(previous.counts, (0, size - previous.counts.size)),
        np.pad(snapshot.counts, (0, size - snapshot.counts.size)),
    )
    return AssetCheckResult(
        check_name="token_length_drift",
        passed=psi < policy.psi_warn,
        severity=AssetCheckSeverity.ERROR if psi >= policy.psi_fail else AssetCheckSeverity.WARN,
        description=f"document token lengths PSI {psi:.3f} against {previous.key} "
        f"(warn at {policy.psi_warn}, fail at {policy.psi_fail})",
        metadata={"psi": round(psi, 4), "compared_with": previous.key},
    )


def _volume_result(
    snapshot: SnapshotLengths, previous: SnapshotLengths, policy: GoldPolicy
) -> AssetCheckResult:
    before, now = previous.real_tokens, snapshot.real_tokens
    change = (now - before) / before if before else float("inf")
    return AssetCheckResult(
        check_name="token_volume",
        passed=abs(change) <= policy.volume_tolerance,
        severity=AssetCheckSeverity.WARN,
        description=f"{now:,} real tokens against {before:,} in {previous.key} "
        f"({change:+.0%}, tolerance ±{policy.volume_tolerance:.0%})",
        metadata={
            "real_tokens": now,
            "previous_real_tokens": before,
            "change": round(change, 4),
            "compared_with": previous.key,
        },
    )


def _first_snapshot(check_name: str) -> AssetCheckResult:
    return AssetCheckResult(
        check_name=check_name, passed=True, description="first snapshot: nothing to compare with"
    )


def _naming(result: AssetCheckResult, key: str) -> AssetCheckResult:
    return result.with_metadata({**result.metadata, "data_snapshot": key})
