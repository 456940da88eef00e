"""`make dev`, as README.md shows it: the Dagster UI and the MLflow UI on loopback until Ctrl-C.

Apart from test_documented_commands.py's story (which lists it as run here): the two share nothing,
and each file runs on one pytest-xdist worker, so the story's file is the shorter for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from pipeline_assets_tests.conftest import cli_environment
from pipeline_assets_tests.dagster_dev import free_port

ROOT = Path(__file__).resolve().parents[1]


def _answer(url: str, body: bytes | None = None, deadline: float = 240) -> bytes:
    """The first answer of ``url`` (a POST of ``body`` when given) within ``deadline`` seconds."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    stop = time.monotonic() + deadline
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read()
        except OSError:
            if time.monotonic() > stop:
                raise
            time.sleep(1)


def test_make_dev(tmp_path):
    """`make dev` serves the Dagster UI, whose GraphQL API shows the graph, and the MLflow UI, both
    on loopback; Ctrl-C stops both."""
    dagster_port, mlflow_port = free_port(), free_port()
    process = subprocess.Popen(
        ["make", "dev", f"DAGSTER_PORT={dagster_port}", f"MLFLOW_PORT={mlflow_port}"],
        cwd=ROOT,
        env=cli_environment(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert _answer(f"http://127.0.0.1:{mlflow_port}/health") == b"OK"
        query = json.dumps({"query": "{ assetNodes { assetKey { path } } }"}).encode()
        nodes = json.loads(_answer(f"http://127.0.0.1:{dagster_port}/graphql", query))
        keys = {"/".join(n["assetKey"]["path"]) for n in nodes["data"]["assetNodes"]}
        assert {"bronze/records", "registry/model_version", "rl/policy"} <= keys
    finally:
        os.killpg(process.pid, signal.SIGINT)  # `dagster dev` stops on SIGINT, not SIGTERM
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
