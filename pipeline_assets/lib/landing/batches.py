"""Which landing files are new, which changed, and the key of the batch that takes them.

The manifest (one row per registered file version) is keyed by path, size and checksum: a file
already ingested is never ingested again, and a file whose bytes changed after ingestion is
registered again as a new version, with the checksum it had before, so it is reported and never
silently skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

import polars as pl

LISTING_SCHEMA = pl.Schema(
    {"uri": pl.String, "source": pl.String, "size": pl.Int64, "modified": pl.String}
)


_KEY_TIME = "%Y%m%dT%H%M%SZ"


def batch_key(registered_at: datetime, checksums: Iterable[str], after: str | None = None) -> str:
    """``20261121T053000Z-3fa2c1``: UTC registration second, then a digest of the batch's files.

    Keys sort in arrival order: a batch registered in the same second as ``after`` (the newest
    existing key) takes the next second, so the digest never decides the order.
    """
    stamp = registered_at.astimezone(timezone.utc).replace(microsecond=0)
    if after is not None:
        latest = datetime.strptime(after.split("-", 1)[0], _KEY_TIME).replace(tzinfo=timezone.utc)
        stamp = max(stamp, latest + timedelta(seconds=1))
    digest = hashlib.sha256("\n".join(sorted(checksums)).encode()).hexdigest()[:6]
    return f"{stamp.strftime(_KEY_TIME)}-{digest}"


def unseen_files(listing: pl.DataFrame, manifest: pl.DataFrame | None) -> pl.DataFrame:
    """Listed files whose (uri, size, modified) the manifest has not seen: only these get hashed."""
    if manifest is None or manifest.is_empty():
        return listing
    return listing.join(
        manifest.select("uri", "size", "modified"), on=["uri", "size", "modified"], how="anti"
    )


def classify_candidates(candidates: pl.DataFrame, manifest: pl.DataFrame | None) -> pl.DataFrame:
    """Add ``status`` (new / changed / unchanged) and ``previous_checksum`` to hashed candidates.

    ``unchanged``: same uri and checksum as a registered version (the file was only touched).
    ``changed``: a registered uri with other bytes; ``previous_checksum`` is its latest version.
    """
    if manifest is None or manifest.is_empty():
        return candidates.with_columns(
            status=pl.lit("new"), previous_checksum=pl.lit(None, pl.String)
        )
    known_versions = manifest.select("uri", "checksum").unique().with_columns(known=pl.lit(True))
    latest = (
        manifest.sort("registered_at")
        .group_by("uri")
        .agg(previous_checksum=pl.col("checksum").last())
    )
    return (
        candidates.join(known_versions, on=["uri", "checksum"], how="left")
        .join(latest, on="uri", how="left")
        .with_columns(
            status=pl.when(pl.col("known"))
            .then(pl.lit("unchanged"))
            .when(pl.col("previous_checksum").is_not_null())
            .then(pl.lit("changed"))
            .otherwise(pl.lit("new"))
        )
        .with_columns(
            previous_checksum=pl.when(pl.col("status") == "changed").then(
                pl.col("previous_checksum")
            )
        )
        .drop("known")
    )


def pending_batches(manifest: pl.DataFrame | None, known_partitions: Iterable[str]) -> list[str]:
    """Batches in the manifest that have no partition yet (a registration interrupted half-way)."""
    if manifest is None or manifest.is_empty():
        return []
    return sorted(set(manifest["batch_id"].unique().to_list()) - set(known_partitions))


def earlier_versions(manifest: pl.DataFrame, batch_id: str) -> pl.DataFrame:
    """For each file registered before ``batch_id``: its latest earlier version (uri,
    previous_size, previous_checksum, previous_batch), what an appended export grew from."""
    return (
        manifest.filter(pl.col("batch_id") < batch_id)
        .sort("registered_at")
        .group_by("uri")
        .agg(
            previous_size=pl.col("size").last(),
            previous_checksum=pl.col("checksum").last(),
            previous_batch=pl.col("batch_id").last(),
        )
    )
