from __future__ import annotations

from datetime import datetime, timezone

import polars as pl

from pipeline_assets.lib.landing.batches import (
    LISTING_SCHEMA,
    batch_key,
    classify_candidates,
    pending_batches,
    unseen_files,
)

NOW = datetime(2026, 11, 21, 5, 30, tzinfo=timezone.utc)


def _manifest(rows):
    return pl.DataFrame(
        rows,
        schema={
            "uri": pl.String,
            "size": pl.Int64,
            "modified": pl.String,
            "checksum": pl.String,
            "batch_id": pl.String,
            "registered_at": pl.Datetime("us", "UTC"),
        },
        orient="row",
    )


def test_batch_keys_sort_by_arrival_even_within_one_second():
    first = batch_key(NOW, ["b" * 64])
    assert first.startswith("20261121T053000Z-")
    second = batch_key(NOW, ["a" * 64], after=first)
    assert second > first and second.startswith("20261121T053001Z-")
    assert batch_key(NOW, ["x", "y"]) == batch_key(NOW, ["y", "x"])


def test_unseen_files_skips_files_with_same_path_size_and_mtime():
    listing = pl.DataFrame(
        [("a", "s", 10, "1"), ("b", "s", 10, "1"), ("c", "s", 5, "2")],
        schema=LISTING_SCHEMA,
        orient="row",
    )
    manifest = _manifest([("a", 10, "1", "h1", "b1", NOW), ("b", 10, "0", "h2", "b1", NOW)])
    assert unseen_files(listing, manifest)["uri"].to_list() == ["b", "c"]


def test_classify_new_changed_and_touched():
    manifest = _manifest([("a", 10, "1", "h1", "b1", NOW), ("b", 10, "1", "h2", "b1", NOW)])
    candidates = pl.DataFrame({"uri": ["a", "b", "c"], "checksum": ["h1", "h9", "h3"]})
    classified = classify_candidates(candidates, manifest).sort("uri")
    assert classified["status"].to_list() == ["unchanged", "changed", "new"]
    assert classified["previous_checksum"].to_list() == [None, "h2", None]


def test_pending_batches_are_those_without_a_partition():
    manifest = _manifest([("a", 1, "1", "h", "b1", NOW), ("b", 1, "1", "h", "b2", NOW)])
    assert pending_batches(manifest, ["b1"]) == ["b2"]
    assert pending_batches(None, []) == []
