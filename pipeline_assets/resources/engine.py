"""The data layers' engine: block stages on Ray Data, through dagster-ray's resource.

With ``RAY_ADDRESS`` set, every batch's block stages run on that cluster. Without it, a batch of at
least ``PIPELINE_RAY_MIN_ROWS`` rows starts a local Ray on this machine's cores for the step (its
temporary files and its token under ``PIPELINE_HOME/ray``, bound to 127.0.0.1, no dashboard, no
usage reporting) and stops it when the step ends; a smaller batch runs its blocks in the step's own
process, where starting Ray (10 to 30 s on two cores) would cost more than the work. The stages,
the blocks and the result are the same either way (``lib.stages``).

With ``PIPELINE_KUBERAY`` naming a file of dagster-ray ``KubeRayInteractiveJob`` settings, each step
that runs block stages gets its own KubeRay ``RayJob`` instead (created, waited for and connected to
by dagster-ray when the step starts), and every batch runs on it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import polars as pl
import yaml
from dagster import InitResourceContext
from dagster_ray import LocalRay, RayResource
from dagster_ray.kuberay import KubeRayInteractiveJob
from dagster_ray.kuberay.resources.rayjob import InteractiveRayJobConfig
from pydantic import Field, PrivateAttr

from pipeline_assets.lib.stages import (
    RAY_MIN_ROWS,
    ROWS_PER_BLOCK,
    Stage,
    StagesResult,
    from_row,
    merge,
    run_in_process,
    run_more,
    run_stages,
    split_at_actors,
    split_blocks,
    to_row,
)

# A block task holds one CPU (map_batches' default); polars would otherwise start a thread per core
# of its node in every task, and a node runs as many tasks as it has cores.
BLOCK_TASK_ENV = {"POLARS_MAX_THREADS": "1"}
T = TypeVar("T")
_MAX_TEMP_DIR_CHARS = 36


class BlockEngine(RayResource):
    """What silver and gold ask for: run block stages on Ray, or in this process where Ray would
    cost more than the work."""

    rows_per_block: int = ROWS_PER_BLOCK

    def uses_ray(self, rows: int) -> bool:
        return True

    def run(self, stages: Sequence[Stage], frame: pl.DataFrame) -> StagesResult:
        if frame.is_empty() or not self.uses_ray(frame.height):
            return run_in_process(stages, frame, self.rows_per_block)
        self._ensure_connected()
        return run_on_ray(stages, frame, self.rows_per_block)

    def map_tasks(
        self,
        function: Callable[..., T],
        calls: Sequence[tuple],
        batch_rows: int,
        shared: tuple = (),
    ) -> TaskResults[T]:
        """``function(*call, *shared)`` for each call, as Ray tasks wherever a batch of
        ``batch_rows`` runs its block stages on Ray, else here one after the other; results in call
        order. ``shared``: what every call is also given, put in Ray's object store once, not
        serialized again for each call."""
        started = time.perf_counter()
        if not calls or not self.uses_ray(batch_rows):
            done = [_timed(function, (*args, *shared)) for args in calls]
            return TaskResults(
                [r for r, _, _ in done],
                "this process",
                sum(s for _, s, _ in done),
                time.perf_counter() - started,
            )
        self._ensure_connected()
        import ray

        remote = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(
            _on_node
        )  # the bands over every node
        placed = tuple(ray.put(value) for value in shared)  # Ray hands tasks the values
        done = ray.get([remote.remote(function, *args, *placed) for args in calls])
        return TaskResults(
            [r for r, _, _ in done],
            f"Ray, {len({node for _, _, node in done})} node(s)",
            sum(s for _, s, _ in done),
            time.perf_counter() - started,
        )

    def map_through_actors(
        self,
        start: Callable[..., list[tuple[StagesResult, object]]],
        calls: Sequence[tuple],
        actor_stages: Sequence[Stage],
        finish: Callable[[StagesResult, object], T],
        shared: tuple = (),
    ) -> list[Pooled[T]]:
        """``run_through_actors`` on this engine's Ray (a batch whose stages run models)."""
        self._ensure_connected()
        return run_through_actors(start, calls, actor_stages, finish, shared)

    def _ensure_connected(self) -> None:
        """Connected when the step started (dagster-ray's lifecycle); never a Ray that Ray Data
        would start on this machine by itself."""
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                f"{self.display_name} is not connected: leave lifecycle.connect on (the default)"
            )


