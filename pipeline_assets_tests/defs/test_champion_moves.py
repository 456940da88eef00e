"""The registry's champion under concurrent candidates and by hand, on tiny registered models (no
training): the gate judges the champion evaluation measured, rollbacks walk back, and the commands
refuse what does not exist."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import polars as pl
import pytest
from dagster import AssetMaterialization, materialize

from pipeline_assets.cli.main import main
from pipeline_assets.contracts import EvaluationSlice, conform
from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_REPORT,
    GOLD_SEQUENCES,
    GOLD_SNAPSHOTS,
    GOLD_TOKENIZER,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.partitions import data_snapshots, ingest_batches
from pipeline_assets.defs.policies import CostPolicy, RegistryPolicy
from pipeline_assets.defs.registry.assets import PROMOTION_GATE, registry_model_version
from pipeline_assets.resources.mlflow_tracking import MlflowResource

MODEL = "sft-model"
CHAMPION_LOSS = 2.0


@pytest.fixture
def mlflow_tracking(tmp_path) -> MlflowResource:
    return MlflowResource(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "mlartifacts")
    )


def _tiny_version(mlflow_tracking: MlflowResource, partition: str) -> str:
    """A registered version whose run holds a few bytes where a model would be."""
    client = mlflow_tracking.client()
    run_id = client.create_run(mlflow_tracking.experiment_id(), run_name=partition).info.run_id
    return mlflow_tracking.registered_version(MODEL, run_id, "model", tags={"partition": partition})


def _evaluated(
    instance,
    lake,
    mlflow_tracking,
    partition: str,
    candidate_loss: float,
    champion: str,
    cpu_seconds: float = 0.0,
) -> None:
    """What training and evaluation leave behind for a snapshot: a run, and a report against
    ``champion``."""
    client = mlflow_tracking.client()
    run_id = client.create_run(mlflow_tracking.experiment_id(), run_name=partition).info.run_id
    instance.report_runless_asset_event(
        AssetMaterialization(
            TRAINING_CHECKPOINT,
            partition=partition,
            metadata={
                "mlflow_run_id": run_id,
                "git_commit": "test",
                "cpu_seconds": cpu_seconds,
                "gpu_seconds": 0.0,
            },
        )
    )
    instance.report_runless_asset_event(
        AssetMaterialization(
            EVALUATION_REPORT, partition=partition, metadata={"champion_at_evaluation": champion}
        )
    )
    rows = [("candidate", None, candidate_loss), ("champion", champion, CHAMPION_LOSS)]
    report = pl.DataFrame(
        [
            {
                "partition": partition,
                "model": role,
                "model_version": version,
                "slice": "overall",
                "loss": loss,
                "perplexity": 2.718**loss,
                "tokens": 100,
                "documents": 10,
                "evaluated_at": datetime.now(timezone.utc),
            }
            for role, version, loss in rows
        ]
    )
    lake.replace_partition(
        "evaluation",
        "report",
        conform(report, EvaluationSlice),
        column="partition",
        value=partition,
    )


def _register(instance, lake, mlflow_tracking, partition: str):
    return materialize(
        [registry_model_version],
        partition_key=partition,
        instance=instance,
        raise_on_error=False,
        resources={
            "lake": lake,
            "mlflow_tracking": mlflow_tracking,
            "registry_policy": RegistryPolicy(model_name=MODEL),
            "cost_policy": CostPolicy(),
        },
    )


def _gate(result):
    [evaluation] = [
        c for c in result.get_asset_check_evaluations() if c.check_name == PROMOTION_GATE
    ]
    return evaluation


def test_two_candidates_measured_against_v1_the_worse_is_not_promoted_over_the_better(
    instance, lake, mlflow_tracking
):
    instance.add_dynamic_partitions(data_snapshots.name, ["gold-v0", "gold-v1", "gold-v2"])
    first = _tiny_version(mlflow_tracking, "gold-v0")
    mlflow_tracking.move_champion(MODEL, first, by="test", reason="first champion")
    # Both evaluated side by side while v1 was champion; each beats v1 by more than the margin.
    _evaluated(instance, lake, mlflow_tracking, "gold-v1", candidate_loss=1.80, champion="1")
    _evaluated(instance, lake, mlflow_tracking, "gold-v2", candidate_loss=1.90, champion="1")

    better = _register(instance, lake, mlflow_tracking, "gold-v1")
    assert better.success and _gate(better).passed
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 2

    worse = _register(instance, lake, mlflow_tracking, "gold-v2")
    gate = _gate(worse)
    assert not gate.passed and not worse.success, "a refused candidate fails the blocking gate"
    assert "champion moved" in gate.description and "then v1, now v2" in gate.description
    assert mlflow_tracking.version_by_alias(MODEL, "champion").version == 2, (
        "the better model stays champion"
    )
    assert mlflow_tracking.version_by_alias(MODEL, "challenger").version == 3
    [registered] = worse.asset_materializations_for_node("registry__model_version")
    assert registered.metadata["promoted"].value is False
    assert "champion moved" in registered.metadata["gate"].value


def _cli(capsys, *args: str) -> tuple[int, str]:
    """The console script's own function, in this process (a subprocess costs seconds
    of imports)."""
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def _champion(mlflow_tracking: MlflowResource) -> str:
    return str(mlflow_tracking.version_by_alias(MODEL, "champion").version)


def test_rollbacks_walk_back_and_missing_versions_are_refused(
    tmp_path, mlflow_tracking, monkeypatch, capsys
):
    for name in [k for k in os.environ if k.startswith(("PIPELINE_", "MLFLOW_", "DAGSTER_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_tracking.tracking_uri)
    for partition in ("gold-v0", "gold-v1", "gold-v2"):
        mlflow_tracking.move_champion(
            MODEL, _tiny_version(mlflow_tracking, partition), by="test", reason="gate"
        )
    assert _champion(mlflow_tracking) == "3"

    for expected in ("2", "1"):
        code, err = _cli(capsys, "rollback", MODEL)
        assert code == 0, err
        assert _champion(mlflow_tracking) == expected, (
            "each rollback goes one champion further back"
        )
    code, err = _cli(capsys, "rollback", MODEL)
    assert code == 2 and "no earlier champion" in err
    assert _champion(mlflow_tracking) == "1", "never back to a version a rollback left"

    code, err = _cli(capsys, "promote", f"{MODEL}/9")
    assert code == 2 and f"{MODEL} has no version 9 (registered versions: 1, 2, 3)" in err
    code, err = _cli(capsys, "rollback", "no-such-model")
    assert code == 2 and "no registered model 'no-such-model'" in err
    assert _champion(mlflow_tracking) == "1"

    code, err = _cli(capsys, "promote", f"{MODEL}/3", "--reason", "drill over")
    assert code == 0, err
    code, err = _cli(capsys, "rollback", MODEL)
    assert code == 0 and _champion(mlflow_tracking) == "1", (
        "back to the champion the promotion replaced"
    )


def test_a_version_carries_its_training_and_data_cost(instance, lake, mlflow_tracking):
    """An hour of training CPU, and 50 minutes of data stages behind the snapshot (its batch's gold
    shard, its tokenizer, bronze and silver of its batch at the Delta versions it read; a later redo
    of silver is not its cost), at the default $0.048 per core-hour."""
    instance.add_dynamic_partitions(data_snapshots.name, ["gold-v0", "gold-v1"])
    instance.add_dynamic_partitions(ingest_batches.name, ["b1"])
    mlflow_tracking.move_champion(
        MODEL, _tiny_version(mlflow_tracking, "gold-v0"), by="test", reason="first champion"
    )
    for key, partition, metadata in [
        (BRONZE_RECORDS, "b1", {"delta_version": 0, "cpu_seconds": 600.0}),
        (
            SILVER_RECORDS,
            "b1",
            {
                "delta_version": 0,
                "cpu_seconds": 600.0,
                "upstream_delta_versions": {"bronze/records": 0},
            },
        ),
        (GOLD_TOKENIZER, None, {"tokenizer_version": 0, "cpu_seconds": 300.0}),
        (
            GOLD_SEQUENCES,
            "b1",
            {
                "delta_version": 0,
                "cpu_seconds": 1500.0,
                "tokenizer_version": 0,
                "upstream_delta_versions": {"silver/records": 0, "gold/tokenizer": 0},
            },
        ),
        (
            GOLD_SNAPSHOTS,
            None,
            {
                "data_snapshot": "gold-v1",
                "batches": ["b1"],
                "tokenizer_version": 0,
                "cpu_seconds": 0.0,
                "upstream_delta_versions": {"gold/sequences": 0, "gold/tokenizer": 0},
            },
        ),
        (
            SILVER_RECORDS,
            "b1",
            {
                "delta_version": 1,
                "cpu_seconds": 9999.0,
                "upstream_delta_versions": {"bronze/records": 0},
            },
        ),
    ]:
        instance.report_runless_asset_event(
            AssetMaterialization(key, partition=partition, metadata=metadata)
        )
    _evaluated(
        instance,
        lake,
        mlflow_tracking,
        "gold-v1",
        candidate_loss=1.80,
        champion="1",
        cpu_seconds=3600.0,
    )
    assert _register(instance, lake, mlflow_tracking, "gold-v1").success
    version = mlflow_tracking.version_by_alias(MODEL, "champion")
    cost = json.loads(version.tags["cost_usd"])
    assert cost["training_usd"] == pytest.approx(0.048) and cost["data_usd"] == pytest.approx(0.04)
    assert cost["total_usd"] == pytest.approx(0.088) and cost["cpu_seconds"] == pytest.approx(6600)
