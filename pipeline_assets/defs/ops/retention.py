"""The daily retention job: vacuum the lake, delete checkpoints nothing registered needs, and delete
local staging whose upload is published (docs/operations.md, "Retention")."""

import shutil
import time
from pathlib import Path

from dagster import (
    DefaultScheduleStatus,
    MetadataValue,
    OpExecutionContext,
    Output,
    ScheduleDefinition,
    job,
    op,
)

from pipeline_assets.defs.ops.policy import RetentionPolicy
from pipeline_assets.lib.ops.retention import (
    Removed,
    SnapshotCheckpoints,
    checkpoints_to_delete,
    cutoff,
    is_snapshot_folder,
    pinned_versions,
    staging_to_delete,
)
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource
from pipeline_assets.trainer.storage import BEST, MANIFEST


@op(
    description="Vacuum every Delta table: delete files that no version inside the retention "
    "window and no version a registered model pins still reads, files workers wrote for a "
    "commit that never came, and staging a dead run left."
)
def vacuum_lake(
    context: OpExecutionContext,
    lake: LakeResource,
    mlflow_tracking: MlflowResource,
    retention_policy: RetentionPolicy,
) -> Output[None]:
    pinned = pinned_versions(version.tags for version in mlflow_tracking.all_registered_versions())
    removed_by_table: dict[str, dict] = {}
    total, uncommitted = Removed(), Removed()
    before = cutoff(time.time(), retention_policy.days)
    for layer, name in lake.tables():
        table = f"{layer}/{name}"
        removed = lake.vacuum(
            layer, name, retention_policy.days * 24, keep_versions=pinned.get(table, [])
        )
        orphans = lake.remove_uncommitted(layer, name, keep_after=before)
        context.log.info(
            f"vacuumed {table}: {removed.files} file(s), {removed.bytes} bytes deleted "
            f"(kept versions {pinned.get(table, [])} for registered models); "
            f"{orphans.files} file(s) no version references deleted"
        )
        removed_by_table[table] = {"files": removed.files, "bytes": removed.bytes}
        total += removed
        uncommitted += orphans
    abandoned, staged = lake.remove_abandoned_staging(keep_after=before)
    for folder in abandoned:
        context.log.info(f"deleted abandoned staging {lake.staging_uri(folder)}")
    return Output(
        None,
        metadata={
            "tables_vacuumed": MetadataValue.json(removed_by_table),
            "files_deleted": total.files,
            "bytes_deleted": total.bytes,
            "uncommitted_files_deleted": uncommitted.files,
            "uncommitted_bytes_deleted": uncommitted.bytes,
            "abandoned_staging_deleted": MetadataValue.json(abandoned),
            "abandoned_staging_files_deleted": staged.files,
            "pinned_versions": MetadataValue.json(pinned),
            "retention_days": retention_policy.days,
        },
    )


@op(
    description="Delete the checkpoints of snapshots no registered model version comes from, keep "
    "a registered snapshot's export and best step, and delete local staging once its upload is "
    "published."
)
def prune_checkpoints(
    context: OpExecutionContext,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    retention_policy: RetentionPolicy,
) -> Output[None]:
    registered = {
        version.tags["partition"]
        for version in mlflow_tracking.all_registered_versions()
        if "partition" in version.tags
    }
    before = cutoff(time.time(), retention_policy.days)
    doomed = checkpoints_to_delete(_snapshot_checkpoints(launcher), registered, before)
    deleted, total = [], Removed()
    for partition, folder in doomed:
        files, size = launcher.store(partition).remove(folder or "")
        uri = launcher.store(partition).folder_uri(folder or "")
        context.log.info(f"deleted {uri}: {files} file(s), {size} bytes")
        deleted.append(uri)
        total += Removed(files, size)
    staging = _delete_staging(
        context, launcher, {partition for partition, folder in doomed if folder is None}, before
    )
    return Output(
        None,
        metadata={
            "checkpoint_folders_deleted": MetadataValue.json(deleted),
            "checkpoint_files_deleted": total.files,
            "checkpoint_bytes_deleted": total.bytes,
            "staging_folders_deleted": MetadataValue.json(staging),
            "registered_snapshots": MetadataValue.json(sorted(registered)),
            "retention_days": retention_policy.days,
        },
    )


def _snapshot_checkpoints(launcher: TorchrunLauncher) -> list[SnapshotCheckpoints]:
    found = []
    for partition in filter(is_snapshot_folder, launcher.partitions()):
        store = launcher.store(partition)
        best = store.read_json(BEST)
        found.append(
            SnapshotCheckpoints(
                partition=partition,
                folders={name: store.usage(name)[2] for name in store.folders()},
                newest_modified=store.usage()[2],
                best_folder=best["uri"].rstrip("/").rsplit("/", 1)[-1] if best else None,
            )
        )
    return found


def _delete_staging(
    context: OpExecutionContext,
    launcher: TorchrunLauncher,
    deleted_partitions: set[str],
    before: float,
) -> list[str]:
    """``<scratch>/<partition>/staging/<folder>``: where checkpoints for S3 are written before
    upload."""
    staged = {
        (path.parent.parent.name, path.name): _newest_modified(path)
        for path in Path(launcher.scratch()).glob("*/staging/*")
        if path.is_dir()
    }
    published = {
        (partition, folder)
        for partition, folder in staged
        if launcher.store(partition).exists(f"{folder}/{MANIFEST}")
    }
    deleted = []
    for partition, folder in staging_to_delete(staged, published, deleted_partitions, before):
        path = launcher.store(partition).staging_folder(folder)
        shutil.rmtree(path, ignore_errors=True)
        context.log.info(f"deleted local staging {path}")
        deleted.append(str(path))
    return deleted


def _newest_modified(folder: Path) -> float:
    return max(
        (path.stat().st_mtime for path in folder.rglob("*") if path.is_file()),
        default=folder.stat().st_mtime,
    )


@job(
    description="Retention (daily): vacuum the lake and delete checkpoints and staging nothing "
    "registered needs."
)
def retention_job():
    vacuum_lake()
    prune_checkpoints()


retention_schedule = ScheduleDefinition(
    name="daily_retention",
    job=retention_job,
    cron_schedule="30 3 * * *",
    execution_timezone="UTC",
    default_status=DefaultScheduleStatus.RUNNING,
    description="Every day at 03:30 UTC (after the nightly retrain), apply the retention window "
    "(PIPELINE_RETENTION_DAYS).",
)
