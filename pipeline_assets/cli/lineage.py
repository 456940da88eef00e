"""From a registered model version back to the landing files that fed it
(``pipeline-assets lineage``).

Every link is read from where it was recorded: the model version's tags (partition, Delta versions),
its MLflow run (checkpoint and export URIs, metrics), the snapshot's manifest in gold/snapshots or
gold/preference_snapshots (which ingest batches' shards), silver at the pinned version (which
sources of those batches it kept records of; an sft snapshot's conversations at theirs, under
``other_formats``), and the landing manifest (which file versions, with
their checksums). Silver's ``quality_models`` are the models (URI, settings, sha256) its batches
were scored with, read from the silver materialization that wrote the pinned version (from the
Dagster instance, when one is given). A DPO version also names the sft model version it started from
(``reference_model``), whose own lineage follows under ``started_from``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from pipeline_assets.defs.base_models import REFERENCE_PREFIX
from pipeline_assets.defs.format_tables import SFT_OBJECTIVE_TABLES, SFT_TABLES, FormatTables
from pipeline_assets.lib.gold.manifest import (
    PREFERENCE_SNAPSHOTS,
    SFT_SNAPSHOTS,
    SnapshotKind,
    read_manifest,
    snapshot_number,
)
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.mlflow_tracking import MlflowResource

_MLFLOW_METRICS = ("loss", "validation_loss")
_MLFLOW_METRIC_PREFIXES = ("eval/", "dpo_report/")


@dataclass(frozen=True)
class _Layers:
    """The tables one snapshot kind's lineage walks through: its own format's, and those of the
    other formats packed into the same shards (an sft snapshot's conversations)."""

    kind: SnapshotKind
    silver: tuple[str, str]
    bronze: tuple[str, str]
    others: tuple[FormatTables, ...] = ()


_SFT = _Layers(
    SFT_SNAPSHOTS,
    tuple(SFT_TABLES.silver.path),
    tuple(SFT_TABLES.bronze.path),
    tuple(tables for tables in SFT_OBJECTIVE_TABLES if tables is not SFT_TABLES),
)
_PREFERENCE = _Layers(
    PREFERENCE_SNAPSHOTS, ("silver", "preference_pairs"), ("bronze", "preference_records")
)


def parse_model_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``name@alias`` -> (name, alias, None); ``name/version`` -> (name, None, version)."""
    if "@" in spec:
        name, alias = spec.split("@", 1)
        return name, alias, None
    if "/" in spec:
        name, version = spec.rsplit("/", 1)
        if not version.isdigit():
            raise ValueError(f"{spec!r}: the version after '/' must be a number")
        return name, None, version
    raise ValueError(
        f"{spec!r}: write MODEL@ALIAS (e.g. sft-model@champion) or MODEL/VERSION (e.g. sft-model/3)"
    )


def resolve_version(mlflow_tracking: MlflowResource, spec: str):
    name, alias, number = parse_model_spec(spec)
    found = (
        mlflow_tracking.version_by_alias(name, alias)
        if alias
        else mlflow_tracking.existing_version(name, number)
    )
    if found is None:
        raise ValueError(
            f"{spec}: no such model version in the registry at "
            f"{mlflow_tracking.shown_tracking_uri()}"
        )
    return found


def model_lineage(
    spec: str,
    mlflow_tracking: MlflowResource,
    lake: LakeResource,
    instance: DagsterInstance | None = None,
) -> dict:
    version = resolve_version(mlflow_tracking, spec)
    tags = version.tags
    layers = _PREFERENCE if tags["partition"].startswith(PREFERENCE_SNAPSHOTS.prefix) else _SFT
    run = mlflow_tracking.client().get_run(version.run_id)
    snapshot = read_manifest(lake.uri, snapshot_number(tags["partition"], layers.kind), layers.kind)
    batches = list(snapshot.batches)
    silver = _table(lake, tags, layers.silver, batches)
    if instance is not None:
        silver["quality_models"] = silver_quality_models(instance, silver)
    others = {
        tables.fmt.name: {
            layer: _table(lake, tags, tuple(key.path), batches)
            for layer, key in (("silver", tables.silver), ("bronze", tables.bronze))
        }
        for tables in layers.others
        if _int(tags.get(f"delta.{tables.silver.to_user_string()}")) is not None
    }
    lineage = {
        "model": {
            "name": version.name,
            "version": str(version.version),
            "aliases": list(version.aliases),
            "source": version.source,
        },
        "mlflow_run": {
            "run_id": run.info.run_id,
            "experiment_id": run.info.experiment_id,
            "status": run.info.status,
            "git_commit": run.data.tags.get("git_commit"),
            "dagster_run_id": run.data.tags.get("dagster_run_id"),
            "metrics": {
                k: v
                for k, v in sorted(run.data.metrics.items())
                if k in _MLFLOW_METRICS or k.startswith(_MLFLOW_METRIC_PREFIXES)
            },
        },
        "base_model": {"uri": tags["base_model.uri"], "sha256": tags["base_model.sha256"]}
        if "base_model.uri" in tags
        else None,  # None: a preset trained from scratch
        "checkpoint": {
            "partition": tags["partition"],
            "export_uri": run.data.tags.get("export_uri"),
            "best_checkpoint_uri": run.data.tags.get("best_checkpoint_uri"),
        },
        "gold": {
            "snapshot": snapshot.key,
            "snapshots_version": snapshot.number,
            "sequences_version": snapshot.sequences_version,
            "tokenizer_version": snapshot.tokenizer_version,
            "batches": batches,
            "uri": lake.table_uri(*layers.kind.sequences_table),
        },
        "silver": silver,
        "bronze": _table(lake, tags, layers.bronze, batches),
        # formats packed into the same shards (conversations beside sft records), by format name
        "other_formats": others,
        "cost": json.loads(tags["cost_usd"])
        if "cost_usd" in tags
        else None,  # recorded for sft versions
        "landing_files": _landing_files(
            lake, [silver, *(other["silver"] for other in others.values())], batches
        ),
    }
    if layers is _PREFERENCE:
        lineage["gold"]["reference_logps_version"] = _int(tags.get("delta.gold/reference_logps"))
        lineage["started_from"] = (
            {"base_model": lineage["base_model"]}
            if tags["reference_model"].startswith(REFERENCE_PREFIX)
            else model_lineage(tags["reference_model"], mlflow_tracking, lake, instance)
        )
    return lineage


def _table(lake: LakeResource, tags: dict, table: tuple[str, str], batches: list[str]) -> dict:
    """One silver or bronze table of the lineage: its Delta version as the model's tags pin it."""
    name = "/".join(table)
    return {
        "table": name,
        "version": _int(tags.get(f"delta.{name}")),
        "batches": batches,
        "uri": lake.table_uri(*table),
    }


def silver_quality_models(instance: DagsterInstance, table: dict) -> list[dict]:
    """The quality models each of the silver ``table``'s batches was scored with at its pinned
    version: one entry per set of models, with its batches (models None: not recorded)."""
    key = AssetKey(table["table"].split("/"))
    by_models: dict[str, list[str]] = {}
    for batch in table["batches"]:
        models = _batch_quality_models(instance, key, batch, table["version"])
        by_models.setdefault(json.dumps(models, sort_keys=True), []).append(batch)
    return [{"batches": batches, "models": json.loads(m)} for m, batches in by_models.items()]


def _batch_quality_models(
    instance: DagsterInstance, key: AssetKey, batch: str, version: int | None
) -> list[dict] | None:
    """From the batch's latest materialization at or before the table's ``version``."""
    records_filter = AssetRecordsFilter(asset_key=key, asset_partitions=[batch])
    cursor = None
    while True:
        found = instance.fetch_materializations(records_filter, limit=100, cursor=cursor)
        for record in found.records:  # newest first
            metadata = record.asset_materialization.metadata
            written = metadata.get("delta_version")
            if version is None or (written is not None and written.value <= version):
                models = metadata.get("quality_models")
                return None if models is None else models.value
        if not found.has_more:
            return None
        cursor = found.cursor


def _landing_files(lake: LakeResource, silver: list[dict], batches: list[str]) -> list[dict]:
    """The landing files of ``batches`` from the sources the ``silver`` tables (``_table``s, each
    at its version) kept records of (a batch may hold sources of other record formats, which fed
    other models)."""
    manifest = lake.read("landing", "manifest", where=pl.col("batch_id").is_in(batches))
    fed = pl.concat(
        [
            lake.scan(*table["table"].split("/"), version=table["version"])
            .filter(pl.col("batch_id").is_in(batches))
            .select("batch_id", "source")
            .unique()
            .collect()
            for table in silver
        ]
    )
    files = manifest.join(fed.unique(), on=["batch_id", "source"], how="semi")
    return (
        files.select("uri", "source", "batch_id", "checksum", "size")
        .sort("batch_id", "uri")
        .to_dicts()
    )


def _int(value: str | None) -> int | None:
    return int(value) if value not in (None, "None", "") else None
