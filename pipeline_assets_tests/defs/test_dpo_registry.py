"""registry/dpo_model_version on tiny registered runs (no training): the preference gate decides,
`champion` of `dpo-model` moves only when it passes, a champion that moved since evaluation is
refused, the version carries what lineage and retention read, and promote/rollback work on
dpo-model by hand."""

from __future__ import annotations

import os

import polars as pl
import pytest
from dagster import AssetMaterialization, materialize

from pipeline_assets.cli.main import main
from pipeline_assets.contracts import DpoEvaluationSlice, conform
from pipeline_assets.defs.evaluation.dpo import _report_frame
from pipeline_assets.defs.keys import EVALUATION_DPO_REPORT, TRAINING_DPO_CHECKPOINT
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.registry.assets import PROMOTION_GATE
from pipeline_assets.defs.registry.dpo import registry_dpo_model_version
from pipeline_assets.lib.training.preference_eval import preference_slices
from pipeline_assets.resources.mlflow_tracking import MlflowResource

MODEL = "dpo-model"
PAIRS = pl.DataFrame(
    {"pair_id": [f"p{i}" for i in range(10)], "source": ["annotate"] * 5 + ["rollouts"] * 5}
)
UPSTREAM = {
    "gold/preference_snapshots": 0,
    "gold/preference_sequences": 3,
    "gold/reference_logps": 1,
    "silver/preference_pairs": 2,
    "gold/tokenizer": 0,
}


@pytest.fixture
def mlflow_tracking(tmp_path) -> MlflowResource:
    return MlflowResource(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "mlartifacts")
    )


def _margins(right: int) -> pl.DataFrame:
    """``right`` of the ten pairs with a positive margin (the first ones), the rest negative."""
    return pl.DataFrame(
        {"pair_id": PAIRS["pair_id"], "margin": [1.0] * right + [-1.0] * (10 - right)}
    )


def _evaluated(
    instance,
    lake,
    mlflow_tracking,
    partition: str,
    right: int,
    champion: tuple[str, int] | None,
    sft_losses: tuple[float, float] = (2.01, 2.00),
) -> None:
    """What DPO training and evaluation/dpo_report leave for a preference snapshot: a run, and a
    report of the candidate (``right`` of ten pairs preferred) against ``champion`` (version, pairs
    it gets right)."""
    run_id = (
        mlflow_tracking.client()
        .create_run(mlflow_tracking.experiment_id(), run_name=partition)
        .info.run_id
    )
    instance.report_runless_asset_event(
        AssetMaterialization(
            TRAINING_DPO_CHECKPOINT,
            partition=partition,
            metadata={
                "mlflow_run_id": run_id,
                "git_commit": "test",
                "reference_model": "sft-model/4",
            },
        )
    )
    instance.report_runless_asset_event(
        AssetMaterialization(
            EVALUATION_DPO_REPORT,
            partition=partition,
            metadata={
                "champion_at_evaluation": champion[0] if champion else None,
                "upstream_delta_versions": UPSTREAM,
            },
        )
    )
    slices = {"candidate": preference_slices(_margins(right), PAIRS)}
    versions = {"candidate": None}
    if champion:
        slices["champion"] = preference_slices(_margins(champion[1]), PAIRS)
        versions["champion"] = f"{MODEL}/{champion[0]}"
    sft = {
        "candidate_loss": sft_losses[0],
        "champion_loss": sft_losses[1],
        "champion_version": "sft-model/4",
    }
    report = conform(_report_frame(partition, slices, versions, sft), DpoEvaluationSlice)
    lake.replace_partition(*EVALUATION_DPO_REPORT.path, report, column="partition", value=partition)


def _register(instance, lake, mlflow_tracking, partition: str):
    return materialize(
        [registry_dpo_model_version],
        partition_key=partition,
        instance=instance,
        raise_on_error=False,
        resources={
            "lake": lake,
            "mlflow_tracking": mlflow_tracking,
            "registry_policy": RegistryPolicy(slice_tolerance=0.1),
        },
    )


def _gate(result):
    [evaluation] = [
        c for c in result.get_asset_check_evaluations() if c.check_name == PROMOTION_GATE
    ]
    return evaluation


