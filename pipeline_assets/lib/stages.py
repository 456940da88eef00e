"""Stages: the one shape of every silver and gold stage (datatrove's step).

A stage declares its name, its function over one block of records and its reject reason. The
function returns the records it keeps, the records it removes (with their evidence columns) and
only its own details (rejected_by_rule, tokens, ...). The runner derives what every stage counts
(``rows_in``, ``kept``, ``rejected``, ``seconds``), fails when a stage loses or invents a row
(rows_in must be kept + rejected), and writes the reject reason into the removed rows' ``stage``.

A list of stages runs on one block, each on what the one before kept; an engine runs the list on
every block of a batch (in this process, or as Ray Data tasks) and ``merge`` puts the blocks'
results back together in block order, so the result does not depend on how the batch was cut. A
stage that looks across a whole batch runs the same way, on the batch as one block (``run_whole``).

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
DERIVED_COUNTERS = ("rows_in", "kept", "rejected", "seconds")

# block -> (kept, removed or None, the stage's own details)
StageFunction = Callable[[pl.DataFrame], tuple[pl.DataFrame, pl.DataFrame | None, dict]]


@dataclass(frozen=True)
class Stage:
    name: str
    run: StageFunction
    # The ``stage`` its removed rows carry in silver/rejects (None: it removes nothing). A function
    # that tells its removals apart writes ``stage`` itself, as "<reject_reason>:<why>".
    reject_reason: str | None = None
    # A stage that runs a model: its ``run`` loads the model on first use and keeps it. On Ray it
    # runs on an actor pool (the model loaded once an actor, a GPU each when the cluster has them)
    # while the stages before it stream as tasks; here, in the step's process like any other.
    on_actors: bool = False


class StageAccountingError(RuntimeError):
    """A stage's rows in are not its kept plus its removed rows, or it broke the stage shape."""


@dataclass(frozen=True)
class StagesResult:
    kept: pl.DataFrame
    removed: dict[str, pl.DataFrame]  # per stage that removes records
    counters: dict[str, dict]  # per stage: rows_in, kept, rejected, its details, seconds


def run_stages(stages: Sequence[Stage], block: pl.DataFrame) -> StagesResult:
    kept, removed, counters = block, {}, {}
    for stage in stages:
        started = time.perf_counter()
        survivors, rejected, details = stage.run(kept)
        rejected = _with_reason(stage, survivors, rejected)
        counts = _counts(stage, kept, survivors, rejected, details)
        counters[stage.name] = {**counts, **details, "seconds": time.perf_counter() - started}
        if rejected is not None:
            removed[stage.name] = rejected
        kept = survivors
    return StagesResult(kept, removed, counters)


def run_more(stages: Sequence[Stage], result: StagesResult) -> StagesResult:
    """``stages`` on what ``result`` kept, their counters and removals added to its own."""
    more = run_stages(stages, result.kept)
    return StagesResult(
        more.kept, {**result.removed, **more.removed}, {**result.counters, **more.counters}
    )


def split_at_actors(stages: Sequence[Stage]) -> tuple[list[Stage], list[Stage]]:
    """The stages before the first that runs on actors, and that stage with the rest."""
    first = next((i for i, stage in enumerate(stages) if stage.on_actors), len(stages))
    return list(stages[:first]), list(stages[first:])


def run_in_process(
    stages: Sequence[Stage], frame: pl.DataFrame, rows_per_block: int
) -> StagesResult:
    return merge([run_stages(stages, block) for block in split_blocks(frame, rows_per_block)])


def run_whole(stages: Sequence[Stage], frame: pl.DataFrame) -> StagesResult:
    """The stages on ``frame`` as one block: for stages that look across a whole batch."""
    return merge([run_stages(stages, frame)])


def split_blocks(frame: pl.DataFrame, rows_per_block: int) -> list[pl.DataFrame]:
    if frame.height == 0:
        return [frame]
    return [frame.slice(start, rows_per_block) for start in range(0, frame.height, rows_per_block)]


def _with_reason(
    stage: Stage, kept: pl.DataFrame, removed: pl.DataFrame | None
) -> pl.DataFrame | None:
    """``removed`` with its ``stage`` column: the record's columns, ``stage``, then the evidence."""
    if stage.reject_reason is None:
        if removed is not None and removed.height:
            raise StageAccountingError(
                f"stage {stage.name!r} removed {removed.height} row(s) with no reject reason"
            )
        return None
    if removed is None:
        return None
    if "stage" in removed.columns:
        _refuse_other_reasons(stage, removed["stage"])
        return removed
    record = [name for name in removed.columns if name in kept.columns]
    reason = pl.lit(stage.reject_reason, pl.String).alias("stage")
    return removed.select(*record, reason, pl.exclude(record))


def _refuse_other_reasons(stage: Stage, written: pl.Series) -> None:
    reason = stage.reject_reason
    ours = (written == reason) | written.str.starts_with(f"{reason}:")
    if not ours.fill_null(False).all():
        others = sorted(set(written.filter(~ours.fill_null(False)).to_list()), key=str)
        raise StageAccountingError(
            f"stage {stage.name!r} wrote stage values {others[:3]} outside its reject reason "
            f"{reason!r}"
        )


def _counts(
    stage: Stage,
    block: pl.DataFrame,
    kept: pl.DataFrame,
    removed: pl.DataFrame | None,
    details: dict,
) -> dict:
    counts = {
        "rows_in": block.height,
        "kept": kept.height,
        "rejected": 0 if removed is None else removed.height,
    }
    if counts["rows_in"] != counts["kept"] + counts["rejected"]:
        raise StageAccountingError(
            f"stage {stage.name!r}: {counts['rows_in']} rows in, but {counts['kept']} kept + "
            f"{counts['rejected']} removed"
        )
    written = sorted(set(DERIVED_COUNTERS) & details.keys())
    if written:
        raise StageAccountingError(
            f"stage {stage.name!r} reports {written}: the runner derives those"
        )
    return counts


def merge(results: Sequence[StagesResult]) -> StagesResult:
    """The blocks' results in block order; counters summed (a stage's seconds: over all blocks)."""
    first = results[0]
    names = list(dict.fromkeys(name for r in results for name in r.removed))
    removed = {
        name: pl.concat(
            [r.removed[name] for r in results if name in r.removed], how="diagonal_relaxed"
        )
        for name in names
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
