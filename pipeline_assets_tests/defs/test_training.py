"""materialize() of training/checkpoint: a real torchrun job (2 gloo ranks, tiny preset) on a gold
snapshot of the sample corpus, reporting through Pipes and tracked in MLflow on SQLite."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance, PipesSubprocessClient, materialize
from mlflow import MlflowClient

from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.training.assets import training_checkpoint
from pipeline_assets.defs.training.policy import TrainingPolicy
from pipeline_assets.lib.gold.manifest import read_manifest
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets.trainer.export import load_exported
from pipeline_assets_tests.defs.gold_helpers import build_gold
from pipeline_assets_tests.defs.test_gold import UPSTREAM, _ingest
from pipeline_assets_tests.trainer.launch import descendants

STEPS = 30


@pytest.fixture
def training_resources(resources, tmp_path) -> dict:
    return {
        **resources,
        "gold_policy": GoldPolicy(seq_len=256),
        "launcher": TorchrunLauncher(
            checkpoint_uri=str(tmp_path / "checkpoints"),
            nproc_per_node=2,
            scratch_dir=str(tmp_path / "scratch"),
        ),
        "training_policy": TrainingPolicy(
            steps=STEPS,
            warmup_steps=5,
            log_every=5,
            eval_every=30,
            checkpoint_every_steps=10,
            micro_batch_size=4,
        ),
        "mlflow_tracking": MlflowResource(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
            artifact_root=str(tmp_path / "mlartifacts"),
        ),
        "pipes_subprocess_client": PipesSubprocessClient(),
    }


@pytest.fixture
def snapshot(instance, training_resources, landing_dir, eval_sets_dir, tmp_path) -> str:
    staging = tmp_path / "staging"
    write_sample_corpus(staging, records=1500, eval_sets_dir=eval_sets_dir)
    shutil.copytree(staging, landing_dir, dirs_exist_ok=True)
    _ingest(instance, training_resources)
    assert build_gold(instance, training_resources, UPSTREAM).success
    return instance.get_dynamic_partitions(data_snapshots.name)[-1]


def _preempt_once(published: Path, timeout: float = 300) -> threading.Thread:
    """Once ``published`` appears, SIGTERM the torchrun job, as a spot node's preemption
    notice would."""

    def preempt():
        deadline = time.monotonic() + timeout
        while not published.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in descendants(os.getpid()):
            try:
                if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGTERM)
            except (OSError, ProcessLookupError):
                pass

    thread = threading.Thread(target=preempt, daemon=True)
    thread.start()
    return thread


def captured_stderr(instance: DagsterInstance, run_id: str) -> str:
    """What the run's processes wrote to stderr, as Dagster captured it (the UI's stderr tab)."""
    manager = instance.compute_log_manager
    return "".join(
        (
            manager.get_log_data(
                manager.build_log_key_for_run(
                    run_id, event.dagster_event.logs_captured_data.file_key
                )
            ).stderr
            or b""
        ).decode(errors="replace")
        for event in instance.all_logs(run_id, of_type=DagsterEventType.LOGS_CAPTURED)
    )


@pytest.mark.sqlite_instance  # compute logs: the ranks' output in the run's captured logs
def test_a_preempted_training_run_is_retried_resumes_and_tracks_everything(
    snapshot, instance, training_resources, tmp_path, monkeypatch
):
    # As in a run worker, sys.stderr is file descriptor 2, which Dagster's log capture redirects and
    # torchrun's processes inherit; pytest's own capture puts another file behind sys.stderr.
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    _preempt_once(tmp_path / "checkpoints" / snapshot / "step-10" / "COMPLETE.json")
    result = materialize(
        [training_checkpoint],
        partition_key=snapshot,
        instance=instance,
        resources=training_resources,
        selection=[training_checkpoint],
    )
    assert result.success
    metadata = {
        k: v.value
        for k, v in result.asset_materializations_for_node("training__checkpoint")[
            0
        ].metadata.items()
    }
    assert metadata["steps"] == STEPS and metadata["world_size"] == 2
    # 30 steps of the tiny preset: about a fifth off the first logged loss (8.69 -> 7.03 in one run
    # on one batch's shard); a trainer that does not learn stays within a few percent.
    assert metadata["final_loss"] < 0.85 * metadata["first_loss"], (
        "the loss falls on the sample corpus"
    )
    assert metadata["best_validation_loss"] is not None

    logs = " ".join(event.user_message for event in instance.all_logs(result.run_id))
    assert f"step {STEPS}/{STEPS}: loss" in logs, (
        "rank 0's step logs reach the run's logs through Pipes"
    )
    assert (
        "stopped by SIGTERM or SIGINT after saving a checkpoint" in logs
        or "stopped by a signal" in logs
    )
    assert "resumed from" in logs, (
        "the retry resumes from the checkpoint the preempted attempt saved"
    )
    captured = captured_stderr(instance, result.run_id)
    assert re.search(r"\[rank1\][^\n]*stopped by a signal", captured), (
        "rank 1's output reaches the run's captured logs"
    )

    client = MlflowClient(tracking_uri=training_resources["mlflow_tracking"].tracking_uri)
    run = client.get_run(metadata["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["pipeline.attempts"] == "2", "the retry continues the same MLflow run"
    assert (
        run.data.params["preset"] == "tiny"
        and run.data.params["world_size"] == "2"
        and "seed" in run.data.params
    )
    tags = run.data.tags
    assert tags["dagster_run_id"] == result.run_id and tags["partition"] == snapshot
    assert tags["delta.gold/snapshots"] == snapshot.removeprefix("gold-v")
    assert tags["delta.gold/sequences"] == str(
        read_manifest(training_resources["lake"].uri, 0).sequences_version
    )
    assert tags["data_snapshot"] == snapshot
    assert tags["delta.silver/records"].isdigit() and tags["delta.bronze/records"].isdigit()
    assert tags["git_commit"] and tags["torch_version"] and tags["device"] == "cpu"
    assert (
        tags["export_uri"].endswith(f"{snapshot}/final")
        and f"{snapshot}/step-{STEPS}" in tags["checkpoint_uris"]
    )
    assert len(client.get_metric_history(run.info.run_id, "loss")) == STEPS // 5
    for metric in ("learning_rate", "grad_norm", "tokens_per_second", "validation_loss"):
        assert client.get_metric_history(run.info.run_id, metric), metric
    assert "loss_curve.png" in {
        artifact.path for artifact in client.list_artifacts(run.info.run_id)
    }
    assert run.info.artifact_uri.startswith(str(tmp_path / "mlartifacts"))
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == [
        f"{snapshot}: gold/sequences@v{tags['delta.gold/sequences']}, 1 shard(s)"
    ]

    partition_dir = tmp_path / "checkpoints" / snapshot
    assert (partition_dir / f"step-{STEPS}" / "COMPLETE.json").exists()
    model, config = load_exported(partition_dir / "final")
    assert config["snapshot"] == int(snapshot.removeprefix("gold-v")) and config["steps"] == STEPS
    assert sum(p.numel() for p in model.parameters()) == metadata["parameters"]
