"""What the retention job keeps: Delta versions that registered models pin, and the checkpoints of
the snapshots registered models come from (docs/operations.md, "Retention")."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DELTA_TAG_PREFIX = (
    "delta."  # a registered version's tag ``delta.<layer>/<name>`` = the Delta version it read
)
EXPORT = "final"  # the exported model inside a snapshot's checkpoint folder
_SNAPSHOT_FOLDER = re.compile(r"^[a-z]+-v\d+$")  # gold-v<N>, dpo-v<N>: folders the trainer writes


@dataclass(frozen=True)
class Removed:
    """What one clean-up deleted."""

    files: int = 0
    bytes: int = 0

    def __add__(self, other: "Removed") -> "Removed":
        return Removed(self.files + other.files, self.bytes + other.bytes)


@dataclass(frozen=True)
class SnapshotCheckpoints:
    """One snapshot's checkpoint folder: its sub-folders (``step-N``, ``final``, ``search``) with
    the time of their newest file (epoch seconds), the newest file of the whole folder, and the best
    step's folder (``best.json``), if any."""

    partition: str
    folders: Mapping[str, float]
    newest_modified: float
    best_folder: str | None = None


def cutoff(now: float, retention_days: float) -> float:
    """The epoch second before which things fall outside the retention window."""
    if retention_days < 0:
        raise ValueError(f"the retention window must be zero days or more, not {retention_days}")
    return now - retention_days * 86400


def pinned_versions(version_tags: Iterable[Mapping[str, str]]) -> dict[str, list[int]]:
    """Table (``layer/name``) -> the Delta versions registered model versions read, from their
    tags."""
    pinned: dict[str, set[int]] = {}
    for tags in version_tags:
        for tag, value in tags.items():
            if tag.startswith(DELTA_TAG_PREFIX) and str(value).isdigit():
                pinned.setdefault(tag[len(DELTA_TAG_PREFIX) :], set()).add(int(value))
    return {table: sorted(versions) for table, versions in sorted(pinned.items())}


def is_snapshot_folder(name: str) -> bool:
    return bool(_SNAPSHOT_FOLDER.match(name))


def checkpoints_to_delete(
    snapshots: Iterable[SnapshotCheckpoints], registered: set[str], before: float
) -> list[tuple[str, str | None]]:
    """``(partition, None)``: the whole folder of a snapshot no registered version comes from;
    ``(partition, folder)``: a registered snapshot's folder other than its export and best step.
    Only what was last written before ``before``: a newer folder may belong to a training,
    evaluation or registration still under way."""
    doomed: list[tuple[str, str | None]] = []
    for snapshot in snapshots:
        if snapshot.partition not in registered:
            if snapshot.newest_modified < before:
                doomed.append((snapshot.partition, None))
            continue
        kept = {EXPORT, snapshot.best_folder}
        doomed += [
            (snapshot.partition, name)
            for name, modified in sorted(snapshot.folders.items())
            if name not in kept and modified < before
        ]
    return doomed


def staging_to_delete(
    staged: Mapping[tuple[str, str], float],
    published: set[tuple[str, str]],
    deleted_partitions: set[str],
    before: float,
) -> list[tuple[str, str]]:
    """Local staging folders ``(partition, folder)`` (with their newest modification) whose upload
    is published, whose snapshot's checkpoints are gone, or which were left unfinished before
    ``before``; an upload under way stays."""
    return [
        item
        for item, modified in sorted(staged.items())
        if item in published or item[0] in deleted_partitions or modified < before
    ]


STAGING_DEPTH = 3  # <lake>/_staging/<stage>/<batch>/<run>/: one run's staged files


def abandoned_staging(files: Iterable[tuple[str, float]], before: float) -> list[str]:
    """The run folders (``<stage>/<batch>/<run>``, relative to the staging root) among ``files``
    (path relative to the root, modification time) whose newest file was written before
    ``before``: a run that died before its commit, whose batch was never re-run. A folder written
    since may be a run under way."""
    newest: dict[str, float] = {}
    for path, modified in files:
        parts = path.split("/")
        if len(parts) > STAGING_DEPTH:
            folder = "/".join(parts[:STAGING_DEPTH])
            newest[folder] = max(newest.get(folder, modified), modified)
    return sorted(folder for folder, modified in newest.items() if modified < before)
