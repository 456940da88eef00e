"""The retention job on real Delta tables, a real MLflow registry (SQLite) and real checkpoint
folders: it deletes what nothing registered needs, and lineage of a registered version
still resolves."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import boto3
import polars as pl
import pytest
from dagster import DefaultScheduleStatus

from pipeline_assets.cli.lineage import model_lineage
from pipeline_assets.defs.ops.policy import RetentionPolicy
from pipeline_assets.defs.ops.retention import retention_job, retention_schedule
from pipeline_assets.lib.delta_files import write_share
from pipeline_assets.lib.gold.manifest import Manifest
from pipeline_assets.lib.gold.splits import SPLITS
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.resources.settings import Settings
from pipeline_assets_tests.conftest import BUCKET

MODEL = "sft-model"


def _lake_history(lake: LakeResource) -> None:
    """silver/records v0..v2, gold/sequences v0..v1 and two snapshots of them; the registered model
    read silver v0 and gold v0."""
    for rows in (["a1", "b1"], ["a1", "b1", "c1"], ["a1", "b1", "c1", "d1"]):
        lake.overwrite(
            "silver",
            "records",
            pl.DataFrame(
                {"record_id": rows, "batch_id": [r[0].upper() for r in rows], "source": "src"}
            ),
        )
    lake.overwrite("gold", "sequences", pl.DataFrame({"record_ids": [["a1"], ["b1"]]}))
    lake.overwrite("gold", "sequences", pl.DataFrame({"record_ids": [["a1", "c1"], ["b1", "d1"]]}))
    for number, batches in enumerate(
        (("A", "B"), ("A", "B", "C", "D"))
    ):  # gold-v0 and gold-v1's manifests
        manifest = Manifest(
            number, number, 0, 8, batches, {split: (1,) * len(batches) for split in SPLITS}
        )
        lake.append("gold", "snapshots", manifest.frame("test", datetime.now(timezone.utc)))
    lake.append(
        "landing",
        "manifest",
        pl.DataFrame(
            {
                "uri": ["landing/src/a.jsonl", "landing/src/b.jsonl"],
                "source": ["src", "src"],
                "batch_id": ["A", "B"],
                "checksum": ["x", "y"],
                "size": [1, 2],
            }
        ),
    )


def _register(
    mlflow: MlflowResource, partition: str, versions: dict[str, int], model: str = MODEL
) -> str:
    run_id = (
        mlflow.client()
        .create_run(mlflow.experiment_id(), tags={"export_uri": f"ckpt/{partition}/final"})
        .info.run_id
    )
    tags = {"partition": partition, **{f"delta.{table}": str(v) for table, v in versions.items()}}
    return mlflow.registered_version(model, run_id, "model", tags)


def _checkpoint(store, name: str, payload: bytes = b"weights") -> None:
    folder = store.prepare(name)
    (folder / "shard.distcp").write_bytes(payload)
    store.upload(name, ["shard.distcp"])
    store.publish(name, {"files": {}})


def _resources(tmp_path: Path, lake: LakeResource, checkpoint_uri: str, days: float = 0) -> dict:
    return {
        "lake": lake,
        "mlflow_tracking": MlflowResource(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
            artifact_root=str(tmp_path / "mlartifacts"),
        ),
        "launcher": TorchrunLauncher(
            checkpoint_uri=checkpoint_uri, scratch_dir=str(tmp_path / "scratch")
        ),
        "retention_policy": RetentionPolicy(days=days),
    }


def _op_metadata(result, op: str) -> dict:
    [output] = [e for e in result.events_for_node(op) if e.event_type_value == "STEP_OUTPUT"]
    return {k: v.value for k, v in output.step_output_data.metadata.items()}


def test_the_daily_retention_schedule_is_on_by_default():
    assert retention_schedule.default_status == DefaultScheduleStatus.RUNNING
    assert retention_schedule.job_name == retention_job.name


def test_retention_deletes_what_nothing_registered_needs_and_lineage_still_resolves(
    tmp_path, lake, instance
):
    _lake_history(lake)
    resources = _resources(tmp_path, lake, str(tmp_path / "checkpoints"))
    version = _register(
        resources["mlflow_tracking"],
        "gold-v0",
        {"silver/records": 0, "gold/sequences": 0, "gold/snapshots": 0},
    )
    launcher = resources["launcher"]
    registered, unregistered = launcher.store("gold-v0"), launcher.store("gold-v1")
    for name in ("step-10", "step-20", "final"):
        _checkpoint(registered, name)
    registered.write_json("best.json", {"step": 20, "uri": registered.folder_uri("step-20")})
    _checkpoint(unregistered, "step-10")
    lineage_before = model_lineage(f"{MODEL}/{version}", resources["mlflow_tracking"], lake)
    orphan = write_share(  # a worker's file whose commit never came
        lake.table_uri("silver", "records"), pl.DataFrame({"record_id": ["z1"]}), {}, "o.parquet"
    )
    staged = Path(lake.staging_uri("silver", "C", "run-died", "sft-keys-000000000000.parquet"))
    staged.parent.mkdir(parents=True)
    pl.DataFrame({"record_id": ["c1"]}).write_parquet(staged)  # a run that died before its commit

    result = retention_job.execute_in_process(instance=instance, resources=resources)

    assert result.success
    assert not Path(lake.table_uri("silver", "records"), orphan["path"]).exists()
    assert _op_metadata(result, "vacuum_lake")["uncommitted_files_deleted"] == 1
    assert _op_metadata(result, "vacuum_lake")["abandoned_staging_deleted"] == ["silver/C/run-died"]
    assert not staged.exists()
    assert model_lineage(f"{MODEL}/{version}", resources["mlflow_tracking"], lake) == lineage_before
    assert lineage_before["silver"]["batches"] == ["A", "B"]
    with pytest.raises(
        Exception
    ):  # silver v1 was outside the window and pinned by nothing: its files are gone
        lake.read("silver", "records", version=1)
    assert lake.read("silver", "records").height == 4, "the current version is untouched"
    assert lake.version("silver", "records") == 2, "retention adds no table version"
    vacuumed = _op_metadata(result, "vacuum_lake")
    assert vacuumed["tables_vacuumed"]["silver/records"]["files"] == 1
    assert vacuumed["tables_vacuumed"]["gold/sequences"]["files"] == 0, (
        "gold v0 is pinned by the registered model"
    )
    assert vacuumed["files_deleted"] == 1 and vacuumed["bytes_deleted"] > 0

    pruned = _op_metadata(result, "prune_checkpoints")
    assert sorted(pruned["checkpoint_folders_deleted"]) == [
        registered.folder_uri("step-10"),
        unregistered.uri,
    ]
    assert pruned["checkpoint_files_deleted"] == 4  # two shards, two manifests
    assert (
        not Path(unregistered.uri).exists() and not Path(registered.folder_uri("step-10")).exists()
    )
    assert registered.complete_steps() == [20] and registered.exists("final/COMPLETE.json")


def _conversation_history(lake: LakeResource) -> None:
    """bronze/conversations and silver/conversations v0..v1 beside _lake_history's tables: batch A
    held a conversation source's file; the registered model read both tables' v0."""
    for layer in ("bronze", "silver"):
        for rows in (["a2"], ["a2", "c2"]):
            lake.overwrite(
                layer,
                "conversations",
                pl.DataFrame(
                    {"record_id": rows, "batch_id": [r[0].upper() for r in rows], "source": "chats"}
                ),
            )
    lake.append(
        "landing",
        "manifest",
        pl.DataFrame(
            {
                "uri": ["landing/chats/a.jsonl"],
                "source": ["chats"],
                "batch_id": ["A"],
                "checksum": ["z"],
                "size": [3],
            }
        ),
    )


def test_a_model_trained_on_conversations_keeps_their_versions_and_its_lineage_reaches_them(
    tmp_path, lake, instance
):
    _lake_history(lake)
    _conversation_history(lake)
    resources = _resources(tmp_path, lake, str(tmp_path / "checkpoints"))
    pins = {"silver/conversations": 0, "bronze/conversations": 0}
    version = _register(
        resources["mlflow_tracking"],
        "gold-v0",
        {"silver/records": 0, "gold/sequences": 0, "gold/snapshots": 0, **pins},
    )
    lineage_before = model_lineage(f"{MODEL}/{version}", resources["mlflow_tracking"], lake)
    orphan = write_share(  # a worker's file whose commit never came
        lake.table_uri("silver", "records"), pl.DataFrame({"record_id": ["z1"]}), {}, "o.parquet"
    )
    staged = Path(lake.staging_uri("silver", "C", "run-died", "sft-keys-000000000000.parquet"))
    staged.parent.mkdir(parents=True)
    pl.DataFrame({"record_id": ["c1"]}).write_parquet(staged)  # a run that died before its commit

    result = retention_job.execute_in_process(instance=instance, resources=resources)

    assert result.success
    assert not Path(lake.table_uri("silver", "records"), orphan["path"]).exists()
    assert _op_metadata(result, "vacuum_lake")["uncommitted_files_deleted"] == 1
    vacuumed = _op_metadata(result, "vacuum_lake")
    assert {table: vacuumed["pinned_versions"][table] for table in pins} == {
        table: [0] for table in pins
    }
    for table in pins:
        assert vacuumed["tables_vacuumed"][table]["files"] == 0, f"{table} v0 is pinned"
        assert lake.read(*table.split("/"), version=0)["record_id"].to_list() == ["a2"]
    assert model_lineage(f"{MODEL}/{version}", resources["mlflow_tracking"], lake) == lineage_before
    conversations = lineage_before["other_formats"]["conversation"]
    assert (conversations["silver"]["table"], conversations["silver"]["version"]) == (
        "silver/conversations",
        0,
    )
    assert (conversations["bronze"]["table"], conversations["bronze"]["version"]) == (
        "bronze/conversations",
        0,
    )
    assert {(f["uri"], f["source"]) for f in lineage_before["landing_files"]} == {
        ("landing/src/a.jsonl", "src"),
        ("landing/src/b.jsonl", "src"),
        ("landing/chats/a.jsonl", "chats"),
    }, "the conversation source's file, beside the sft source's"


def test_a_registered_dpo_version_keeps_its_preference_snapshot_and_reference_pass(
    tmp_path, lake, instance
):
    _lake_history(lake)
    resources = _resources(tmp_path, lake, str(tmp_path / "checkpoints"))
    _register(
        resources["mlflow_tracking"],
        "dpo-v0",
        {"gold/reference_logps": 1, "gold/preference_sequences": 2},
        model="dpo-model",
    )
    launcher = resources["launcher"]
    registered, unregistered = launcher.store("dpo-v0"), launcher.store("dpo-v1")
    for name in ("step-10", "final"):
        _checkpoint(registered, name)
    _checkpoint(unregistered, "final")

    result = retention_job.execute_in_process(instance=instance, resources=resources)

    assert result.success
    pruned = _op_metadata(result, "prune_checkpoints")
    assert sorted(pruned["checkpoint_folders_deleted"]) == [
        registered.folder_uri("step-10"),
        unregistered.uri,
    ]
    assert registered.exists("final/COMPLETE.json") and pruned["registered_snapshots"] == ["dpo-v0"]
    pinned = _op_metadata(result, "vacuum_lake")["pinned_versions"]
    assert pinned["gold/reference_logps"] == [1] and pinned["gold/preference_sequences"] == [2]


def test_on_s3_published_staging_goes_and_the_lake_is_vacuumed(tmp_path, s3_endpoint, instance):
    lake = LakeResource(uri=f"s3://{BUCKET}/lake")
    for rows in (["a1"], ["a1", "b1"]):
        lake.overwrite(
            "silver", "records", pl.DataFrame({"record_id": rows, "batch_id": ["A"] * len(rows)})
        )
    resources = _resources(tmp_path, lake, f"s3://{BUCKET}/checkpoints")
    _register(resources["mlflow_tracking"], "gold-v0", {"silver/records": 1})
    store = resources["launcher"].store("gold-v0")
    _checkpoint(store, "final")
    store.prepare("step-30")  # staged, never uploaded: abandoned, as the window is zero days

    result = retention_job.execute_in_process(instance=instance, resources=resources)

    assert result.success
    vacuumed = _op_metadata(result, "vacuum_lake")
    assert (
        vacuumed["tables_vacuumed"]["silver/records"]["files"] == 1
        and vacuumed["bytes_deleted"] > 0
    )
    assert lake.read("silver", "records", version=1).height == 2, (
        "the registered model's version stays readable"
    )
    assert sorted(_op_metadata(result, "prune_checkpoints")["staging_folders_deleted"]) == [
        str(store.staging_folder("final")),
        str(store.staging_folder("step-30")),
    ]
    assert not store.staging_folder("final").exists()
    assert store.exists("final/COMPLETE.json"), "the registered snapshot's export stays"
    keys = [
        o["Key"]
        for o in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")[
            "Contents"
        ]
    ]
    assert sorted(keys) == [
        "checkpoints/gold-v0/final/COMPLETE.json",
        "checkpoints/gold-v0/final/shard.distcp",
    ]


def test_a_negative_retention_window_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PIPELINE_RETENTION_DAYS", "-1")
    with pytest.raises(ValueError, match="PIPELINE_RETENTION_DAYS=-1 must be zero or more"):
        Settings.from_env()
