"""Silver: the language stage's records/s against lid.176 called directly in a plain loop.

Both sides label the sample corpus's responses with the same model object (loaded once, before
timing), in a helper process started with POLARS_MAX_THREADS=1 (fastText's predict runs on the
calling thread), best of REPEATS each, interleaved, in CPU seconds of the process; wall seconds
beside them. The stage runs as silver runs it: ``run_in_process`` over blocks of ROWS_PER_BLOCK,
with a keep list, so its newline rewrite, its columns, its evidence and its mix are all counted.
The loop is what a user would write: ``model.predict(text.replace("\\n", " "))`` per response.
``ratio`` is the stage's records/s over the loop's (1.0: the stage costs nothing beyond the model).

    python -m bench.silver_language RECORDS.parquet
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

from bench.sample import sample_records
from pipeline_assets.lib.silver.language import language_model, language_stage
from pipeline_assets.lib.stages import ROWS_PER_BLOCK, run_in_process

REPEATS = 3
KEEP = frozenset({"en"})
TARGET = 0.8  # the stage keeps at least 80% of the plain loop's speed


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.parquet"
        sample_records(Path(tmp)).select("record_id", "response").write_parquet(path)
        done = subprocess.run(
            [sys.executable, "-m", "bench.silver_language", str(path)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "POLARS_MAX_THREADS": "1"},
        )
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    n = seconds["records"]
    ratio = seconds["loop_seconds"] / seconds["stage_seconds"]
    return {
        "records": n,
        "languages": seconds["languages"],
        "measured": f"language stage {n / seconds['stage_seconds']:,.0f} records/s, one thread",
        "baseline": f"lid.176 loop {n / seconds['loop_seconds']:,.0f} records/s, one thread",
        "ratio": ratio,
        "ratio_wall_clock": seconds["loop_wall_seconds"] / seconds["stage_wall_seconds"],
        "target": f"stage >= {TARGET}x the plain predict loop's records/s, same thread",
        "target_met": ratio >= TARGET,
    }


def plain_loop(texts: list[str]) -> list[str]:
    model = language_model()
    return [model.predict(text.replace("\n", " "))[0][0] for text in texts]


def main(path: str) -> dict:
    if pl.thread_pool_size() != 1:
        raise SystemExit("run with POLARS_MAX_THREADS=1: both sides on one thread")
    records = pl.read_parquet(path)
    texts = records["response"].to_list()
    stage = [language_stage(keep=KEEP)]
    language_model()  # loaded before either side is timed
    timings = {"stage": [], "loop": []}
    for _ in range(REPEATS):
        timings["stage"].append(_timed(lambda: run_in_process(stage, records, ROWS_PER_BLOCK)))
        timings["loop"].append(_timed(lambda: plain_loop(texts)))
    mix = run_in_process(stage, records, ROWS_PER_BLOCK).counters["language"]["language_mix"]
    return {
        "records": records.height,
        "languages": mix,
        "stage_seconds": min(cpu for cpu, _ in timings["stage"]),
        "stage_wall_seconds": min(wall for _, wall in timings["stage"]),
        "loop_seconds": min(cpu for cpu, _ in timings["loop"]),
        "loop_wall_seconds": min(wall for _, wall in timings["loop"]),
    }


def _timed(work) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
