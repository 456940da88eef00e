"""``pipeline-assets run``: what the sensor and the daemon would do, in one foreground command.

Runs go into the persistent instance under ``DAGSTER_HOME``, so the UI shows them.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from dagster import (
    AssetCheckSeverity,
    AssetKey,
    AssetSelection,
    DagsterEventType,
    DagsterInstance,
    Definitions,
)

from pipeline_assets.cli.recovery import announce_pool_waits, process_tags, recover_dead_runs
from pipeline_assets.defs.automation import ONCE_WHEN_MISSING
from pipeline_assets.defs.check_helpers import partitions_failing
from pipeline_assets.defs.gold.assets import tokenizer_waits
from pipeline_assets.defs.gold.cadence import (
    PREFERENCE_SERIES,
    SFT_SERIES,
    SNAPSHOT_REASON_TAG,
    SnapshotSeries,
)
from pipeline_assets.defs.gold.sensors import no_reference_model, snapshot_waits
from pipeline_assets.defs.keys import (
    GOLD_TOKENIZER,
    OPS_PIPELINE_REPORT,
    REFERENCE_BASE_MODEL,
    REFERENCE_EVAL_SETS,
    REFERENCE_QUALITY_MODELS,
    RL_POLICY,
    RL_PROMPT_BANK,
    RL_REPLAY_BUFFER,
    TRAINING_HPARAM_SEARCH,
)
from pipeline_assets.defs.landing.batches import discover_batches
from pipeline_assets.defs.ops.report import report_waits
from pipeline_assets.defs.partitions import data_snapshots, ingest_batches
from pipeline_assets.defs.reference.assets import observation_is_current, observed_version
from pipeline_assets.defs.retries import STOPPED_BY_A_SIGNAL
from pipeline_assets.defs.rl.run import policy_waits
from pipeline_assets.lib.locks import FileLock

log = logging.getLogger("pipeline_assets")

# What runs only when a selection names it: the search (it costs several trainings) and the
# RL overlay.
RUN_WHEN_SELECTED = {TRAINING_HPARAM_SEARCH, RL_PROMPT_BANK, RL_POLICY, RL_REPLAY_BUFFER}
SERIES = (SFT_SERIES, PREFERENCE_SERIES)  # the snapshot series a run cuts, each on its cadence
# Step logs at INFO (per-file accounting, check results); DEBUG event chatter stays in the instance.
_RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


@dataclass
class RunOutcome:
    runs: list[str] = field(default_factory=list)  # run ids
    failed_runs: list[str] = field(default_factory=list)
    failed_blocking_checks: list[str] = field(default_factory=list)  # human-readable
    warnings: list[str] = field(default_factory=list)  # failed checks that do not block
    checks_passed: int = 0
    waiting: list[str] = field(default_factory=list)  # what could not run yet, and why

    @property
    def ok(self) -> bool:
        return not self.failed_runs and not self.failed_blocking_checks


# Local files under DAGSTER_HOME (always a local folder): the kernel releases them if a holder dies.
_INSTANCE_LOCK = ".pipeline-instance.lock"
_RUN_LOCK = ".pipeline-run.lock"
_INSTANCE_LOCK_TIMEOUT_SECONDS = 120.0


def persistent_instance(dagster_home: str) -> DagsterInstance:
    """The instance under DAGSTER_HOME, created with the project's dagster.yaml when missing.

    Processes that start together take turns: the first writes dagster.yaml and creates the SQLite
    storages, the others open what it created.
    """
    home = Path(dagster_home)
    with FileLock(home / _INSTANCE_LOCK, timeout=_INSTANCE_LOCK_TIMEOUT_SECONDS):
        config = home / "dagster.yaml"
        if not config.exists():
            partial = home / f".dagster.yaml.{os.getpid()}"
            with (
                files("pipeline_assets").joinpath("instance.yaml").open("rb") as template,
                partial.open("wb") as out,
            ):
                shutil.copyfileobj(template, out)
            partial.replace(config)  # a reader never sees half a file
        os.environ["DAGSTER_HOME"] = str(home)
        return DagsterInstance.get()  # creates the run, event log and schedule databases


def headless_instance(dagster_home: str, say: Callable[[str], None]) -> DagsterInstance:
    """The persistent instance, after marking failed the runs of ``pipeline-assets run`` processes
    that died and freeing their pool slots (see recovery.py)."""
    instance = persistent_instance(dagster_home)
    recover_dead_runs(instance, say)
    return instance


@contextmanager
def one_headless_run(dagster_home: str, say: Callable[[str], None]) -> Iterator[None]:
    """One ``pipeline-assets run`` per instance at a time: a second one waits for the first, then
    finds its batches registered and its partitions materialized."""

    def waiting(holder: str) -> None:
        say(f"waiting for the other `pipeline-assets run` on {dagster_home} ({holder}) to finish")

    with FileLock(Path(dagster_home) / _RUN_LOCK, timeout=None, on_wait=waiting):
        yield


def register_batches(resources: dict, instance: DagsterInstance) -> list[str]:
    """Discover new landing files exactly as landing_sensor does; returns the batches added."""
    known = instance.get_dynamic_partitions(ingest_batches.name)
    _, added = discover_batches(resources["landing"], resources["lake"], known, log)
    if added:
        instance.add_dynamic_partitions(ingest_batches.name, added)
    return added


def stale_partitions(
    defs: Definitions, instance: DagsterInstance, keys: list[AssetKey]
) -> dict[str, list[AssetKey]]:
    """Per ingest batch, the selected batch-partitioned assets to (re)materialize.

    Stale: never materialized for that batch, older than a batch-partitioned upstream's
    materialization of it (silver after bronze was redone by hand) or than an unpartitioned
    upstream's latest (every gold shard after a new tokenizer), or its latest blocking check failed
    there (so a batch blocked by schema drift is retried once the mapping is fixed).
    """
    graph = defs.resolve_asset_graph()
    batches = instance.get_dynamic_partitions(ingest_batches.name)
    blocked = partitions_failing(instance, _check_specs(defs))
    plan: dict[str, set[AssetKey]] = {}
    for key in [key for key in graph.toposorted_asset_keys if key in set(keys)]:
        node = graph.get(key)
        if not node.is_executable or node.partitions_def != ingest_batches:
            continue
        own = _latest_by_batch(instance, key)
        parents = [
            _latest_by_batch(instance, p)
            for p in node.parent_keys
            if graph.get(p).partitions_def == ingest_batches
        ]
        whole = [
            _latest_storage_id(instance, p)
            for p in node.parent_keys
            if _is_made_unpartitioned(graph, p)
        ]
        for batch in batches:
            if any(
                (batch, p) in blocked and p not in plan.get(batch, ()) for p in node.parent_keys
            ):
                continue  # its upstream failed a blocking check, and is not being redone here
            older = any(parent.get(batch, -1) > own.get(batch, -1) for parent in parents)
            older = older or any(latest > own.get(batch, -1) for latest in whole)
            if batch not in own or older or (batch, key) in blocked:
                plan.setdefault(batch, set()).update(node.execution_set_asset_keys)
    return {batch: sorted(plan[batch], key=AssetKey.to_user_string) for batch in sorted(plan)}


def _check_specs(defs: Definitions) -> list:
    """Every check spec: the checks defined apart and those an asset judges itself (gold's)."""
    return [
        spec
        for definition in [*(defs.assets or []), *(defs.asset_checks or [])]
        for spec in getattr(definition, "check_specs", ())
    ]


def _latest_by_batch(instance: DagsterInstance, key: AssetKey) -> dict[str, int]:
    """Per batch, the storage id (which orders events) of the latest materialization of ``key``."""
    return dict(
        instance.event_log_storage.get_latest_storage_id_by_partition(
            key, DagsterEventType.ASSET_MATERIALIZATION
        )
    )


def _latest_storage_id(instance: DagsterInstance, key: AssetKey) -> int:
    record = instance.fetch_materializations(key, limit=1).records
    return record[0].storage_id if record else -1


def _is_made_unpartitioned(graph, key: AssetKey) -> bool:
    node = graph.get(key)
    return node.is_materializable and node.partitions_def is None


def _missing_unpartitioned(graph, instance: DagsterInstance, key: AssetKey) -> list[AssetKey]:
    """What a batch-partitioned asset reads of the unpartitioned assets the pipeline makes and has
    not made yet."""
    node = graph.get(key)
    if node.partitions_def != ingest_batches:
        return []
    return [
        p
        for p in node.parent_keys
        if _is_made_unpartitioned(graph, p) and _latest_storage_id(instance, p) < 0
    ]


def stale_unpartitioned(
    defs: Definitions, instance: DagsterInstance, keys: list[AssetKey], explicit: bool = False
) -> list[AssetKey]:
    """Selected unpartitioned assets never materialized, or older than an upstream materialization;
    the RL overlay only when selected explicitly."""
    graph = defs.resolve_asset_graph()

    def latest(key: AssetKey) -> float | None:
        event = instance.get_latest_materialization_event(key)
        return None if event is None else event.timestamp

    stale = []
    for key in keys:
        node = graph.get(key)
        if (
            not node.is_materializable
            or node.partitions_def is not None
            or (key in RUN_WHEN_SELECTED and not explicit)
        ):
            continue
        own = latest(key)
        if own is not None and _made_once(node):
            continue
        upstream = [t for t in (latest(parent) for parent in node.parent_keys) if t is not None]
        if (
            own is None
            or any(t > own for t in upstream)
            or any(k in stale for k in node.parent_keys)
        ):
            stale.append(key)
    return stale


def missing_snapshot_partitions(
    defs: Definitions,
    instance: DagsterInstance,
    keys: list[AssetKey],
    explicit: bool = False,
    series: SnapshotSeries = SFT_SERIES,
) -> dict[str, list[AssetKey]]:
    """Per snapshot of the series, the selected assets partitioned by it never materialized for it.
    The hyperparameter search, which costs several trainings, runs only when selected explicitly."""
    graph = defs.resolve_asset_graph()
    plan: dict[str, list[AssetKey]] = {}
    for key in keys:
        node = graph.get(key)
        if not node.is_executable or node.partitions_def != series.partitions:
            continue
        if key in RUN_WHEN_SELECTED and not explicit:
            continue
        done = instance.get_materialized_partitions(key)
        for snapshot in instance.get_dynamic_partitions(series.partitions.name):
            if snapshot not in done:
                plan.setdefault(snapshot, []).append(key)
    return plan


def _after_snapshots(graph, key: AssetKey) -> bool:
    """Whether an unpartitioned asset reads snapshot-partitioned ones: it runs after them."""
    seen, stack = set(), list(graph.get(key).parent_keys)
    while stack:
        parent = stack.pop()
        if parent in seen:
            continue
        seen.add(parent)
        node = graph.get(parent)
        if node.partitions_def == data_snapshots:
            return True
        stack.extend(node.parent_keys)
    return False


def _made_once(node) -> bool:
    """Assets automation makes only when missing (the tokenizer: retraining it changes every token
    id)."""
    condition = node.automation_condition
    return condition is not None and condition.get_label() == ONCE_WHEN_MISSING


def run_stale(defs: Definitions, instance: DagsterInstance, selection: str | None) -> RunOutcome:
    graph = defs.resolve_asset_graph()
    chosen = AssetSelection.from_string(selection) if selection else AssetSelection.all()
    keys = sorted(chosen.resolve(graph), key=lambda k: k.to_user_string())
    job = defs.resolve_implicit_global_asset_job_def()
    outcome = RunOutcome()
    for source in (REFERENCE_EVAL_SETS, REFERENCE_BASE_MODEL, REFERENCE_QUALITY_MODELS):
        if _reads_source(defs, keys, source):
            observe_source(defs, instance, outcome, source)
    # gold/sequences reads gold/tokenizer: while that is missing, shards wait for a pass after it is
    # made; otherwise a batch's shard is built in the same run as its bronze and silver.
    shards = [key for key in keys if _missing_unpartitioned(graph, instance, key)]
    for batch, batch_keys in stale_partitions(
        defs, instance, [key for key in keys if key not in shards]
    ).items():
        _execute(job, instance, batch_keys, outcome, partition=batch)
    selected = set(keys)
    ordered = [key for key in graph.toposorted_asset_keys if key in selected]
    # e.g. ops/pipeline_report; rl/replay_buffer with rl/policy, which reads the sft champion
    late = [
        key
        for key in ordered
        if any(_after_snapshots(graph, k) for k in graph.get(key).execution_set_asset_keys)
    ]
    cuts = {
        series.snapshots for series in SERIES
    }  # cut on their cadence below, never just for being older
    early = stale_unpartitioned(
        defs,
        instance,
        [key for key in ordered if key not in late and key not in cuts],
        bool(selection),
    )
    early = ready(defs, instance, early, outcome)
    if early:
        _execute(job, instance, early, outcome, partition=None)
    shards = ready(defs, instance, shards, outcome)
    for batch, batch_keys in stale_partitions(defs, instance, shards).items():
        _execute(job, instance, batch_keys, outcome, partition=batch)
    for (
        series
    ) in SERIES:  # the sft series first: its champion is DPO's reference and starting point
        if series.snapshots in selected:
            cut_snapshot_if_due(defs, instance, job, outcome, series=series)
        for snapshot, snapshot_keys in missing_snapshot_partitions(
            defs, instance, ordered, bool(selection), series
        ).items():
            _execute(job, instance, snapshot_keys, outcome, partition=snapshot)
    reports = ready(
        defs, instance, stale_unpartitioned(defs, instance, late, bool(selection)), outcome
    )
    if reports:
        _execute(job, instance, reports, outcome, partition=None)
    return outcome


def _waits(
    defs: Definitions, instance: DagsterInstance
) -> dict[AssetKey, Callable[[], str | None]]:
    """Per asset that can find nothing to work on yet, why it waits (None: it can run). Each is the
    asset's own refusal, asked before its run so that a headless run skips it with the reason."""
    resources = defs.resources
    return {
        GOLD_TOKENIZER: lambda: tokenizer_waits(
            resources["lake"], resources["gold_policy"], resources.get("base_model")
        ),
        OPS_PIPELINE_REPORT: lambda: report_waits(instance),
        RL_POLICY: lambda: policy_waits(resources["mlflow_tracking"], resources["registry_policy"]),
    }


def ready(
    defs: Definitions, instance: DagsterInstance, keys: list[AssetKey], outcome: RunOutcome
) -> list[AssetKey]:
    """``keys`` less those that wait (with what runs with them, and a batch-partitioned asset whose
    unpartitioned upstream is still missing); each wait is logged and kept in ``outcome``."""
    graph = defs.resolve_asset_graph()
    rules, waiting = _waits(defs, instance), {}
    for key in keys:
        if key in waiting:
            continue
        members = graph.get(key).execution_set_asset_keys
        missing = _missing_unpartitioned(graph, instance, key)
        reasons = [rules[member]() for member in members if member in rules]
        if missing:
            reasons.append(f"{', '.join(k.to_user_string() for k in missing)} is not made yet")
        reason = next((r for r in reasons if r is not None), None)
        if reason is not None:
            waiting.update(dict.fromkeys(members, reason))
    for key, reason in waiting.items():
        said = f"{key.to_user_string()} waits: {reason}"
        log.info(said)
        outcome.waiting.append(said)
    return [key for key in keys if key not in waiting]


def cut_snapshot_if_due(
    defs: Definitions,
    instance: DagsterInstance,
    job,
    outcome: RunOutcome,
    by_hand: str = "",
    series: SnapshotSeries = SFT_SERIES,
) -> None:
    """The series' snapshot asset on its cadence sensor's rule, or at once when ``by_hand`` says
    why."""
    reason = by_hand
    if not by_hand:
        resources = defs.resources
        decision, waiting = snapshot_waits(
            instance,
            series,
            resources["gold_policy"],
            resources["batch_gates"],
            lambda: no_reference_model(
                resources["mlflow_tracking"], resources["registry_policy"], resources["base_model"]
            ),
        )
        if waiting:
            what = "data snapshot" if series is SFT_SERIES else "preference snapshot"
            log.info("no new %s: %s", what, waiting)
            return
        reason = decision.reason
    _execute(
        job,
        instance,
        [series.snapshots],
        outcome,
        partition=None,
        tags={SNAPSHOT_REASON_TAG: reason},
    )


def observe_eval_sets(
    defs: Definitions, instance: DagsterInstance, outcome: RunOutcome
) -> str | None:
    """Observe reference/eval_sets when its files differ from the version last observed, so silver
    records the version it decontaminates against; returns that data version (None: not observable
    or not observed)."""
    return observe_source(defs, instance, outcome, REFERENCE_EVAL_SETS)


def observe_source(
    defs: Definitions, instance: DagsterInstance, outcome: RunOutcome, key: AssetKey
) -> str | None:
    """Observe a reference source when its files changed since its last observation (or it was
    never observed); returns its data version (None: not observable, or the observation
    failed)."""
    graph = defs.resolve_asset_graph()
    if not graph.has(key) or not graph.get(key).is_observable:
        return None
    if observation_is_current(defs.resources, instance, key):
        return observed_version(instance, key)
    failures = len(outcome.failed_runs)
    _execute(defs.resolve_implicit_global_asset_job_def(), instance, [key], outcome, partition=None)
    return None if len(outcome.failed_runs) > failures else observed_version(instance, key)


def _reads_source(defs: Definitions, keys: list[AssetKey], source: AssetKey) -> bool:
    graph = defs.resolve_asset_graph()
    return graph.has(source) and bool({source, *graph.get(source).child_keys} & set(keys))


def _execute(
    job,
    instance: DagsterInstance,
    keys: list[AssetKey],
    outcome: RunOutcome,
    partition: str | None,
    tags: dict[str, str] | None = None,
) -> None:
    snapshot = partition and partition.startswith(tuple(series.kind.prefix for series in SERIES))
    where = (
        (f"snapshot {partition}" if snapshot else f"batch {partition}")
        if partition
        else "all batches"
    )
    graph = job.asset_layer.asset_graph
    # a multi-asset that cannot be subset runs whole (rl/policy with rl/replay_buffer)
    keys = sorted(
        {k for key in keys for k in graph.get(key).execution_set_asset_keys},
        key=AssetKey.to_user_string,
    )
    log.info("materializing %s for %s", ", ".join(k.to_user_string() for k in keys), where)
    announce_pool_waits(
        instance, [pool for key in keys for pool in graph.get(key).pools or ()], log.info
    )
    result = job.execute_in_process(
        run_config=_RUN_CONFIG,
        instance=instance,
        partition_key=partition,
        asset_selection=keys,
        raise_on_error=False,
        tags={**process_tags(), **(tags or {})},
    )
    outcome.runs.append(result.run_id)
    if _interrupted(result):
        raise RunInterrupted(
            f"run {result.run_id} for {where} was interrupted and is marked "
            f"{instance.get_run_by_id(result.run_id).status.value.lower()}"
        )
    if not result.success:
        failures = [
            f"{_assets_of_step(job, event)} failed for {where}: "
            f"{_failure_reason(event.event_specific_data.error)}"
            for event in result.get_step_failure_events()
        ]
        outcome.failed_runs.extend(
            [f"{failure} (run {result.run_id})" for failure in failures]
            or [f"run {result.run_id} for {where} failed: see the run in the UI"]
        )
    for check in result.get_asset_check_evaluations():
        said = (
            f"{check.asset_key.to_user_string()}:{check.check_name} failed for {where}: "
            f"{check.description}"
        )
        if check.passed:
            outcome.checks_passed += 1
        elif check.blocking and check.severity == AssetCheckSeverity.ERROR:
            outcome.failed_blocking_checks.append(said)
        else:
            outcome.warnings.append(said)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run: the headless command stops too, instead of starting the
    next."""


def _interrupted(result) -> bool:
    for event in result.get_step_failure_events():
        error = event.event_specific_data.error
        while error is not None:
            if (
                error.cls_name in ("DagsterExecutionInterruptedError", "KeyboardInterrupt")
                or STOPPED_BY_A_SIGNAL in error.message
            ):
                return True
            error = error.cause
    return False


def _assets_of_step(job, event) -> str:
    """The assets a failed step materializes, as a user names them (``gold/sequences``)."""
    try:
        keys = job.asset_layer.get_assets_def_for_node(event.node_handle).keys
    except Exception:  # a step that materializes no asset (an asset check's op): its own name
        return event.step_key
    return ", ".join(sorted(key.to_user_string() for key in keys))


def _failure_reason(error) -> str:
    """The step's own words (``reading landing file ... failed``), behind Dagster's wrappers
    ("Exceeded max_retries", "Error occurred while executing op"); a refusal (``Failure``) is its
    description, any other exception its class and message, so a bug reads as one."""
    retried = ""
    while error.cause is not None and (
        error.message.startswith("Exceeded max_retries")
        or error.cls_name == "DagsterExecutionStepExecutionError"
    ):
        if error.message.startswith("Exceeded max_retries"):
            retried = f" ({error.message.strip().lower()})"
        error = error.cause
    name, line = error.cls_name or "", error.message.strip().splitlines()[0]
    kind, _, words = line.partition(": ")
    if not (words and name and kind.endswith(name)):
        return line + retried
    return (words if name == "Failure" else f"{name}: {words}") + retried