def _champion(mlflow_tracking: MlflowResource) -> str | None:
    found = mlflow_tracking.version_by_alias(MODEL, "champion")
    return str(found.version) if found else None


def test_the_preference_gate_moves_the_dpo_champion_and_refuses_what_it_must(
    instance, lake, mlflow_tracking
):
    instance.add_dynamic_partitions(preference_snapshots.name, [f"dpo-v{n}" for n in range(5)])
    _evaluated(instance, lake, mlflow_tracking, "dpo-v0", right=7, champion=None)
    first = _register(instance, lake, mlflow_tracking, "dpo-v0")
    assert first.success and _gate(first).passed and "beats chance" in _gate(first).description
    assert _champion(mlflow_tracking) == "1"
    tags = mlflow_tracking.existing_version(MODEL, "1").tags
    assert tags["partition"] == "dpo-v0" and tags["reference_model"] == "sft-model/4"
    assert {tags[f"delta.{table}"] for table in UPSTREAM} == {str(v) for v in UPSTREAM.values()}
    assert float(tags["preference_accuracy.overall"]) == pytest.approx(0.7)

    # Two candidates judged against v1 side by side; the better registers first.
    _evaluated(instance, lake, mlflow_tracking, "dpo-v1", right=9, champion=("1", 7))
    _evaluated(instance, lake, mlflow_tracking, "dpo-v2", right=8, champion=("1", 7))
    better = _register(instance, lake, mlflow_tracking, "dpo-v1")
    assert better.success and _champion(mlflow_tracking) == "2"
    assert _gate(better).metadata["accuracy_gain"].value == pytest.approx(0.2)
    stale = _register(instance, lake, mlflow_tracking, "dpo-v2")
    assert (
        not stale.success
        and "champion moved" in _gate(stale).description
        and "then v1, now v2" in _gate(stale).description
    )
    assert (
        _champion(mlflow_tracking) == "2"
        and mlflow_tracking.version_by_alias(MODEL, "challenger").version == 3
    )

    # More accurate than v2, but preference tuning cost the language model: refused on the sft loss.
    _evaluated(
        instance,
        lake,
        mlflow_tracking,
        "dpo-v3",
        right=10,
        champion=("2", 9),
        sft_losses=(2.5, 2.0),
    )
    forgot = _register(instance, lake, mlflow_tracking, "dpo-v3")
    assert not forgot.success and "sft validation loss" in _gate(forgot).description
    assert _gate(forgot).metadata["sft_relative_change"].value == pytest.approx(0.25)
    # Less accurate than v2: refused.
    _evaluated(instance, lake, mlflow_tracking, "dpo-v4", right=8, champion=("2", 9))
    worse = _register(instance, lake, mlflow_tracking, "dpo-v4")
    assert not worse.success and "neither better" in _gate(worse).description
    [registered] = worse.asset_materializations_for_node("registry__dpo_model_version")
    assert (
        registered.metadata["promoted"].value is False
        and registered.metadata["champion_version"].value == "2"
    )
    assert _champion(mlflow_tracking) == "2"


def test_dpo_model_is_promoted_and_rolled_back_by_hand(
    tmp_path, mlflow_tracking, monkeypatch, capsys
):
    for name in [k for k in os.environ if k.startswith(("PIPELINE_", "MLFLOW_", "DAGSTER_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_tracking.tracking_uri)
    client = mlflow_tracking.client()
    for partition in ("dpo-v0", "dpo-v1"):
        run_id = client.create_run(mlflow_tracking.experiment_id(), run_name=partition).info.run_id
        version = mlflow_tracking.registered_version(
            MODEL, run_id, "model", tags={"partition": partition}
        )
        mlflow_tracking.move_champion(MODEL, version, by="test", reason="gate")
    assert main(["rollback", MODEL]) == 0 and _champion(mlflow_tracking) == "1"
    assert (
        main(["promote", f"{MODEL}/2", "--reason", "checked by hand"]) == 0
        and _champion(mlflow_tracking) == "2"
    )
    history = mlflow_tracking.champion_history(MODEL)
    assert [(entry["version"], entry["kind"]) for entry in history] == [
        ("1", "promote"),
        ("2", "promote"),
        ("1", "rollback"),
        ("2", "promote"),
    ]
    assert history[-1]["reason"] == "checked by hand"
