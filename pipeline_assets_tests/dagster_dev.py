"""`make dev`, as README.md shows it, for the end-to-end tests of the UI, the GraphQL API and the
MLflow UI: the Dagster UI (a real `dagster dev`) and the MLflow UI on loopback, over a fresh
PIPELINE_HOME / DAGSTER_HOME with a small sample corpus in its landing zone and one ingest batch
registered; stopped as a user stops it, with Ctrl-C (SIGINT to the whole process group: make, the
webserver, the daemon, the code server and the MLflow UI)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.cli.headless import persistent_instance, register_batches
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.resources.settings import Settings
from pipeline_assets.sample_data.corpus import write_sample_corpus

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_SECONDS = 240


@dataclass(frozen=True)
class DagsterDev:
    home: Path
    port: int
    mlflow_port: int
    batch: str
    manifest: dict
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def _wait_until_serving(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        assert server.poll() is None, f"make dev exited with {server.returncode}:\n{_log_tail(log)}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(
        f"make dev did not serve the Dagster UI on 127.0.0.1:{port} "
        f"within {DEADLINE_SECONDS} s:\n{_log_tail(log)}"
    )


@contextmanager
def running_dagster_dev(tmp_path: Path, monkeypatch, records: int = 300) -> Iterator[DagsterDev]:
    """`make dev` on two free loopback ports, its Dagster UI serving once this yields (the MLflow UI
    may still be starting).

    The batch is registered before the server starts, so the landing sensor finds nothing new: the
    only runs are the ones a test launches (and what automation does downstream of them).
    """
    home = tmp_path / "home"
    manifest = write_sample_corpus(
        home / "landing", records=records, eval_sets_dir=home / "reference" / "eval_sets"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))
    }
    env.update(PIPELINE_HOME=str(home), DAGSTER_HOME=str(home / "dagster"))
    for name in ("PIPELINE_HOME", "DAGSTER_HOME"):
        monkeypatch.setenv(name, env[name])
    instance = persistent_instance(str(home / "dagster"))
    [batch] = register_batches(build_resources(Settings.from_env()), instance)

    port, mlflow_port = free_port(), free_port()
    log = tmp_path / "make-dev.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            ["make", "dev", f"DAGSTER_PORT={port}", f"MLFLOW_PORT={mlflow_port}"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until_serving(port, server, log)
        yield DagsterDev(
            home=home,
            port=port,
            mlflow_port=mlflow_port,
            batch=batch,
            manifest=manifest,
            log=log,
        )
    finally:
        _signal_group(server.pid, signal.SIGINT)  # `dagster dev` stops on SIGINT, not SIGTERM
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            _signal_group(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pid, sig)
