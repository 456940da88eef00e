"""Helper process of the silver benchmark: MinHash signatures beside datasketch on one thread each.

Run with POLARS_MAX_THREADS=1 in the environment (polars reads it once, when imported), so
``signatures`` runs polars on one thread and, following polars' pool size, without a thread pool
of its own; datasketch's loop is single-threaded Python and numpy. Both sides are timed in this
process, interleaved, best of REPEATS each, in CPU seconds of the process (all its threads: a
thread more would count against us), which time other processes on a shared machine leaves out;
wall seconds beside them. One JSON line of seconds is printed.

    python -m bench.silver_signatures TEXTS.parquet LOOP_SAMPLE
"""

from __future__ import annotations

import json
import sys
import time

import polars as pl
from datasketch import MinHash

from pipeline_assets.lib.silver.minhash import shingles, signatures

REPEATS = 3


def datasketch_loop(texts: list[str]) -> None:
    """datasketch's normal use: one MinHash per document, its shingles through update_batch."""
    for text in texts:
        minhash = MinHash(num_perm=128, seed=1)
        minhash.update_batch(list(shingles(text)))


def datasketch_bulk(texts: list[str]) -> None:
    MinHash.bulk([list(shingles(text)) for text in texts], num_perm=128, seed=1)


def main(path: str, loop_sample: int) -> dict:
    if pl.thread_pool_size() != 1:
        raise SystemExit("run with POLARS_MAX_THREADS=1: both sides on one thread")
    texts = pl.read_parquet(path)["text"].to_list()
    sample = texts[:loop_sample]  # datasketch's side is timed on a slice and scaled to all texts
    scale = len(texts) / len(sample)
    sides = {
        "signatures": lambda: signatures(texts),
        "loop": lambda: datasketch_loop(sample),
        "bulk": lambda: datasketch_bulk(sample),
    }
    cpu, wall = dict.fromkeys(sides, float("inf")), dict.fromkeys(sides, float("inf"))
    for _ in range(REPEATS):
        for name, work in sides.items():
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            work()
            cpu[name] = min(cpu[name], time.process_time() - cpu_start)
            wall[name] = min(wall[name], time.perf_counter() - wall_start)
    scales = {"signatures": 1, "loop": scale, "bulk": scale}
    return {
        "documents": len(texts),
        "polars_threads": pl.thread_pool_size(),
        **{f"{name}_seconds": cpu[name] * scales[name] for name in sides},
        **{f"{name}_wall_seconds": wall[name] * scales[name] for name in sides},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
