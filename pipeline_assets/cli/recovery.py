"""Runs of ``pipeline-assets run`` whose process died (SIGKILL, the OOM killer, a lost machine).

Such a run stays STARTED in the instance and keeps its pool slots, so the next run would wait for
them forever. Each headless run records its process (pid, host, boot id, start time) as run tags;
the next ``pipeline-assets run`` marks the runs whose process is gone as failed and frees their
slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

from pipeline_assets.lib.ops.processes import ProcessIdentity

_TAG_PREFIX = "pipeline_assets/process_"
_UNFINISHED = [
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]


def process_tags() -> dict[str, str]:
    """Run tags naming this process, so a later run can tell whether it is still there."""
    identity = ProcessIdentity.current()
    return {f"{_TAG_PREFIX}{name}": str(value) for name, value in vars(identity).items()}


def run_process(run: DagsterRun) -> ProcessIdentity | None:
    """The process that ran ``run`` (None: not started by ``pipeline-assets run``)."""
    values = {
        name: run.tags.get(f"{_TAG_PREFIX}{name}") for name in ("pid", "host", "boot_id", "started")
    }
    if values["pid"] is None or values["host"] is None:
        return None
    return ProcessIdentity(
        pid=int(values["pid"]),
        host=values["host"],
        boot_id=values["boot_id"] or "",
        started=values["started"] or "",
    )


def recover_dead_runs(instance: DagsterInstance, say: Callable[[str], None]) -> list[str]:
    """Mark failed every unfinished headless run whose process is gone and free its pool slots;
    returns their run ids."""
    recovered = []
    for run in instance.get_runs(RunsFilter(statuses=_UNFINISHED)):
        process = run_process(run)
        if process is None or not process.is_gone():
            continue
        pools = _pools_held(instance, run.run_id)
        freed = (
            f"freed its {', '.join(pools)} slot{'s' if len(pools) > 1 else ''}"
            if pools
            else "it held no pool slot"
        )
        message = (
            f"run {run.run_id} (pid {process.pid} on host {process.host}) is gone: marked failed, "
            f"{freed}"
        )
        instance.report_run_failed(run, message=message)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        say(message)
        recovered.append(run.run_id)
    return recovered


def announce_pool_waits(
    instance: DagsterInstance, pools: Iterable[str], say: Callable[[str], None]
) -> None:
    """Say which runs hold the slots a step is about to wait for (Dagster logs the wait at
    DEBUG)."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return
    for pool in sorted(set(pools)):
        info = storage.get_concurrency_info(pool)
        if info.limit is None or info.active_slot_count < info.limit:
            continue
        holders = ", ".join(_describe(instance, run_id) for run_id in sorted(info.active_run_ids))
        say(f"waiting for a slot of pool {pool!r} (limit {info.limit}): held by {holders}")


def _describe(instance: DagsterInstance, run_id: str) -> str:
    run = instance.get_run_by_id(run_id)
    process = run_process(run) if run else None
    where = f"pid {process.pid} on host {process.host}" if process else "not a pipeline-assets run"
    return f"run {run_id} ({where})"


def _pools_held(instance: DagsterInstance, run_id: str) -> list[str]:
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    return sorted(
        pool
        for pool in storage.get_concurrency_keys()
        if run_id in storage.get_concurrency_info(pool).active_run_ids
    )
