"""Turning new landing files into ingest batches: shared by ``landing_sensor`` and
``pipeline-assets run``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone

import polars as pl

from pipeline_assets.contracts import LandingManifestEntry, conform, validate
from pipeline_assets.defs.partitions import BATCH_MANIFEST_TABLE, read_batch_manifest
from pipeline_assets.lib.landing.batches import (
    LISTING_SCHEMA,
    batch_key,
    classify_candidates,
    pending_batches,
    unseen_files,
)
from pipeline_assets.lib.locks import Lock
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource, sha256_hex


@dataclass(frozen=True)
class BatchRegistration:
    batch_id: str | None  # None when nothing new landed
    new_files: list[str] = field(default_factory=list)
    changed_files: list[str] = field(default_factory=list)  # <source>/<file> whose bytes changed


def register_new_batch(
    landing: LandingResource, lake: LakeResource, log: logging.Logger, now: datetime | None = None
) -> BatchRegistration:
    """Hash the files the manifest has not seen and register the new or changed ones as one batch.

    One registration at a time (the manifest's lock): a registration that waited reads the manifest
    the one before it wrote, so a file version joins exactly one batch whatever runs at once.
    """
    with lake.lock(*BATCH_MANIFEST_TABLE) as lock:
        return _register(landing, lake, log, lock, now)


def _register(
    landing: LandingResource,
    lake: LakeResource,
    log: logging.Logger,
    lock: Lock,
    now: datetime | None,
) -> BatchRegistration:
    listing = pl.DataFrame(
        [(f.uri, f.source, f.size, f.modified) for f in landing.list_files()],
        schema=LISTING_SCHEMA,
        orient="row",
    )
    manifest = read_batch_manifest(lake)
    candidates = unseen_files(listing, manifest)
    if candidates.is_empty():
        return BatchRegistration(batch_id=None)
    hashed = candidates.with_columns(
        checksum=pl.Series(
            [sha256_hex(landing.read_bytes(uri)) for uri in candidates["uri"]], dtype=pl.String
        )
    )
    classified = classify_candidates(hashed, manifest)
    to_register = classified.filter(pl.col("status") != "unchanged")
    if to_register.is_empty():
        return BatchRegistration(batch_id=None)
    now = now or datetime.now(timezone.utc)
    latest = None if manifest is None or manifest.is_empty() else manifest["batch_id"].max()
    batch_id = batch_key(now, to_register["checksum"], after=latest)
    changed = to_register.filter(pl.col("status") == "changed")
    for row in changed.iter_rows(named=True):
        log.warning(
            "landing file %s changed after it was ingested (sha256 %s -> %s): registering the new "
            "version in batch %s; if it grew by appending, only the new lines become records (the "
            "old ones are set aside as already_ingested), else the whole new version is ingested",
            row["uri"],
            row["previous_checksum"][:12],
            row["checksum"][:12],
            batch_id,
        )
    entries = to_register.with_columns(batch_id=pl.lit(batch_id), registered_at=pl.lit(now))
    lock.confirm()
    entries = validate(conform(entries, LandingManifestEntry), LandingManifestEntry)
    lake.append(*BATCH_MANIFEST_TABLE, entries)
    log.info("registered %d landing file(s) as ingest batch %s", to_register.height, batch_id)
    return BatchRegistration(
        batch_id=batch_id,
        new_files=to_register.filter(pl.col("status") == "new")["uri"].to_list(),
        changed_files=[landing.relative_name(uri) for uri in changed["uri"]],
    )


def discover_batches(
    landing: LandingResource, lake: LakeResource, known_partitions: list[str], log: logging.Logger
) -> tuple[BatchRegistration, list[str]]:
    """What landing_sensor and ``pipeline-assets run`` both do: register new files, then return
    every registered batch that has no partition yet (this one, or one an interrupted tick left)."""
    registration = register_new_batch(landing, lake, log)
    return registration, pending_batches(read_batch_manifest(lake), known_partitions)
