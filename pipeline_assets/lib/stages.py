"""Block stages: the one shape of every silver stage that judges records one at a time.

A stage (datatrove's step) has a name and a function from a block of records to the records it
keeps, the records it removes (with its reason and evidence columns) and its counters. A list of
stages runs on one block, each on what the one before kept; an engine runs the list on every
block of a batch (in this process, or as Ray Data tasks) and ``merge`` puts the blocks' results
back together in block order, so the result does not depend on how the batch was cut.

A result crosses a process boundary as one row: its frames as Arrow IPC bytes and its counters as
JSON (``to_row`` / ``from_row``).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import polars as pl

# Without a Ray cluster, a batch this large starts a local Ray for its block stages; a smaller one
# runs them in the step's own process (PIPELINE_RAY_MIN_ROWS: the default, one place).
RAY_MIN_ROWS = 100_000
ROWS_PER_BLOCK = 20_000  # a block stage's unit of work: a few tens of MB of text

StageFunction = Callable[[pl.DataFrame], tuple[pl.DataFrame, pl.DataFrame | None, dict]]


@dataclass(frozen=True)
class BlockStage:
    name: str
    run: StageFunction  # block -> (kept, removed or None, counters)


@dataclass(frozen=True)
class StagesResult:
    kept: pl.DataFrame
    removed: dict[str, pl.DataFrame]  # per stage that removes records
    counters: dict[str, dict]  # per stage, with its seconds


def run_stages(stages: Sequence[BlockStage], block: pl.DataFrame) -> StagesResult:
    kept, removed, counters = block, {}, {}
    for stage in stages:
        started = time.perf_counter()
        kept, rejected, stage_counters = stage.run(kept)
        if rejected is not None:
            removed[stage.name] = rejected
        counters[stage.name] = {**stage_counters, "seconds": time.perf_counter() - started}
    return StagesResult(kept, removed, counters)


def run_in_process(
    stages: Sequence[BlockStage], frame: pl.DataFrame, rows_per_block: int
) -> StagesResult:
    return merge([run_stages(stages, block) for block in split_blocks(frame, rows_per_block)])


def split_blocks(frame: pl.DataFrame, rows_per_block: int) -> list[pl.DataFrame]:
    if frame.height == 0:
        return [frame]
    return [frame.slice(start, rows_per_block) for start in range(0, frame.height, rows_per_block)]


def merge(results: Sequence[StagesResult]) -> StagesResult:
    """The blocks' results in block order; counters summed (a stage's seconds: over all blocks)."""
    first = results[0]
    removed = {
        name: pl.concat([r.removed[name] for r in results], how="diagonal_relaxed")
        for name in first.removed
    }
    counters = first.counters
    for result in results[1:]:
        counters = {name: _summed(counters[name], result.counters[name]) for name in counters}
    return StagesResult(
        pl.concat([r.kept for r in results], how="diagonal_relaxed"),
        removed,
        {name: {**c, "seconds": round(c["seconds"], 3)} for name, c in counters.items()},
    )


def _summed(left: dict, right: dict) -> dict:
    out = dict(left)
    for key, value in right.items():
        if isinstance(value, dict):
            out[key] = _summed(out.get(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = out.get(key, 0) + value
        else:
            out.setdefault(key, value)
    return out


# --- Crossing a process boundary ----------------------------------------------------------------


def to_row(result: StagesResult) -> dict:
    return {
        "kept": _ipc(result.kept),
        "removed": json.dumps({name: _ipc(frame).hex() for name, frame in result.removed.items()}),
        "counters": json.dumps(result.counters),
    }


def from_row(row: dict) -> StagesResult:
    removed = {
        name: pl.read_ipc(io.BytesIO(bytes.fromhex(data)))
        for name, data in json.loads(row["removed"]).items()
    }
    return StagesResult(pl.read_ipc(io.BytesIO(row["kept"])), removed, json.loads(row["counters"]))


def _ipc(frame: pl.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.write_ipc(buffer)
    return buffer.getvalue()
