"""Rank 0's MLflow calls: relayed through the launching process (an asset's) or, run by hand,
logged by the job itself; the same run either way, and rank 0 never imports MLflow when relayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline_assets.resources.mlflow_tracking import MlflowResource

# A job's calls, as a trainer's rank 0 makes them; ``go`` (a path, or "") holds the job after its
# first metric until the file exists.
JOB = """
import json, sys, time
from pathlib import Path
from pipeline_assets.trainer.report import Reporter

run_id, lake, picture, go = sys.argv[1:5]
reporter = Reporter(run_id, "pipeline_assets")
reporter.params({"lr": 0.0003, "preset": "tiny"})
reporter.tags({"partition": "gold-v0"})
reporter.dataset(lake, 3, "gold/sequences")
reporter.metrics(0, {"loss": 2.5, "grad_norm": 1.0})
while go and not Path(go).exists():
    time.sleep(0.05)
reporter.metrics(5, {"loss": 1.25})
reporter.artifact(Path(picture))
reporter.finish({}, succeeded=sys.argv[5] == "ok")
print(json.dumps({"mlflow_loaded": "mlflow" in sys.modules, "run_id": reporter.mlflow_run_id}))
"""


@pytest.fixture
def tracking(tmp_path) -> MlflowResource:
    return MlflowResource(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "artifacts")
    )


def _job(env: dict, run_id: str, tmp_path: Path, go: str = "", outcome: str = "ok"):
    picture = tmp_path / "loss_curve.png"
    picture.write_bytes(b"\x89PNG a picture")
    return subprocess.Popen(
        [sys.executable, "-c", JOB, run_id, str(tmp_path / "lake"), str(picture), go, outcome],
        env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _finished(job) -> dict:
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def _logged(tracking: MlflowResource, run_id: str) -> dict:
    client = MlflowClient(tracking.resolved_tracking_uri())
    run = client.get_run(run_id)
    return {
        "status": run.info.status,
        "params": run.data.params,
        "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
        "metrics": {
            key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
            for key in run.data.metrics
        },
        "inputs": [
            (i.dataset.name, i.dataset.digest, json.loads(i.dataset.source), i.tags[0].value)
            for i in run.inputs.dataset_inputs
        ],
        "artifacts": [a.path for a in client.list_artifacts(run_id)],
    }


def _new_run(tracking: MlflowResource, name: str) -> str:
    return tracking.client().create_run(tracking.experiment_id(), run_name=name).info.run_id


def test_a_relayed_job_logs_what_a_job_run_by_hand_logs_and_never_loads_mlflow(tracking, tmp_path):
    by_hand = _new_run(tracking, "by hand")
    alone = _finished(
        _job({"MLFLOW_TRACKING_URI": tracking.resolved_tracking_uri()}, by_hand, tmp_path)
    )
    assert alone == {"mlflow_loaded": True, "run_id": by_hand}

    relayed = _new_run(tracking, "relayed")
    with tracking.relay(relayed, str(tmp_path / "scratch")) as env:
        through = _finished(_job(env, relayed, tmp_path))
    assert through == {"mlflow_loaded": False, "run_id": relayed}, "rank 0 never imports MLflow"
    assert not list((tmp_path / "scratch").iterdir()), "the outbox is removed"

    expected = _logged(tracking, by_hand)
    assert expected["status"] == "FINISHED"
    assert expected["metrics"] == {"loss": [(0, 2.5), (5, 1.25)], "grad_norm": [(0, 1.0)]}
    assert expected["inputs"][0][:2] == ("gold/sequences", "v3")
    assert expected["artifacts"] == ["loss_curve.png"]
    assert _logged(tracking, relayed) == expected


def test_a_relayed_metric_reaches_mlflow_while_the_job_runs(tracking, tmp_path):
    run_id, go = _new_run(tracking, "live"), tmp_path / "go"
    client = MlflowClient(tracking.resolved_tracking_uri())
    with tracking.relay(run_id, str(tmp_path / "scratch")) as env:
        job = _job(env, run_id, tmp_path, go=str(go), outcome="stopped")
        deadline = time.monotonic() + 60
        while not client.get_run(run_id).data.metrics and time.monotonic() < deadline:
            time.sleep(0.2)
        live = client.get_run(run_id).data.metrics
        go.touch()
        _finished(job)
    assert live == {"loss": 2.5, "grad_norm": 1.0}, "step 0's metrics, before the job went on"
    assert client.get_run(run_id).info.status == "KILLED", "a job that did not succeed"


def test_a_call_mlflow_refuses_fails_the_relay_after_the_job_with_mlflows_reason(
    tracking, tmp_path
):
    run_id = _new_run(tracking, "refused")
    tracking.client().log_param(run_id, "lr", "0.1")  # MLflow refuses a parameter changed
    with pytest.raises(Exception, match="lr"):
        with tracking.relay(run_id, str(tmp_path / "scratch")) as env:
            _finished(_job(env, run_id, tmp_path))
    assert not list((tmp_path / "scratch").iterdir())


def test_a_relayed_job_killed_before_its_end_leaves_its_run_killed_not_running(tracking, tmp_path):
    run_id = _new_run(tracking, "killed")
    client = MlflowClient(tracking.resolved_tracking_uri())
    with tracking.relay(run_id, str(tmp_path / "scratch")) as env:
        job = _job(env, run_id, tmp_path, go=str(tmp_path / "never"))
        deadline = time.monotonic() + 60
        while not client.get_run(run_id).data.metrics and time.monotonic() < deadline:
            time.sleep(0.2)
        job.kill()
        job.wait()
    run = client.get_run(run_id)
    assert run.data.metrics == {"loss": 2.5, "grad_norm": 1.0}, "what it logged before the kill"
    assert run.info.status == "KILLED"