class RayEngine(BlockEngine, LocalRay):
    """Runs block stages: on the Ray cluster ``RAY_ADDRESS`` names, on a local Ray for large
    batches, or in this process."""

    home: str = Field(
        description="PIPELINE_HOME: a local Ray keeps its temporary files and token under "
        "<home>/ray"
    )
    min_rows: int = Field(
        default=RAY_MIN_ROWS,
        description="without RAY_ADDRESS, batches this large start a local Ray",
    )

    _init_context: InitResourceContext | None = PrivateAttr(default=None)

    @property
    def cluster_address(self) -> str | None:
        return os.environ.get("RAY_ADDRESS") or None

    @property
    def ray_address(self) -> str:  # dagster-ray's ray.init address: "local" starts a new local Ray
        return self.cluster_address or "local"

    @property
    def name(self) -> str:
        return f"Ray at {self.cluster_address}" if self.cluster_address else "a local Ray"

    def yield_for_execution(self, context: InitResourceContext):
        self._init_context = context
        return super().yield_for_execution(context)

    def _connect(self, context) -> None:
        """Not at the step's start: ``run`` connects when a batch needs Ray."""

    def uses_ray(self, rows: int) -> bool:
        return self.cluster_address is not None or rows >= self.min_rows

    def _ensure_connected(self) -> None:
        """ray.init once per step; dagster-ray's cleanup disconnects (and stops a local Ray) when
        the step ends."""
        options = (
            {} if self.cluster_address else local_ray_options(Path(self.home))
        )  # before ray reads its environment
        import ray

        if ray.is_initialized():
            return
        self.data_execution_options.apply()
        self._context = ray.init(
            address=self.ray_address,
            **init_arguments(options, self.ray_init_options, self.get_env_vars_to_inject()),
        )
        self.data_execution_options.apply()
        if self._init_context is not None and self._init_context.log is not None:
            self._init_context.log.info(f"block stages run on {self.name}")


class KubeRayEngine(BlockEngine, KubeRayInteractiveJob):
    """Runs every batch's block stages on a KubeRay ``RayJob`` that dagster-ray creates for the step
    (in interactive mode: the step's process is the Ray client) and cleans up after it."""

    def get_env_vars_to_inject(
        self,
    ) -> dict[str, str]:  # into the RayJob's pods and the job's runtime_env
        return {**BLOCK_TASK_ENV, **super().get_env_vars_to_inject()}

    @classmethod
    def from_file(cls, path: str) -> KubeRayEngine:
        """The engine from a YAML (or JSON) file of ``KubeRayInteractiveJob`` settings; a file that
        is missing, unreadable or has a field dagster-ray does not know fails here, naming the
        setting."""
        try:
            settings = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(settings, dict):
                raise ValueError("expected a mapping of KubeRayInteractiveJob fields")
            _refuse_unknown(settings, cls.model_fields, "")
            _refuse_unknown(
                settings.get("ray_job") or {}, InteractiveRayJobConfig.model_fields, "ray_job."
            )
            return cls(**settings)
        except (
            OSError,
            ValueError,
            yaml.YAMLError,
        ) as exc:  # pydantic's ValidationError is a ValueError
            raise ValueError(
                f"PIPELINE_KUBERAY={path}: not a KubeRayInteractiveJob configuration: {exc}"
            ) from exc


def _refuse_unknown(settings: dict, fields: dict, prefix: str) -> None:
    """Dagster's config would ignore a misspelt field; below ``ray_job.spec`` dagster-ray passes
    unknown fields on to the Kubernetes manifest, as KubeRay's own."""
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(prefix + name for name in unknown)}; known: "
            f"{', '.join(sorted(fields))}"
        )


LOCAL_RAY_TASK_EVENTS = 10_000


