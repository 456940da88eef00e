"""gold/reference_logps: DPO's reference pass, once per preference snapshot, with the sft
champion; with none yet, the base model the pairs' tokenizer came from (DPO on an instruct
model)."""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, AutomationCondition, Failure, MaterializeResult, asset

from pipeline_assets.contracts import GoldReferenceLogps, conform, polars_schema, validate
from pipeline_assets.defs.automation import REFERENCE_SOURCES
from pipeline_assets.defs.base_models import reference_name, tokenizer_base_model
from pipeline_assets.defs.keys import (
    GOLD_PREFERENCE_SNAPSHOTS,
    GOLD_REFERENCE_LOGPS,
    REFERENCE_BASE_MODEL,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata
from pipeline_assets.defs.partitions import preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.scoring import run_scoring_program
from pipeline_assets.lib.gold.manifest import (
    PREFERENCE_SNAPSHOTS,
    Manifest,
    read_manifest,
    sequences_scan,
    snapshot_number,
)
from pipeline_assets.lib.training.torchrun import REFERENCE_MODULE
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource

_ROW_COLUMNS = [
    "batch_id",
    "split",
    "sequence_index",
    "input_ids",
    "loss_mask",
    "position_ids",
    "pair_ids",
]


@asset(
    key=GOLD_REFERENCE_LOGPS,
    group_name="gold",
    deps=[GOLD_PREFERENCE_SNAPSHOTS, REFERENCE_BASE_MODEL],
    partitions_def=preference_snapshots,
    kinds={"delta", "pytorch"},
    automation_condition=AutomationCondition.on_missing().ignore(REFERENCE_SOURCES)
    & AutomationCondition.all_deps_blocking_checks_passed(),
    retry_policy=TRANSIENT,
    pool="model_registry",  # it reads the registry: one of its users at a time
    description="The reference model's summed response log-probabilities of every row of a "
    "preference snapshot, per document: DPO's reference pass, under torchrun, once per snapshot, "
    "so the DPO trainer holds one model. The reference is the sft champion when it runs, else the "
    "base model (named in each row); DPO starts from the same model.",
)
def gold_reference_logps(
    context: AssetExecutionContext,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    base_model: BaseModelResource,
) -> MaterializeResult:
    from pipeline_assets.trainer.reference import (
        read_reference_logps,  # polars only, but its module loads torch
    )

    stopwatch = Stopwatch()
    key = context.partition_key
    manifest = read_manifest(
        lake.uri, snapshot_number(key, PREFERENCE_SNAPSHOTS), PREFERENCE_SNAPSHOTS
    )
    reference = _reference_model(
        mlflow_tracking, registry_policy.model_name, manifest, lake, base_model
    )
    rows = sum(manifest.sequences_by_split().values())
    scratch = Path(launcher.scratch()) / "reference"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as folder:
        rows_file, out = Path(folder) / "rows.parquet", Path(folder) / "logps"
        sequences_scan(lake.uri, manifest).select(_ROW_COLUMNS).sink_parquet(
            rows_file
        )  # streamed, not held here
        model_dir = reference.folder(mlflow_tracking, Path(folder) / "model")
        run_scoring_program(
            context,
            launcher,
            REFERENCE_MODULE,
            ["--rows", str(rows_file), "--model", str(model_dir), "--out", str(out)],
            f"reference pass of {key} with {reference.name}: {rows} rows",
        )
        logps = read_reference_logps(out, expected_rows=rows)
    frame = logps.with_columns(snapshot=pl.lit(key), reference_model=pl.lit(reference.name))
    frame = validate(conform(frame, GoldReferenceLogps), GoldReferenceLogps)
    commit = lake.replace_partition(*GOLD_REFERENCE_LOGPS.path, frame, column="snapshot", value=key)
    documents = frame["reference_logps"].explode()
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(GoldReferenceLogps),
                upstream_versions={
                    PREFERENCE_SNAPSHOTS.sequences_name: manifest.sequences_version,
                    PREFERENCE_SNAPSHOTS.manifest_name: manifest.number,
                },
                input_bytes=0,
                stopwatch=stopwatch,
            ),
            "reference_model": reference.name,
            "reference_run_id": reference.run_id,
            "rows": frame.height,
            "documents": documents.len(),
            "mean_document_logp": round(float(documents.mean()), 4) if documents.len() else None,
        }
    )


@dataclass(frozen=True)
class Reference:
    """DPO's reference (and starting) model: a registered sft version, or the base model."""

    name: str  # MODEL/VERSION, or base_model/<sha256[:12]>
    run_id: str | None  # the registered version's MLflow run
    base_folder: str = ""  # the base model's local folder

    def folder(self, mlflow_tracking: MlflowResource, into: Path) -> Path:
        if self.base_folder:
            return Path(self.base_folder)
        model_name, version = self.name.rsplit("/", 1)
        return mlflow_tracking.download_model(model_name, version, into)


def _reference_model(
    mlflow_tracking: MlflowResource,
    model_name: str,
    manifest: Manifest,
    lake: LakeResource,
    base_model: BaseModelResource,
) -> Reference:
    """The sft champion, if its tokenizer is the one the snapshot's pairs were encoded with; with
    no champion, the base model that tokenizer came from."""
    champion = mlflow_tracking.version_by_alias(model_name, "champion")
    if champion is None:
        model = (
            tokenizer_base_model(lake, manifest.tokenizer_version, base_model)
            if base_model.configured
            else None
        )
        if model is not None:
            return Reference(reference_name(model), None, model.path)
        raise Failure(
            allow_retries=False,
            description=f"no {model_name} champion yet: DPO's reference model, and its "
            f"starting point, is the sft champion (or the base model PIPELINE_BASE_MODEL names); "
            f"materialize {manifest.key} again once registry/model_version has promoted one",
        )
    tokenizer = champion.tags.get("delta.gold/tokenizer")
    if tokenizer != str(manifest.tokenizer_version):
        trained_with = (
            f"was trained with gold/tokenizer v{tokenizer}"
            if tokenizer is not None
            else "records no gold/tokenizer version (delta.gold/tokenizer tag)"
        )
        raise Failure(
            allow_retries=False,
            description=f"{model_name} v{champion.version} {trained_with}, "
            f"{manifest.key} is encoded with v{manifest.tokenizer_version}: its token ids mean "
            "other text; cut a new preference snapshot once the champion and the shards share a "
            "tokenizer",
        )
    return Reference(f"{model_name}/{champion.version}", champion.run_id)
