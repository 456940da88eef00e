"""From a registered model version back to the landing files that fed it (``pipeline-assets lineage``).

Every link is read from where it was recorded: the model version's tags (partition, Delta versions),
its MLflow run (checkpoint and export URIs, metrics), the snapshot's manifest in gold/snapshots (which
ingest batches' shards), and the landing manifest (which file versions, with their checksums).
"""

from __future__ import annotations

import json

import polars as pl

from pipeline_assets.lib.snapshot_manifest import read_manifest, snapshot_number
from pipeline_assets.resources import LakeResource, MlflowResource


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
    raise ValueError(f"{spec!r}: write MODEL@ALIAS (e.g. sft-model@champion) or MODEL/VERSION (e.g. sft-model/3)")


def resolve_version(mlflow_tracking: MlflowResource, spec: str):
    name, alias, number = parse_model_spec(spec)
    found = mlflow_tracking.version_by_alias(name, alias) if alias else mlflow_tracking.existing_version(name, number)
    if found is None:
        raise ValueError(f"{spec}: no such model version in the registry at {mlflow_tracking.shown_tracking_uri()}")
    return found


def model_lineage(spec: str, mlflow_tracking: MlflowResource, lake: LakeResource) -> dict:
    version = resolve_version(mlflow_tracking, spec)
    tags = version.tags
    run = mlflow_tracking.client().get_run(version.run_id)
    silver_version, gold_version = int(tags["delta.silver/records"]), int(tags["delta.gold/sequences"])
    snapshot = read_manifest(lake.uri, snapshot_number(tags["partition"]))
    batches = list(snapshot.batches)
    manifest = lake.read("landing", "manifest", where=pl.col("batch_id").is_in(batches))
    files = manifest.select("uri", "source", "batch_id", "checksum", "size").sort("batch_id", "uri")
    return {
        "model": {"name": version.name, "version": str(version.version), "aliases": list(version.aliases),
                  "source": version.source},
        "mlflow_run": {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "status": run.info.status,
                       "git_commit": run.data.tags.get("git_commit"), "dagster_run_id": run.data.tags.get("dagster_run_id"),
                       "metrics": {k: v for k, v in sorted(run.data.metrics.items())
                                   if k in ("loss", "validation_loss") or k.startswith("eval/")}},
        "checkpoint": {"partition": tags["partition"], "export_uri": run.data.tags.get("export_uri"),
                       "best_checkpoint_uri": run.data.tags.get("best_checkpoint_uri")},
        "gold": {"snapshot": snapshot.key, "snapshots_version": snapshot.number, "sequences_version": gold_version,
                 "tokenizer_version": _int(tags.get("delta.gold/tokenizer")), "batches": batches,
                 "uri": lake.table_uri("gold", "sequences")},
        "silver": {"records_version": silver_version, "batches": batches, "uri": lake.table_uri("silver", "records")},
        "bronze": {"records_version": _int(tags.get("delta.bronze/records")), "batches": batches,
                   "uri": lake.table_uri("bronze", "records")},
        "cost": json.loads(tags["cost_usd"]) if "cost_usd" in tags else None,  # versions registered before it was recorded: None
        "landing_files": files.to_dicts(),
    }


def _int(value: str | None) -> int | None:
    return int(value) if value not in (None, "None", "") else None