def init_arguments(ours: dict, users: Mapping, env_vars: Mapping[str, str]) -> dict:
    """ray.init's arguments: ``ours`` (``local_ray_options``; none on a cluster), then the user's
    ``ray_init_options`` (their ``_system_config`` merged over ours, key by key), with a runtime
    env whose variables are BLOCK_TASK_ENV, the user's, then ``env_vars``."""
    options, users = dict(ours), dict(users)
    if "_system_config" in options:
        options["_system_config"] = {
            **options["_system_config"],
            **(users.pop("_system_config", None) or {}),
        }
    runtime_env = dict(users.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {
        **BLOCK_TASK_ENV,
        **(runtime_env.get("env_vars") or {}),
        **env_vars,
    }
    return {**options, **users, "runtime_env": runtime_env}


def local_ray_options(home: Path) -> dict:
    """ray.init options (and environment) for a Ray on this machine that keeps to PIPELINE_HOME."""
    folder = home / "ray"
    folder.mkdir(parents=True, exist_ok=True)
    token = folder / "auth_token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
    # Read by ray.init and inherited by the processes it starts; Ray would otherwise write a token
    # under the user's home.
    os.environ.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0"
    )
    return {
        "num_cpus": os.cpu_count(),
        "include_dashboard": False,
        "_temp_dir": _short_path(folder / "tmp"),
        "_node_ip_address": "127.0.0.1",
        "logging_level": "WARNING",
        # Ray's GCS keeps the events of the last 100,000 tasks by default, 4 KB or more each:
        # a large batch's tasks grew it to a gigabyte. Nothing here reads them (no dashboard).
        "_system_config": {"task_events_max_num_task_in_gcs": LOCAL_RAY_TASK_EVENTS},
    }


@dataclass(frozen=True)
class TaskResults(Generic[T]):
    results: list[T]
    ran_on: str  # "this process", or how many Ray nodes
    task_seconds: float = 0.0  # the tasks' own seconds, summed: their work, wherever they ran
    wall_seconds: float = 0.0  # what the caller waited for them


def _timed(function: Callable, args: tuple) -> tuple:
    started = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - started, None


def _on_node(function: Callable, *args) -> tuple:
    import ray

    result, seconds, _ = _timed(function, args)
    return result, seconds, ray.get_runtime_context().get_node_id()


def run_on_ray(stages: Sequence[Stage], frame: pl.DataFrame, rows_per_block: int) -> StagesResult:
    """One Ray Data task per block, then the stages that run models on an actor pool, streamed
    behind them; results back in block order. The nodes that ran them and the polars threads each
    task had are in each stage's counters (``ray_nodes``, ``ray_polars_threads``)."""
    import pyarrow as pa
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    task_stages, actor_stages = split_at_actors(stages)

    def run_block(table: pa.Table) -> pa.Table:
        return pa.Table.from_pylist(
            [{**to_row(run_stages(task_stages, pl.from_arrow(table))), **_where()}]
        )

    blocks = [
        block.to_arrow(compat_level=pl.CompatLevel.oldest())
        for block in split_blocks(frame, rows_per_block)
    ]
    dataset = ray.data.from_arrow(blocks).map_batches(
        run_block, batch_size=None, batch_format="pyarrow"
    )
    if actor_stages:
        dataset = dataset.map_batches(
            ActorStages,
            fn_constructor_args=(actor_stages,),
            batch_size=1,
            batch_format="pyarrow",
            **actor_pool(ray.cluster_resources(), len(blocks)),
        )
    rows = dataset.take_all()
    merged = merge([from_row(row) for row in rows])
    where = {
        "ray_nodes": sorted({node for row in rows for node in row["nodes"].split(",")}),
        "ray_polars_threads": sorted({row["polars_threads"] for row in rows}),
    }
    return StagesResult(
        merged.kept, merged.removed, {name: {**c, **where} for name, c in merged.counters.items()}
    )


def _where() -> dict:
    import ray

    return {
        "nodes": ray.get_runtime_context().get_node_id(),
        "polars_threads": pl.thread_pool_size(),
    }


class ActorStages:
    """Ray Data's callable class for the stages that run models: one instance an actor, so each
    stage's model is loaded once an actor and kept for every block it is given. A row's other
    columns pass through; ``actor`` names the actor that ran it."""

    def __init__(self, stages: Sequence[Stage]):
        self.stages = stages

    def __call__(self, table):
        import pyarrow as pa
        import ray

        rows = []
        for row in table.to_pylist():
            result = run_more(self.stages, from_row(row))
            rows.append(
                {
                    **row,
                    **to_row(result),
                    "nodes": f"{row['nodes']},{_where()['nodes']}",
                    "actor": ray.get_runtime_context().get_actor_id(),
                }
            )
        return pa.Table.from_pylist(rows)


@dataclass(frozen=True)
class Pooled(Generic[T]):
    """One block's result through tasks, the actor pool and tasks again: which call it came from,
    the nodes it ran on and the actor that ran its model stages."""

    call: int
    value: T
    nodes: tuple[str, ...]
    actor: str
    polars_threads: int


