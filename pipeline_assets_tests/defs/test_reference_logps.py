"""gold/reference_logps refuses, before any scoring, a preference snapshot it has no right reference
model for: no sft champion yet, or a champion whose tokenizer is not the one the snapshot's pairs
were encoded with (or is not recorded). The run fails with a message that says what to do, and
gold/reference_logps gets no row."""

from __future__ import annotations

from datetime import datetime, timezone

import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.gold.reference import gold_reference_logps
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.lib.gold.manifest import PREFERENCE_SNAPSHOTS, Manifest
from pipeline_assets.lib.gold.splits import SPLITS
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource

MODEL = "sft-model"
SNAPSHOT = "dpo-v0"
SNAPSHOT_TOKENIZER = 0
TOKENIZER_TAG = "delta.gold/tokenizer"


@pytest.fixture
def mlflow_tracking(tmp_path) -> MlflowResource:
    return MlflowResource(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "mlartifacts")
    )


@pytest.fixture
def snapshot(instance, lake) -> str:
    """dpo-v0's manifest (row 0 of gold/preference_snapshots), encoded with gold/tokenizer v0; no
    shard behind it."""
    manifest = Manifest(
        0,
        0,
        SNAPSHOT_TOKENIZER,
        8,
        ("b1",),
        {split: (1,) for split in SPLITS},
        PREFERENCE_SNAPSHOTS,
    )
    lake.append(
        *PREFERENCE_SNAPSHOTS.manifest_table, manifest.frame("test", datetime.now(timezone.utc))
    )
    instance.add_dynamic_partitions(preference_snapshots.name, [SNAPSHOT])
    return SNAPSHOT


def _registered_version(mlflow_tracking: MlflowResource, tags: dict[str, str]) -> str:
    """A registered sft version whose run holds no model: the refusals read only its tags."""
    run_id = mlflow_tracking.client().create_run(mlflow_tracking.experiment_id()).info.run_id
    return mlflow_tracking.registered_version(
        MODEL, run_id, "model", tags={"partition": "gold-v0", **tags}
    )


def _champion(mlflow_tracking: MlflowResource, tags: dict[str, str]) -> None:
    version = _registered_version(mlflow_tracking, tags)
    mlflow_tracking.move_champion(MODEL, version, by="test", reason="the reference under test")


def _reference_pass(instance, lake, mlflow_tracking, tmp_path, snapshot: str) -> str:
    """Materialize the snapshot's reference pass; the run must fail, and its one step failure's
    message is returned."""
    result = materialize(
        [gold_reference_logps],
        partition_key=snapshot,
        instance=instance,
        raise_on_error=False,
        resources={
            "lake": lake,
            "mlflow_tracking": mlflow_tracking,
            "registry_policy": RegistryPolicy(model_name=MODEL),
            "base_model": BaseModelResource(uri=""),
            "launcher": TorchrunLauncher(
                checkpoint_uri=str(tmp_path / "checkpoints"), scratch_dir=str(tmp_path / "scratch")
            ),
        },
    )
    assert not result.success
    [failure] = result.get_step_failure_events()
    return failure.event_specific_data.error.message


def _nothing_written(lake, snapshot: str) -> bool:
    rows = lake.read("gold", "reference_logps", where=pl.col("snapshot") == snapshot)
    return rows is None or rows.is_empty()


def test_no_champion_yet_is_refused_until_one_is_promoted(
    instance, lake, mlflow_tracking, tmp_path, snapshot
):
    _registered_version(
        mlflow_tracking, {TOKENIZER_TAG: str(SNAPSHOT_TOKENIZER)}
    )  # a candidate, never promoted

    message = _reference_pass(instance, lake, mlflow_tracking, tmp_path, snapshot)

    assert f"no {MODEL} champion yet" in message
    assert f"materialize {snapshot} again once registry/model_version has promoted one" in message
    assert _nothing_written(lake, snapshot)


def test_a_champion_of_another_tokenizer_is_refused(
    instance, lake, mlflow_tracking, tmp_path, snapshot
):
    _champion(mlflow_tracking, {TOKENIZER_TAG: str(SNAPSHOT_TOKENIZER + 1)})

    message = _reference_pass(instance, lake, mlflow_tracking, tmp_path, snapshot)

    assert (
        f"{MODEL} v1 was trained with gold/tokenizer v1, {snapshot} is encoded with v0" in message
    )
    assert (
        "cut a new preference snapshot once the champion and the shards share a tokenizer"
        in message
    )
    assert _nothing_written(lake, snapshot)


def test_a_champion_that_records_no_tokenizer_is_refused(
    instance, lake, mlflow_tracking, tmp_path, snapshot
):
    _champion(mlflow_tracking, {})

    message = _reference_pass(instance, lake, mlflow_tracking, tmp_path, snapshot)

    assert f"{MODEL} v1 records no gold/tokenizer version ({TOKENIZER_TAG} tag)" in message
    assert f"{snapshot} is encoded with v0" in message and "vNone" not in message
    assert _nothing_written(lake, snapshot)
