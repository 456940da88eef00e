"""Which batch silver takes next, from what the instance knows about each batch's bronze
and silver."""

from __future__ import annotations

from pipeline_assets.lib.silver.order import (
    BatchEvents,
    Event,
    Stage,
    next_batch,
    stage,
    unsettled_before,
)


def _done(batch_id: str, at: int) -> BatchEvents:
    return BatchEvents(
        batch_id, bronze=Event(at, f"bronze-{at}", True), silver=Event(at + 1, f"silver-{at}", True)
    )


def _pending(batch_id: str, at: int) -> BatchEvents:
    return BatchEvents(batch_id, bronze=Event(at, f"bronze-{at}", True))


def test_the_oldest_pending_batch_goes_first():
    decision = next_batch([_pending("b3", 30), _pending("b2", 20), _done("b1", 10)])
    assert decision.batch is not None and decision.batch.batch_id == "b2"


def test_blocked_and_failed_batches_do_not_hold_later_ones_back():
    blocked_in_bronze = BatchEvents("b1", bronze=Event(10, "r1", True), bronze_blocked=True)
    bronze_failed = BatchEvents("b2", bronze_attempt=Event(20, "r2", True))
    blocked_in_silver = BatchEvents(
        "b3", bronze=Event(30, "r3", True), silver=Event(31, "s3", True), silver_blocked=True
    )
    silver_failed = BatchEvents(
        "b4", bronze=Event(40, "r4", True), silver_attempt=Event(41, "s4", True)
    )
    states = [
        blocked_in_bronze,
        bronze_failed,
        blocked_in_silver,
        silver_failed,
        _pending("b5", 50),
    ]
    assert [stage(b) for b in states] == [
        Stage.BRONZE_BLOCKED,
        Stage.BRONZE_FAILED,
        Stage.SILVER_BLOCKED,
        Stage.SILVER_FAILED,
        Stage.PENDING,
    ]
    assert next_batch(states).batch.batch_id == "b5"
    assert unsettled_before(states, "b5") == []


def test_a_batch_whose_bronze_is_missing_or_in_flight_holds_later_ones_back():
    never_ran = BatchEvents("b1")
    queued = BatchEvents("b1", bronze_attempt=Event(10, "r1", False))
    checks_still_running = BatchEvents("b1", bronze=Event(10, "r1", False))
    for first, expected in (
        (never_ran, Stage.WAITING_FOR_BRONZE),
        (queued, Stage.BRONZE_IN_FLIGHT),
        (checks_still_running, Stage.BRONZE_IN_FLIGHT),
    ):
        assert stage(first) is expected
        decision = next_batch([first, _pending("b2", 20)])
        assert decision.batch is None and "b1" in decision.reason
        assert unsettled_before([first, _pending("b2", 20)], "b2") == [("b1", expected)]


def test_nothing_is_requested_while_a_silver_run_is_queued_or_running():
    queued = BatchEvents("b2", bronze=Event(20, "r2", True), silver_attempt=Event(25, "s2", False))
    decision = next_batch([_pending("b1", 10), queued])
    assert stage(queued) is Stage.SILVER_IN_FLIGHT
    assert decision.batch is None and "b2" in decision.reason
    checks_still_running = BatchEvents(
        "b1", bronze=Event(10, "r1", True), silver=Event(11, "s1", False)
    )
    assert stage(checks_still_running) is Stage.SILVER_IN_FLIGHT


def test_silver_older_than_bronze_is_pending_again():
    rerun_bronze = BatchEvents(
        "b1", bronze=Event(30, "r3", True), silver=Event(11, "s1", True), silver_blocked=True
    )
    assert stage(rerun_bronze) is Stage.PENDING
    failed_for_the_old_bronze = BatchEvents(
        "b1", bronze=Event(30, "r3", True), silver_attempt=Event(12, "s2", True)
    )
    assert stage(failed_for_the_old_bronze) is Stage.PENDING


def test_silver_that_failed_in_the_run_that_wrote_bronze_counts_as_failed():
    # One run planned both (as `pipeline-assets run` does): silver was planned before bronze
    # was written.
    same_run = BatchEvents("b1", bronze=Event(12, "r1", True), silver_attempt=Event(11, "r1", True))
    assert stage(same_run) is Stage.SILVER_FAILED


def test_nothing_left():
    decision = next_batch(
        [_done("b1", 10), BatchEvents("b2", bronze=Event(20, "r2", True), bronze_blocked=True)]
    )
    assert decision.batch is None and "done or excluded" in decision.reason
