"""Training, evaluation and the registry together on the sample corpus: the promotion gate, manual
promote and rollback, lineage, and identical data when a snapshot is trained again. One scenario,
in order, because each step needs the registry the one before left."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import polars as pl
import pytest
from dagster import materialize
from mlflow import MlflowClient

from pipeline_assets.cli import main as cli
from pipeline_assets.defs.evaluation.assets import evaluation_report
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.registry.assets import PROMOTION_GATE, registry_model_version
from pipeline_assets.defs.training.assets import training_checkpoint
from pipeline_assets.defs.training.policy import HparamSearchPolicy
from pipeline_assets.defs.training.search import hparam_search
from pipeline_assets.lib.gold.manifest import read_manifest
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets_tests.defs.gold_helpers import shard_new_batches_and_cut
from pipeline_assets_tests.defs.test_gold import UPSTREAM
from pipeline_assets_tests.defs.test_training import (  # noqa: F401 (fixtures)
    snapshot,
    training_resources,
)
from pipeline_assets_tests.hf_models import assert_servable

MODEL = "sft-model"
FIRST_STEPS = 12  # the first champion's; the better candidate trains three times as long
DOWNSTREAM = [training_checkpoint, evaluation_report, registry_model_version]


@pytest.fixture
def registry_resources(training_resources, tmp_path) -> dict:  # noqa: F811
    """One rank per job: this file is about the registry (the two-rank path:
    defs/test_training.py)."""
    search = HparamSearchPolicy(
        space={"lr": [1e-4, 6e-3]}, trials=2, min_steps=5, max_steps=10, eta=2
    )
    launcher = TorchrunLauncher(
        checkpoint_uri=str(tmp_path / "checkpoints"),
        nproc_per_node=1,
        scratch_dir=str(tmp_path / "scratch"),
    )
    return {
        **training_resources,
        "launcher": launcher,
        "registry_policy": RegistryPolicy(model_name=MODEL),
        "hparam_search_policy": search,
    }


def _train_evaluate_register(instance, resources, partition: str, steps: int):
    return materialize(
        [eval_sets, *DOWNSTREAM],
        selection=DOWNSTREAM,
        partition_key=partition,
        instance=instance,
        resources=resources,
        raise_on_error=False,
        run_config={"ops": {"training__checkpoint": {"config": {"steps": steps}}}},
    )


def _new_snapshot(instance, resources) -> str:
    assert shard_new_batches_and_cut(instance, resources, UPSTREAM).success
    return instance.get_dynamic_partitions(data_snapshots.name)[-1]


def _metadata(result, node: str) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node(node)[0].metadata.items()}


def _gate(result):
    [evaluation] = [
        c for c in result.get_asset_check_evaluations() if c.check_name == PROMOTION_GATE
    ]
    return evaluation


def _cli(monkeypatch, capsys, resources, tmp_path, *args: str) -> tuple[int, str, str]:
    """The command run in this process (test_cli.py runs it as a subprocess): exit code,
    stdout, stderr."""
    for name in [k for k in os.environ if k.startswith(("PIPELINE_", "MLFLOW_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIPELINE_LAKE_URI", resources["lake"].uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", resources["mlflow_tracking"].tracking_uri)
    capsys.readouterr()  # what the materializations before printed
    handler = signal.getsignal(
        signal.SIGTERM
    )  # the command takes SIGTERM's path over; the test worker keeps its own
    try:
        code = cli.main(list(args))
    finally:
        signal.signal(signal.SIGTERM, handler)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_gate_rollback_lineage_and_retraining_on_identical_data(
    snapshot,  # noqa: F811 (a fixture)
    instance,
    registry_resources,
    landing_dir,
    tmp_path,
    monkeypatch,
    capsys,
):
    mlflow_tracking = registry_resources["mlflow_tracking"]

    first = _train_evaluate_register(instance, registry_resources, snapshot, steps=FIRST_STEPS)
    assert first.success
    assert _gate(first).passed, "a first model becomes champion when it beats the uniform baseline"
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 1
    report = registry_resources["lake"].read(
        "evaluation", "report", where=pl.col("partition") == snapshot
    )
    slices = set(report["slice"])
    assert {"overall", "source:annotate", "source:logs", "source:scrape", "source:synth"} <= slices
    assert any(name.startswith("eval:") for name in slices) and set(report["model"]) == {
        "candidate"
    }

    better_snapshot = _new_snapshot(instance, registry_resources)
    searched = materialize(
        [hparam_search],
        partition_key=better_snapshot,
        instance=instance,
        resources=registry_resources,
    )
    found = _metadata(searched, "training__hparam_search")
    assert found["steps_trained"] == 2 * 5 + 1 * 5 < found["full_grid_steps"] == 2 * 10
    trials = registry_resources["lake"].read(
        "training", "hparam_search", where=pl.col("partition") == better_snapshot
    )
    assert trials.height == 3 and trials.filter(pl.col("rung") == 0)["continued"].sum() == 1
    parent = (
        MlflowClient(mlflow_tracking.tracking_uri)
        .get_run(trials["mlflow_run_id"][0])
        .data.tags["mlflow.parentRunId"]
    )
    assert (
        MlflowClient(mlflow_tracking.tracking_uri).get_run(parent).data.tags["kind"]
        == "hparam_search"
    )

    better = _train_evaluate_register(
        instance, registry_resources, better_snapshot, steps=3 * FIRST_STEPS
    )
    trained_with = MlflowClient(mlflow_tracking.tracking_uri).get_run(
        _metadata(better, "training__checkpoint")["mlflow_run_id"]
    )
    assert float(trained_with.data.params["lr"]) == found["best_config"]["lr"], (
        "the search's best feeds training"
    )
    assert better.success and _gate(better).passed, _gate(better).description
    evaluated = _metadata(better, "evaluation__report")
    assert (
        evaluated["champion_version"] == "1"
        and evaluated["candidate_loss"] < evaluated["champion_loss"]
    )
    assert Path(evaluated["picture"]).stat().st_size > 0, (
        "the per-slice bars, candidate beside champion"
    )
    tracked = MlflowClient(mlflow_tracking.tracking_uri).get_run(
        _metadata(better, "training__checkpoint")["mlflow_run_id"]
    )
    assert tracked.data.metrics["eval/overall_loss"] == pytest.approx(evaluated["candidate_loss"])
    assert tracked.data.metrics["eval_champion/overall_loss"] == pytest.approx(
        evaluated["champion_loss"]
    )
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 2

    assert evaluated["validation_sequences_scored"] == evaluated["validation_sequences"], (
        "the default cap scores all here"
    )

    worse_snapshot = _new_snapshot(instance, registry_resources)
    cap = evaluated["validation_tokens"] // 2
    capped = {
        **registry_resources,
        "registry_policy": RegistryPolicy(model_name=MODEL, eval_max_tokens=cap),
    }
    worse = _train_evaluate_register(instance, capped, worse_snapshot, steps=4)
    sampled = _metadata(worse, "evaluation__report")
    assert 0 < sampled["validation_tokens_scored"] <= cap < sampled["validation_tokens"]
    assert sampled["validation_sequences_scored"] < sampled["validation_sequences"]
    assert sampled["models_scored"] == 2, (
        "the candidate and the champion, on the same capped sample"
    )
    gate = _gate(worse)
    assert not gate.passed and not worse.success, "a refused candidate fails the blocking gate"
    assert gate.metadata["champion_loss"].value < gate.metadata["candidate_loss"].value
    assert mlflow_tracking.version_by_alias(MODEL, "challenger").version == 3
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 2, (
        "the champion does not move"
    )

    code, _, err = _cli(monkeypatch, capsys, registry_resources, tmp_path, "rollback", MODEL)
    assert code == 0, err
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 1
    code, _, err = _cli(
        monkeypatch,
        capsys,
        registry_resources,
        tmp_path,
        "promote",
        f"{MODEL}/2",
        "--reason",
        "rollback drill over",
    )
    assert code == 0, err
    history = mlflow_tracking.champion_history(MODEL)
    assert [(h["version"], h["by"]) for h in history[-2:]] == [
        ("1", "pipeline-assets rollback"),
        ("2", "pipeline-assets promote"),
    ]
    assert history[-1]["reason"] == "rollback drill over"

    code, out, err = _cli(
        monkeypatch, capsys, registry_resources, tmp_path, "lineage", f"{MODEL}@champion"
    )
    assert code == 0, err
    lineage = json.loads(out)
    assert (
        lineage["model"]["version"] == "2" and lineage["checkpoint"]["partition"] == better_snapshot
    )
    manifest = read_manifest(
        registry_resources["lake"].uri, int(better_snapshot.removeprefix("gold-v"))
    )
    assert (
        lineage["gold"]["snapshot"] == better_snapshot
        and lineage["gold"]["sequences_version"] == manifest.sequences_version
    )
    assert lineage["gold"]["batches"] == lineage["silver"]["batches"] == list(manifest.batches)
    assert (
        lineage["mlflow_run"]["run_id"]
        == _metadata(better, "training__checkpoint")["mlflow_run_id"]
    )
    landed = sorted(
        str(p) for p in landing_dir.rglob("*") if p.is_file() and not p.name.startswith(("_", "."))
    )
    assert sorted(f["uri"] for f in lineage["landing_files"]) == landed
    assert all(len(f["checksum"]) == 64 for f in lineage["landing_files"])

    served = tmp_path / "served"
    code, out, err = _cli(
        monkeypatch,
        capsys,
        registry_resources,
        tmp_path,
        "export",
        f"{MODEL}@champion",
        "--out",
        str(served),
    )
    assert code == 0, err
    assert json.loads(out)["version"] == "2"
    assert json.loads((served / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_servable(served)
    code, _, err = _cli(
        monkeypatch,
        capsys,
        registry_resources,
        tmp_path,
        "export",
        f"{MODEL}/1",
        "--out",
        str(served),
    )
    assert code == 2 and "is not empty" in err
    cost = lineage[
        "cost"
    ]  # the training run and the data stages behind its snapshot, at the report's prices
    assert cost["training_usd"] > 0 and cost["data_usd"] > 0
    assert cost["total_usd"] == pytest.approx(cost["training_usd"] + cost["data_usd"], abs=1e-6)

    # Training a snapshot again (a new materialization, from step 0) sees identical data.
    again = materialize(
        [training_checkpoint],
        partition_key=snapshot,
        instance=instance,
        resources=registry_resources,
        run_config={"ops": {"training__checkpoint": {"config": {"steps": FIRST_STEPS}}}},
    )
    before, after = (
        _metadata(first, "training__checkpoint"),
        _metadata(again, "training__checkpoint"),
    )
    assert after["mlflow_run_id"] != before["mlflow_run_id"]
    assert after["first_batch_sha256"] == before["first_batch_sha256"]
    assert after["steps"] == FIRST_STEPS and after["final_loss"] == before["final_loss"], (
        "from step 0, on the same rows, same seed"
    )
