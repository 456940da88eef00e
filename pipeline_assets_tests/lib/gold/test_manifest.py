"""A snapshot's manifest: shards laid end to end per split, rows taken by global index,
gaps refused."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import polars as pl
import pytest
from deltalake import write_deltalake

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.manifest import (
    Manifest,
    read_manifest,
    sequences_scan,
    shard_counts,
    snapshot_key,
    snapshot_number,
)

SIZES = {
    ("b1", "train"): 5,
    ("b1", "validation"): 2,
    ("b2", "train"): 3,
    ("b3", "train"): 4,
    ("b3", "validation"): 1,
}


def _shards() -> pl.DataFrame:
    """Rows whose ``tag`` names their shard and local index, so a wrong mapping shows."""
    rows = [
        {
            "batch_id": batch,
            "split": split,
            "tokenizer_version": 0,
            "sequence_index": i,
            "tag": f"{batch}/{split}/{i}",
        }
        for (batch, split), n in SIZES.items()
        for i in range(n)
    ]
    return pl.DataFrame(rows).sample(
        fraction=1.0, shuffle=True, seed=1
    )  # Delta keeps rows, not their order


@pytest.fixture
def lake_uri(tmp_path) -> str:
    uri = str(tmp_path / "lake")
    write_deltalake(
        uris.join(uri, "gold", "sequences"), _shards().to_arrow(), partition_by=["batch_id"]
    )
    for number, batches in enumerate([["b1", "b3"], ["b3", "b2", "b1"]]):
        counts = shard_counts(pl.scan_delta(uris.join(uri, "gold", "sequences")), batches)
        manifest = Manifest.from_counts(number, 0, 0, 8, batches, counts)
        write_deltalake(
            uris.join(uri, "gold", "snapshots"),
            manifest.frame("test", datetime.now(timezone.utc)).to_arrow(),
            mode="append",
        )
    return uri


def test_keys_and_numbers():
    assert snapshot_key(3) == "gold-v3" and snapshot_number("gold-v3") == 3
    with pytest.raises(ValueError, match="not a data snapshot key"):
        snapshot_number("dpo-v3")


def test_each_split_lays_its_shards_end_to_end_in_batch_order(lake_uri):
    manifest = read_manifest(lake_uri, 1)
    assert manifest.batches == ("b1", "b2", "b3") and manifest.key == "gold-v1"
    assert manifest.counts == {"train": (5, 3, 4), "validation": (2, 0, 1), "search": (0, 0, 0)}
    train = manifest.split("train")
    expected = (
        [f"b1/train/{i}" for i in range(5)]
        + [f"b2/train/{i}" for i in range(3)]
        + [f"b3/train/{i}" for i in range(4)]
    )
    scan = sequences_scan(lake_uri, manifest)
    assert train.take(scan, np.arange(12), ["tag"])["tag"].to_list() == expected
    asked = np.array([11, 0, 7, 5, 5])
    taken = train.take(scan, asked, ["tag"])
    assert (
        taken["tag"].to_list() == [expected[i] for i in asked]
        and taken["sequence_index"].to_list() == asked.tolist()
    )
    whole = manifest.in_order(scan).collect()
    assert whole.filter(pl.col("split") == "validation")["tag"].to_list() == [
        "b1/validation/0",
        "b1/validation/1",
        "b3/validation/0",
    ]
    with pytest.raises(IndexError, match="train has 12 sequences"):
        train.take(scan, np.array([12]), ["tag"])


def test_a_snapshot_reads_only_its_own_shards(lake_uri):
    manifest = read_manifest(lake_uri, 0)
    assert manifest.batches == ("b1", "b3")
    tags = manifest.in_order(sequences_scan(lake_uri, manifest)).collect()["tag"]
    assert not any(tag.startswith("b2/") for tag in tags) and tags.len() == 12


def test_shards_with_gaps_or_missing_are_refused():
    rows = pl.DataFrame(
        {
            "batch_id": ["b1", "b1"],
            "split": ["train", "validation"],
            "tokenizer_version": [0, 0],
            "n": [3, 2],
            "low": [0, 1],
            "high": [2, 2],
        }
    )
    with pytest.raises(ValueError, match="not 0..n-1 in b1/validation"):
        Manifest.from_counts(0, 4, 0, 8, ["b1"], rows)
    with pytest.raises(ValueError, match="holds no shard of batch\\(es\\) b2"):
        Manifest.from_counts(0, 4, 0, 8, ["b1", "b2"], rows.head(1))


def test_a_snapshot_that_was_never_cut_is_named(lake_uri):
    with pytest.raises(ValueError, match="no data snapshot gold-v7"):
        read_manifest(lake_uri, 7)
