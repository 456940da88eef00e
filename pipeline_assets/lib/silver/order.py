"""Which ingest batch silver takes next: the oldest pending one, once every earlier batch is
settled.

Silver dedups each batch against the others, so batches go through it one at a time, in arrival
order, and the first copy to arrive survives. A batch is settled when its silver is newer than its
bronze (done) or when it is excluded: its bronze or silver run failed, or a blocking check on either
failed. A batch whose bronze is missing or still running holds every later batch back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Event:
    """A materialization, or a planned one that has not happened: its event storage id and run."""

    storage_id: int
    run_id: str
    run_finished: bool


@dataclass(frozen=True)
class BatchEvents:
    """What the instance knows about one batch's bronze and silver.

    ``*_attempt`` is the latest planned materialization newer than the latest materialization:
    in flight while its run runs, failed once the run ended without materializing.
    """

    batch_id: str
    bronze: Event | None = None
    bronze_attempt: Event | None = None
    bronze_blocked: bool = False  # the latest run of a blocking check on bronze failed
    silver: Event | None = None
    silver_attempt: Event | None = None
    silver_blocked: bool = False


class Stage(Enum):
    WAITING_FOR_BRONZE = "bronze not materialized yet"
    BRONZE_IN_FLIGHT = "bronze queued or running"
    PENDING = "silver missing or older than bronze"
    SILVER_IN_FLIGHT = "silver queued or running"
    DONE = "done"
    BRONZE_FAILED = "excluded: its bronze run failed"
    BRONZE_BLOCKED = "excluded: a blocking check on bronze failed"
    SILVER_FAILED = "excluded: its silver run failed"
    SILVER_BLOCKED = "excluded: a blocking check on silver failed"


SETTLED = {
    Stage.DONE,
    Stage.BRONZE_FAILED,
    Stage.BRONZE_BLOCKED,
    Stage.SILVER_FAILED,
    Stage.SILVER_BLOCKED,
}


def stage(batch: BatchEvents) -> Stage:
    bronze, silver, attempt = batch.bronze, batch.silver, batch.silver_attempt
    if batch.bronze_attempt is not None:
        return Stage.BRONZE_FAILED if batch.bronze_attempt.run_finished else Stage.BRONZE_IN_FLIGHT
    if bronze is None:
        return Stage.WAITING_FOR_BRONZE
    if not bronze.run_finished:  # its blocking checks run after it, in the same run
        return Stage.BRONZE_IN_FLIGHT
    if batch.bronze_blocked:
        return Stage.BRONZE_BLOCKED
    if attempt is not None and not attempt.run_finished:
        return Stage.SILVER_IN_FLIGHT
    if silver is not None and silver.storage_id > bronze.storage_id:
        if not silver.run_finished:
            return Stage.SILVER_IN_FLIGHT
        return Stage.SILVER_BLOCKED if batch.silver_blocked else Stage.DONE
    # A run that does bronze and silver plans both before it writes bronze.
    if attempt is not None and (
        attempt.storage_id > bronze.storage_id or attempt.run_id == bronze.run_id
    ):
        return Stage.SILVER_FAILED
    return Stage.PENDING


@dataclass(frozen=True)
class Decision:
    batch: BatchEvents | None  # the batch to run silver for, or None
    reason: str


def next_batch(batches: Iterable[BatchEvents]) -> Decision:
    """The oldest pending batch, when every earlier one is settled and no silver is in flight."""
    staged = [(batch, stage(batch)) for batch in sorted(batches, key=lambda b: b.batch_id)]
    running = [batch.batch_id for batch, state in staged if state is Stage.SILVER_IN_FLIGHT]
    if running:
        return Decision(None, f"silver of batch {running[0]} is queued or running")
    excluded = []
    for batch, state in staged:
        if state is Stage.PENDING:
            skipped = (
                f" (skipping {len(excluded)} excluded: {', '.join(excluded)})" if excluded else ""
            )
            return Decision(batch, f"batch {batch.batch_id} is the oldest pending batch{skipped}")
        if state not in SETTLED:
            return Decision(
                None, f"batch {batch.batch_id}: {state.value}; later batches wait for it"
            )
        if state is not Stage.DONE:
            excluded.append(batch.batch_id)
    return Decision(None, "every batch is done or excluded")


def unsettled_before(batches: Iterable[BatchEvents], batch_id: str) -> list[tuple[str, Stage]]:
    """Earlier batches that are neither done nor excluded, with their stage."""
    staged = ((batch.batch_id, stage(batch)) for batch in sorted(batches, key=lambda b: b.batch_id))
    return [
        (earlier, state) for earlier, state in staged if earlier < batch_id and state not in SETTLED
    ]
