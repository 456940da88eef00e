"""Processes started together on a fresh PIPELINE_HOME: instance creation, and two
``pipeline-assets run``."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import traceback
from pathlib import Path

import polars as pl

from pipeline_assets.cli.headless import persistent_instance
from pipeline_assets_tests.conftest import cli_environment, record, write_landing_file


def test_two_runs_started_together_ingest_each_file_once(tmp_path):
    landing = tmp_path / "landing"
    for i in range(6):
        write_landing_file(
            landing, f"source{i % 2}", f"part-{i}.jsonl", [record(i * 10 + j) for j in range(3)]
        )
    command = [sys.executable, "-m", "pipeline_assets.cli.main", "run", "--select", "key:bronze/*"]
    runs = [
        subprocess.Popen(
            command,
            env=cli_environment(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (stdout, stderr) in zip(runs, outputs):
        assert run.returncode == 0, f"{stdout}\n{stderr}"
        assert "Traceback" not in stderr, stderr
    said = [
        line
        for stdout, _ in outputs
        for line in stdout.splitlines()
        if line.startswith("new ingest batches")
    ]
    assert len(said) == 2 and said.count("new ingest batches: none") == 1, (
        f"one registers, the other waits: {said}"
    )

    manifest = pl.read_delta(str(tmp_path / "lake" / "landing" / "manifest"))
    assert (
        manifest.height == 6
        and manifest["uri"].n_unique() == 6
        and manifest["batch_id"].n_unique() == 1
    )
    records = pl.read_delta(str(tmp_path / "lake" / "bronze" / "records"))
    assert records.height == 18
    assert records.select("source_file", "source_line").is_duplicated().sum() == 0


def _open_instances(root: str, rounds: int, start, results) -> None:
    """A worker: each round, with the other worker, open the instance of a fresh DAGSTER_HOME
    and use it."""
    for round_number in range(rounds):
        start.wait()
        try:
            instance = persistent_instance(str(Path(root) / f"dagster-{round_number}"))
            instance.get_dynamic_partitions("ingest_batches")
            results.put("ok")
        except Exception:
            results.put(traceback.format_exc(limit=3))


def test_processes_creating_one_instance_together_take_turns(tmp_path):
    rounds = 8
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_open_instances, args=(str(tmp_path), rounds, start, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in range(2 * rounds)]
    for worker in workers:
        worker.join(timeout=30)
    assert [o for o in outcomes if o != "ok"] == []
