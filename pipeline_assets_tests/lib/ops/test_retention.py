"""What retention keeps: pinned Delta versions, registered snapshots' exports, fresh work."""

from __future__ import annotations

import pytest

from pipeline_assets.lib.ops.retention import (
    SnapshotCheckpoints,
    abandoned_staging,
    checkpoints_to_delete,
    cutoff,
    pinned_versions,
    staging_to_delete,
)

OLD, NEW, BEFORE = 100.0, 300.0, 200.0


def test_registered_versions_pin_the_delta_versions_in_their_tags():
    tags = [
        {
            "partition": "gold-v3",
            "delta.gold/sequences": "3",
            "delta.silver/records": "7",
            "delta.bronze/records": "None",
        },
        {"partition": "gold-v5", "delta.gold/sequences": "5", "delta.silver/records": "7"},
    ]
    assert pinned_versions(tags) == {"gold/sequences": [3, 5], "silver/records": [7]}


def test_checkpoints_of_unregistered_snapshots_go_once_outside_the_window():
    snapshots = [
        SnapshotCheckpoints("gold-v1", {"step-10": OLD}, newest_modified=OLD),  # never registered
        SnapshotCheckpoints(
            "gold-v2", {"step-10": NEW}, newest_modified=NEW
        ),  # perhaps still training
        SnapshotCheckpoints(
            "gold-v3",
            {"step-10": OLD, "step-20": OLD, "final": OLD, "search": OLD},
            newest_modified=OLD,
            best_folder="step-20",
        ),
    ]
    assert checkpoints_to_delete(snapshots, {"gold-v3"}, BEFORE) == [
        ("gold-v1", None),
        ("gold-v3", "search"),
        ("gold-v3", "step-10"),
    ]


def test_staging_goes_once_published_or_abandoned():
    staged = {
        ("gold-v1", "step-10"): NEW,
        ("gold-v1", "step-20"): NEW,
        ("gold-v2", "step-5"): NEW,
        ("trial-0", "final"): OLD,
    }
    assert staging_to_delete(staged, {("gold-v1", "step-10")}, {"gold-v2"}, BEFORE) == [
        ("gold-v1", "step-10"),
        ("gold-v2", "step-5"),
        ("trial-0", "final"),
    ]


def test_a_staging_run_folder_goes_once_its_newest_file_is_outside_the_window():
    files = [
        ("silver/b1/run-dead/sft-records-000000000000.parquet", OLD),
        ("silver/b1/run-dead/sft-keys-000000000000.parquet", OLD),
        ("silver/b1/run-live/sft-records-000000000000.parquet", OLD),
        ("silver/b1/run-live/sft-records-000000001000.parquet", NEW),
        ("silver/b2/run-dead/preference-keys-000000000000.parquet", OLD),
        ("silver/stray.parquet", OLD),  # not in a run's folder: never guessed at
    ]
    assert abandoned_staging(files, BEFORE) == ["silver/b1/run-dead", "silver/b2/run-dead"]


def test_a_negative_window_is_refused():
    assert cutoff(1000.0, 0) == 1000.0
    with pytest.raises(ValueError, match="zero days or more"):
        cutoff(1000.0, -1)
