"""Shared fixtures: a throwaway lake and landing zone, a test Dagster instance, small corpora."""

from __future__ import annotations

import gzip
import io
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import boto3
import orjson
import polars as pl
import pytest
import zstandard
from dagster import DagsterInstance, instance_for_test

from pipeline_assets.defs.bronze.policy import IngestPolicy
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.policies import CostPolicy, SilverPolicy
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.engine import RayEngine
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.quality_models import QualityModelsResource
from pipeline_assets_tests.s3_server import S3Server

# The files that take longest (a daemon, dagster dev, torchrun jobs, many materializations), longest
# first by their time in a full run: started last, as alphabetical order would, they leave one
# pytest-xdist worker alone.
LONGEST_FIRST = [
    "test_documented_commands.py",
    "defs/test_registry.py",
    "trainer/test_torchrun.py",
    "defs/test_silver.py",
    "test_base_model.py",
    "test_first_user.py",
    "defs/test_gold.py",
    "trainer/test_rl_learning.py",
    "test_recovery.py",
    "test_daemon.py",
    "defs/test_rl_policy.py",
    "test_s3_end_to_end.py",
    "defs/test_ray_engine.py",
    "defs/test_quality_models.py",
    "test_ui_browser.py",
    "trainer/test_dpo_training.py",
    "defs/test_training.py",
    "defs/test_bronze.py",
    "trainer/test_hparam_search.py",
    "defs/test_conversations.py",
    "defs/test_preference_pairs.py",
    "test_appended_export.py",
    "trainer/test_rl_job.py",
    "defs/test_eval_sets.py",
    "defs/test_quality_models_source.py",
    "test_cli.py",
    "sample_data/test_corpus.py",
    "defs/test_registration_race.py",
    "test_concurrent_runs.py",
    "test_ingest_faults.py",
    "defs/test_s3.py",
]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent

    def rank(item) -> int:
        name = Path(item.fspath).relative_to(here).as_posix()
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and among the rest, stays


def cli_environment(home: Path, **env: str) -> dict[str, str]:
    """This process's environment for the project's commands, with everything under ``home``
    (PIPELINE_HOME).

    Short one-rank training, and a gate that lets any candidate through: the end-to-end tests check
    the commands, the sensors and the story between them. The two-rank FSDP path has its own tests
    (trainer/test_torchrun.py, defs/test_training.py), the gate too (lib/training/test_promotion.py,
    defs/test_registry.py).
    """
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))
    }
    short = dict(
        PIPELINE_HOME=str(home),
        PIPELINE_TRAIN_STEPS="6",
        PIPELINE_DPO_STEPS="6",
        PIPELINE_TRAIN_NPROC="1",
        PIPELINE_PROMOTION_MARGIN="-1",
        # the search and the RL overlay as small: their defaults are kept, their sizes cut. One
        # rung of two trials (successive halving's later rungs: trainer/test_hparam_search.py,
        # defs/test_registry.py); one GRPO update of groups of 4 (learning:
        # trainer/test_rl_learning.py). Each trial is a torchrun launch, each update 256
        # completions sampled at the default group size of 8.
        PIPELINE_SEARCH_TRIALS="2",
        PIPELINE_SEARCH_MIN_STEPS="2",
        PIPELINE_SEARCH_MAX_STEPS="2",
        PIPELINE_RL_UPDATES="1",
        PIPELINE_RL_GROUP_SIZE="4",
        PIPELINE_RL_WARM_START_MAX_STEPS="5",
        PIPELINE_SLICE_TOLERANCE="1",
    )
    environment.update(short, **env)  # what a test sets wins
    return environment


def run_cli(home: Path, *args: str, timeout: float = 300, **env: str):
    """``pipeline-assets ARGS`` in a fresh process, as a user runs it, everything under ``home``."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli.main", *args],
        env=cli_environment(home, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def record(i: int, **fields) -> dict:
    base = {
        "id": f"r{i}",
        "prompt": f"Question number {i}: how does item {i} work?",
        "response": f"Item {i} works by doing step one, then step two, then step {i}.",
        "created_at": "2026-11-20T10:00:00Z",
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def jsonl_bytes(rows: list) -> bytes:
    return b"".join((row if isinstance(row, bytes) else orjson.dumps(row)) + b"\n" for row in rows)


def write_landing_file(landing: Path, source: str, name: str, rows: list) -> Path:
    """Write rows (dicts, or raw bytes lines) in the format the file name says."""
    path = landing / source / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if name.endswith(".parquet"):
        buffer = io.BytesIO()
        pl.DataFrame(rows).write_parquet(buffer)
        path.write_bytes(buffer.getvalue())
        return path
    data = jsonl_bytes(rows)
    if name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


@pytest.fixture
def landing_dir(tmp_path: Path) -> Path:
    path = tmp_path / "landing"
    path.mkdir()
    return path


@pytest.fixture
def lake(tmp_path: Path) -> LakeResource:
    return LakeResource(uri=str(tmp_path / "lake"))


@pytest.fixture
def landing(landing_dir: Path) -> LandingResource:
    return LandingResource(uri=str(landing_dir))


@pytest.fixture
def eval_sets_dir(tmp_path: Path) -> Path:
    path = tmp_path / "eval_sets"
    path.mkdir()
    return path


@pytest.fixture
def resources(lake, landing, eval_sets_dir, tmp_path) -> dict:
    return {
        "lake": lake,
        "landing": landing,
        "ingest_policy": IngestPolicy(),
        "eval_sets": EvalSetsResource(uri=str(eval_sets_dir)),
        "silver_policy": SilverPolicy(),
        "quality_models": QualityModelsResource(),
        "batch_gates": batch_gates(),
        "ray_engine": RayEngine(home=str(tmp_path / "home")),
        "gold_policy": GoldPolicy(),
        "base_model": BaseModelResource(uri=""),  # none: the built-in chat format
        "cost_policy": CostPolicy(),
    }


@pytest.fixture
def instance(request, tmp_path):
    """What ``materialize()`` runs on by default: an ephemeral instance, its runs and events in
    memory (half the time of a SQLite one a materialization). A test marked ``sqlite_instance``
    gets an on-disk SQLite instance, as every command, the daemon and the UI run on: for what only
    it keeps (compute logs) or gives (a reference to rebuild it from, as a schedule's context
    asks)."""
    if request.node.get_closest_marker("sqlite_instance"):
        with instance_for_test() as dagster_instance:
            yield dagster_instance
        return
    with DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster")) as dagster_instance:
        yield dagster_instance


BUCKET = "pipeline"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def s3_endpoint(monkeypatch):
    with S3Server(_free_port()) as endpoint:
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        )  # state is per process
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield endpoint
