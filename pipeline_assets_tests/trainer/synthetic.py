"""A small, learnable gold snapshot for trainer tests: documents that count upwards from a random
start, so a model can learn them in a few steps."""

from __future__ import annotations

import numpy as np
import polars as pl

from pipeline_assets.contracts import GoldSequence, conform, validate
from pipeline_assets.defs.gold.manifest import cut_manifest
from pipeline_assets.lib.gold.sequences import build_sequences
from pipeline_assets.resources.lake import LakeResource

VOCAB = 64
PAD_ID = 0


def synthetic_records(n_records: int, seed: int = 0, max_len: int = 40) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for number in range(n_records):
        length = int(rng.integers(8, max_len))
        start = int(rng.integers(1, VOCAB))
        ids = [(start + k) % (VOCAB - 1) + 1 for k in range(length)]
        prefix = length // 3
        rows.append(
            {
                "record_id": f"r{number:06d}",
                "split": {0: "validation", 5: "search"}.get(number % 10, "train"),
                "input_ids": ids,
                "loss_mask": [False] * prefix + [True] * (length - prefix),
                "n_tokens": length,
            }
        )
    return pl.DataFrame(
        rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Boolean)}
    )


def write_synthetic_gold(
    lake_uri: str, n_records: int = 400, seq_len: int = 64, seed: int = 0, shards: int = 1
) -> int:
    """Write ``shards`` gold shards (the records dealt round-robin to batches b0, b1, ...) and cut a
    data snapshot of them; returns its number N (gold-v<N>)."""
    lake = LakeResource(uri=lake_uri)
    records = synthetic_records(n_records, seed).with_row_index("row")
    batches = [f"b{k}" for k in range(shards)]
    for k, batch in enumerate(batches):
        part = records.filter(pl.col("row") % shards == k).drop("row")
        sequences, _ = build_sequences(part, seq_len=seq_len, seed=seed + k, pad_id=PAD_ID)
        sequences = sequences.with_columns(
            batch_id=pl.lit(batch), tokenizer_version=pl.lit(0, pl.Int64)
        )
        lake.replace_partition(
            "gold",
            "sequences",
            validate(conform(sequences, GoldSequence), GoldSequence),
            column="batch_id",
            value=batch,
        )
    manifest, _ = cut_manifest(
        lake, batches, tokenizer_version=0, seq_len=seq_len, reason="synthetic"
    )
    return manifest.number
