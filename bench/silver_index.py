"""Helper processes for the silver benchmark: build a synthetic MinHash index, or look a batch up
against it and report the process's peak memory."""

from __future__ import annotations

import json
import random
import resource
import sys

import numpy as np
import polars as pl
from deltalake import write_deltalake

from pipeline_assets.lib.silver.dedup import HISTORY_SCHEMA, band_keys, lsh_of, near_dedup
from pipeline_assets.lib.silver.minhash import MinHashConfig

CHUNK = 100_000


def build(table: str, records: int) -> None:
    config = MinHashConfig()
    params = lsh_of(config)
    rng = np.random.default_rng(0)
    for start in range(0, records, CHUNK):
        sigs = rng.integers(
            0, 2**32, (min(CHUNK, records - start), config.num_perm), dtype=np.uint64
        ).astype(np.uint32)
        frame = pl.DataFrame(
            {
                "record_id": [f"{i:032d}" for i in range(start, start + len(sigs))],
                "batch_id": f"b{start // CHUNK:04d}",
                "exact_hash": [f"{i:032x}" for i in range(start, start + len(sigs))],
                "signature": [row.tobytes() for row in sigs],
                "response_signature": [
                    row.tobytes() for row in sigs[:, ::-1]
                ],  # as many bytes as a real one
                "band_keys": band_keys(sigs, params).tolist(),
                "lsh_params": params.label(config),
                "prompt_hash": None,  # preference pairs' prompts only
            },
            schema=HISTORY_SCHEMA,
        )
        write_deltalake(table, frame.to_arrow(), mode="append", partition_by=["batch_id"])


def lookup(table: str, batch_size: int) -> None:
    rng = random.Random(1)
    words = [f"w{i}" for i in range(50_000)]
    batch = pl.DataFrame(
        {
            "record_id": [f"z{i:031d}" for i in range(batch_size)],
            "batch_id": "zz-new",
            "prompt": "q",
            "response": [
                " ".join(rng.choice(words) for _ in range(100)) for _ in range(batch_size)
            ],
            "exact_hash": "h",
        }
    )
    _, rejected, _ = near_dedup(batch, pl.scan_delta(table))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_gb": peak_kb / 1024 / 1024, "rejected": rejected.height}))


if __name__ == "__main__":
    command, table, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"build": build, "lookup": lookup}[command](table, count)