def run_through_actors(
    start: Callable[..., list[tuple[StagesResult, object]]],
    calls: Sequence[tuple],
    actor_stages: Sequence[Stage],
    finish: Callable[[StagesResult, object], T],
    shared: tuple = (),
) -> list[Pooled[T]]:
    """One Ray Data pipeline over ``calls``: tasks run ``start(*call, *shared)`` (a result a block,
    with what the block carries to ``finish``), an actor pool runs ``actor_stages`` on each block's
    result (``run_more``, as ``run_on_ray``), and tasks run ``finish(result, carried)``. Frames
    move worker to worker; only ``finish``'s values come back, in call and block order.
    ``shared`` is put in Ray's object store once, not pickled into every call."""
    import pickle

    import pyarrow as pa
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False

    placed = [ray.put(value) for value in shared]

    def started(table: pa.Table) -> pa.Table:
        rows, shared_values = [], ray.get(placed)
        for call, args in zip(table["call"].to_pylist(), table["args"].to_pylist(), strict=True):
            for result, carried in start(*pickle.loads(args), *shared_values):
                rows.append(
                    {**to_row(result), "carried": pickle.dumps(carried), "call": call, **_where()}
                )
        return pa.Table.from_pylist(rows)

    def finished(table: pa.Table) -> pa.Table:
        rows = []
        for row in table.to_pylist():
            value = finish(from_row(row), pickle.loads(row["carried"]))
            nodes = f"{row['nodes']},{_where()['nodes']}"
            rows.append(
                {
                    "call": row["call"],
                    "value": pickle.dumps(value),
                    "nodes": nodes,
                    "actor": row["actor"],
                    "polars_threads": row["polars_threads"],
                }
            )
        return pa.Table.from_pylist(rows)

    items = [{"call": i, "args": pickle.dumps(args)} for i, args in enumerate(calls)]
    dataset = (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map_batches(started, batch_size=1, batch_format="pyarrow")
        .map_batches(
            ActorStages,
            fn_constructor_args=(list(actor_stages),),
            batch_size=1,
            batch_format="pyarrow",
            **actor_pool(ray.cluster_resources(), len(items)),
        )
        .map_batches(finished, batch_size=1, batch_format="pyarrow")
    )
    return [
        Pooled(
            row["call"],
            pickle.loads(row["value"]),
            tuple(sorted(set(row["nodes"].split(",")))),
            row["actor"],
            row["polars_threads"],
        )
        for row in dataset.take_all()
    ]


def actor_pool(cluster: dict, blocks: int) -> dict:
    """The pool that runs the model stages: a GPU an actor when the cluster has GPUs; else half its
    cores, one each, so that the task stages keep the other half. Never more actors than blocks."""
    gpus = int(cluster.get("GPU", 0))
    if gpus:
        return {"compute": _pool(min(gpus, blocks)), "num_gpus": 1}
    return {"compute": _pool(min(max(1, int(cluster.get("CPU", 1)) // 2), blocks)), "num_cpus": 1}


def _pool(size: int):
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(size=size)


def engine_used(counters: dict) -> str:
    """Where a block stage ran, from its counters: this process, or Ray's nodes and each task's
    polars threads."""
    if not counters.get("ray_nodes"):
        return "this process"
    threads = "/".join(map(str, counters["ray_polars_threads"]))
    return f"Ray, {len(counters['ray_nodes'])} node(s), {threads} polars thread(s) a task"


def _short_path(folder: Path) -> str:
    """``folder``, or a link to it in the system's temporary directory when the folder's path is too
    long for Ray's sockets (a Unix socket path holds at most 107 bytes, and Ray's session folder
    adds about 70)."""
    folder.mkdir(parents=True, exist_ok=True)
    if len(str(folder)) <= _MAX_TEMP_DIR_CHARS:
        return str(folder)
    name = f"pipeline-ray-{hashlib.sha256(str(folder).encode()).hexdigest()[:12]}"
    system_temp = Path(tempfile.gettempdir())  # long on macOS (/var/folders/...): then /tmp
    link = (
        system_temp if len(str(system_temp / name)) <= _MAX_TEMP_DIR_CHARS else Path("/tmp")
    ) / name
    if not link.is_symlink():
        link.symlink_to(folder, target_is_directory=True)
    return str(link)
