"""evaluation/dpo_report: the DPO candidate and the DPO champion judged on the same held-out pairs
(implicit reward margins against the snapshot's stored reference log-probabilities), and the
candidate's sft validation loss against the sft champion's, so preference tuning is seen not to cost
the language model."""

import tempfile
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    AssetExecutionContext,
    DagsterInstance,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from pipeline_assets.contracts import DpoEvaluationSlice, conform, polars_schema, validate
from pipeline_assets.defs.automation import after_upstream_passes
from pipeline_assets.defs.evaluation.assets import (
    EvaluationData,
    comparable_champion,
    score_under_torchrun,
)
from pipeline_assets.defs.keys import (
    EVALUATION_DPO_REPORT,
    GOLD_REFERENCE_LOGPS,
    SFT_SLICE,
    SILVER_PREFERENCE_PAIRS,
    TRAINING_DPO_CHECKPOINT,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import data_snapshots, preference_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.scoring import run_scoring_program
from pipeline_assets.defs.snapshots import (
    partition_metadata,
    preference_pairs_version,
    snapshot_versions,
)
from pipeline_assets.lib.gold.manifest import (
    PREFERENCE_SNAPSHOTS,
    Manifest,
    read_manifest,
    sequences_scan,
    snapshot_number,
)
from pipeline_assets.lib.gold.sequences import SCORED_COLUMNS
from pipeline_assets.lib.ops.charts import slice_bars_png
from pipeline_assets.lib.training.eval_sample import capped_validation
from pipeline_assets.lib.training.preference_eval import (
    OVERALL,
    pair_margins,
    preference_slices,
    within_tolerance,
)
from pipeline_assets.lib.training.torchrun import REFERENCE_MODULE
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource

_KEY = [
    "batch_id",
    "split",
    "sequence_index",
]  # a packed row's key in gold and in gold/reference_logps
_TAKEN_COLUMNS = ["batch_id", "input_ids", "loss_mask", "position_ids", "pair_ids", "real_tokens"]


@asset(
    key=EVALUATION_DPO_REPORT,
    group_name="evaluation",
    deps=[TRAINING_DPO_CHECKPOINT, GOLD_REFERENCE_LOGPS],
    partitions_def=preference_snapshots,
    kinds={"delta", "pytorch", "mlflow"},
    automation_condition=after_upstream_passes(),
    retry_policy=TRANSIENT,  # MLflow's SQLite takes one writer at a time
    pool="model_registry",  # it reads the registry: one of its users at a time
    description="Preference accuracy and mean implicit reward margin on a preference snapshot's "
    "held-out pairs (overall and per source), for the DPO candidate and the DPO champion on the "
    "same pairs, and the candidate's sft validation loss against the sft champion's on the newest "
    "data snapshot.",
)
def evaluation_dpo_report(
    context: AssetExecutionContext,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    partition = context.partition_key
    trained = partition_metadata(context.instance, TRAINING_DPO_CHECKPOINT, partition)
    if trained is None:
        raise Failure(
            allow_retries=False,
            description=f"training/dpo_checkpoint has no materialization for "
            f"{partition}: train it first",
        )
    manifest = read_manifest(
        lake.uri, snapshot_number(partition, PREFERENCE_SNAPSHOTS), PREFERENCE_SNAPSHOTS
    )
    reference_version = _reference_version(trained, partition)
    pairs = HeldOutPairs.load(
        lake, context.instance, manifest, reference_version, registry_policy.eval_max_tokens
    )
    context.log.info(
        f"judging {pairs.pairs} held-out pairs in {pairs.sequences[0]} of {pairs.sequences[1]} "
        f"validation rows ({pairs.tokens[0]:,} of {pairs.tokens[1]:,} tokens; "
        f"cap {registry_policy.eval_max_tokens:,})"
    )
    candidate_dir, problem = launcher.store(partition).fetch_verified("final")
    if candidate_dir is None:
        raise Failure(
            allow_retries=False,
            description=f"the exported DPO model of {partition} is not usable: {problem}",
        )

    dpo_name = registry_policy.dpo_model_name
    seen = mlflow_tracking.version_by_alias(dpo_name, "champion")
    champion, champion_note = comparable_champion(
        seen,
        dpo_name,
        trained["mlflow_run_id"],
        manifest.tokenizer_version,
        "the candidate is judged alone",
    )
    beta = float(trained["beta"])
    scratch = Path(launcher.scratch()) / "evaluation"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as folder:
        models = {"candidate": (Path(candidate_dir), None)}
        if champion is not None:
            champion_dir = mlflow_tracking.download_model(
                dpo_name, str(champion.version), Path(folder) / "dpo-champion"
            )
            models["champion"] = (champion_dir, f"{dpo_name}/{champion.version}")
        margins = {
            role: pairs.margins(
                _policy_logps(context, launcher, pairs, path, Path(folder) / role), beta
            )
            for role, (path, _) in models.items()
        }
        sft, sft_note = _sft_comparison(
            context,
            lake,
            launcher,
            mlflow_tracking,
            registry_policy,
            Path(candidate_dir),
            manifest,
            Path(folder) / "sft",
        )
    context.log.info(champion_note)
    context.log.info(sft_note)

    slices = {role: preference_slices(frame, pairs.sources) for role, frame in margins.items()}
    report = _report_frame(
        partition, slices, {role: version for role, (_, version) in models.items()}, sft
    )
    report = validate(conform(report, DpoEvaluationSlice), DpoEvaluationSlice)
    commit = lake.replace_partition(
        *EVALUATION_DPO_REPORT.path, report, column="partition", value=partition
    )
    comparison = _comparison(report)
    reports = Path(launcher.scratch()) / "reports" / partition
    picture = _accuracy_picture(comparison, reports / "dpo_evaluation.png", partition, champion)
    margins_file = _write_margins(margins, pairs.sources, reports / "dpo_pair_margins.parquet")
    _log_to_mlflow(mlflow_tracking, trained["mlflow_run_id"], report, [picture, margins_file])
    overall = {
        role: frame.filter(pl.col("slice") == OVERALL).row(0, named=True)
        for role, frame in slices.items()
    }
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(DpoEvaluationSlice),
                upstream_versions=pairs.versions,
                input_bytes=int(pairs.rows.estimated_size()),
                stopwatch=stopwatch,
            ),
            "candidate_preference_accuracy": overall["candidate"]["preference_accuracy"],
            "candidate_mean_margin": overall["candidate"]["mean_margin"],
            "champion_preference_accuracy": overall.get("champion", {}).get("preference_accuracy"),
            "champion_mean_margin": overall.get("champion", {}).get("mean_margin"),
            "champion_version": models["champion"][1] if champion is not None else None,
            "champion_at_evaluation": str(seen.version)
            if seen
            else None,  # what a DPO gate would judge against
            "champion": champion_note,
            "beta": beta,
            "reference_model": trained.get("reference_model"),
            "slices": table_metadata(comparison),
            "sft_validation": MetadataValue.json(sft or {}),
            "sft_candidate_loss": sft["candidate_loss"] if sft else None,
            "sft_champion_loss": sft["champion_loss"] if sft else None,
            "sft_within_tolerance": sft["within_tolerance"] if sft else None,
            "sft_comparison": sft_note,
            "picture": MetadataValue.path(str(picture)),
            "pair_margins": MetadataValue.path(str(margins_file)),
            "validation_pairs": pairs.pairs,
            "validation_sequences_scored": pairs.sequences[0],
            "validation_sequences": pairs.sequences[1],
            "validation_tokens_scored": pairs.tokens[0],
            "validation_tokens": pairs.tokens[1],
            "eval_max_tokens": registry_policy.eval_max_tokens,
            "dpo_models_scored": len(models),
        }
    )


class HeldOutPairs:
    """A preference snapshot's validation rows, capped in tokens, with their stored reference
    log-probabilities and each pair's source: what every model is judged on."""

    def __init__(
        self, rows: pl.DataFrame, sources: pl.DataFrame, all_sizes: pl.DataFrame, versions: dict
    ):
        self.rows, self.sources, self.versions = rows, sources, versions
        self.pairs = int(rows["pair_ids"].list.len().sum())
        self.sequences = (rows.height, all_sizes.height)  # (scored, in the snapshot)
        self.tokens = (int(rows["real_tokens"].sum()), int(all_sizes["real_tokens"].sum()))

    @classmethod
    def load(
        cls,
        lake: LakeResource,
        instance: DagsterInstance,
        manifest: Manifest,
        reference_version: int,
        max_tokens: int,
    ) -> "HeldOutPairs":
        taken, sizes = capped_validation(
            manifest, sequences_scan(lake.uri, manifest), max_tokens, _TAKEN_COLUMNS
        )
        if sizes.is_empty():
            raise Failure(
                allow_retries=False, description=f"{manifest.key} has no validation rows to judge"
            )
        rows = _with_reference(_local_keys(taken, manifest), lake, manifest.key, reference_version)
        pairs_version = _pairs_version(lake, instance, manifest)
        sources = (
            lake.scan(*SILVER_PREFERENCE_PAIRS.path, version=pairs_version)
            .select(
                pl.col("record_id").alias("pair_id"), "source"
            )  # two columns of silver, not its text
            .filter(pl.col("pair_id").is_in(rows["pair_ids"].explode().unique()))
            .collect()
        )
        versions = {
            PREFERENCE_SNAPSHOTS.manifest_name: manifest.number,
            PREFERENCE_SNAPSHOTS.sequences_name: manifest.sequences_version,
            "gold/reference_logps": reference_version,
            "silver/preference_pairs": pairs_version,
            "gold/tokenizer": manifest.tokenizer_version,
        }
        return cls(rows, sources, sizes, versions)

    def margins(self, policy_logps: pl.DataFrame, beta: float) -> pl.DataFrame:
        """One model's margin per pair, from its per-document log-probabilities of ``rows`` (keyed
        like them)."""
        scored = self.rows.join(policy_logps, on=_KEY, how="left")
        if scored["policy_logps"].null_count():
            raise Failure(
                description=f"{scored['policy_logps'].null_count()} held-out row(s) came back "
                "unscored"
            )
        return pair_margins(scored, beta)


def _local_keys(taken: pl.DataFrame, manifest: Manifest) -> pl.DataFrame:
    """Rows taken by global index -> keyed as gold stores them (each shard's own sequence_index)."""
    offsets = manifest.offsets().filter(pl.col("split") == "validation")
    return (
        taken.join(offsets, on="batch_id")
        .with_columns(pl.col("sequence_index") - pl.col("offset"))
        .drop("offset")
    )


def _with_reference(
    rows: pl.DataFrame, lake: LakeResource, snapshot: str, version: int
) -> pl.DataFrame:
    reference = lake.read(
        *GOLD_REFERENCE_LOGPS.path, version=version, where=pl.col("snapshot") == snapshot
    )
    joined = rows.join(reference.select(*_KEY, "reference_logps"), on=_KEY, how="left")
    missing = joined["reference_logps"].null_count()
    if missing:
        raise Failure(
            allow_retries=False,
            description=f"gold/reference_logps v{version} lacks {missing} of "
            f"{snapshot}'s held-out rows: run its reference pass again",
        )
    return joined


def _reference_version(trained: dict, partition: str) -> int:
    """The gold/reference_logps version the candidate was trained against."""
    version = (trained.get("upstream_delta_versions") or {}).get("gold/reference_logps")
    if version is None:
        raise Failure(
            allow_retries=False,
            description=f"training/dpo_checkpoint of {partition} names no "
            "gold/reference_logps version: train it again",
        )
    return int(version)


def _pairs_version(lake: LakeResource, instance: DagsterInstance, manifest: Manifest) -> int:
    """The silver/preference_pairs version the snapshot's shards read; the newest when no write
    names it."""
    version = preference_pairs_version(instance, set(manifest.batches), manifest.sequences_version)
    return version if version is not None else lake.version(*SILVER_PREFERENCE_PAIRS.path)


def _policy_logps(
    context: AssetExecutionContext,
    launcher: TorchrunLauncher,
    pairs: HeldOutPairs,
    model_dir: Path,
    folder: Path,
) -> pl.DataFrame:
    """A model's per-document summed response log-probabilities of the held-out rows: the reference
    pass's program with this model, under torchrun."""
    from pipeline_assets.trainer.reference import (
        read_reference_logps,  # polars only, but its module loads torch
    )

    folder.mkdir(parents=True, exist_ok=True)
    rows_file, out = folder / "rows.parquet", folder / "logps"
    pairs.rows.select(*_KEY, "input_ids", "loss_mask", "position_ids", "pair_ids").write_parquet(
        rows_file
    )
    run_scoring_program(
        context,
        launcher,
        REFERENCE_MODULE,
        ["--rows", str(rows_file), "--model", str(model_dir), "--out", str(out)],
        f"{folder.name}: log-probabilities of {pairs.rows.height} held-out rows",
    )
    return read_reference_logps(out, expected_rows=pairs.rows.height).rename(
        {"reference_logps": "policy_logps"}
    )


def _sft_comparison(
    context: AssetExecutionContext,
    lake: LakeResource,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    policy: RegistryPolicy,
    candidate_dir: Path,
    manifest: Manifest,
    folder: Path,
) -> tuple[dict | None, str]:
    """The candidate's and the sft champion's loss on the newest data snapshot's validation rows
    (the sft evaluation's sample and scoring program), and whether the candidate stayed within the
    slice tolerance."""
    snapshot = _newest_data_snapshot(context.instance)
    if snapshot is None:
        return None, "no data snapshot: the sft validation loss is not compared"
    versions = snapshot_versions(context.instance, snapshot)
    champion = mlflow_tracking.version_by_alias(policy.model_name, "champion")
    if champion is None:
        return None, f"no {policy.model_name} champion: the sft validation loss is not compared"
    tokenizers = {
        str(versions["gold/tokenizer"]),
        str(manifest.tokenizer_version),
        champion.tags.get("delta.gold/tokenizer"),
    }
    if versions["gold/sequences"] is None or len(tokenizers) != 1:
        return None, (
            f"{snapshot}, {manifest.key} and {policy.model_name} v{champion.version} do not share "
            "one gold/tokenizer version: the sft validation loss is not compared"
        )
    data = EvaluationData.load(
        lake, None, versions, policy.eval_max_tokens
    )  # the validation rows alone
    folder.mkdir(parents=True, exist_ok=True)
    champion_dir = mlflow_tracking.download_model(
        policy.model_name, str(champion.version), folder / "model"
    )
    losses = score_under_torchrun(
        context,
        launcher,
        data.validation.select(SCORED_COLUMNS),
        {"candidate": candidate_dir, "champion": champion_dir},
        folder,
    )
    loss = {
        role: _overall_loss(data.report(frame, snapshot, role, None))
        for role, frame in losses.items()
    }
    within = within_tolerance(loss["candidate"], loss["champion"], policy.slice_tolerance)
    comparison = {
        "snapshot": snapshot,
        "champion_version": f"{policy.model_name}/{champion.version}",
        "candidate_loss": loss["candidate"],
        "champion_loss": loss["champion"],
        "relative_change": (loss["candidate"] - loss["champion"]) / loss["champion"],
        "slice_tolerance": policy.slice_tolerance,
        "within_tolerance": within,
        "validation_sequences_scored": data.validation_sequences[0],
    }
    verdict = "within" if within else "beyond"
    return comparison, (
        f"sft validation loss on {snapshot}: candidate {loss['candidate']:.4f}, "
        f"{policy.model_name} v{champion.version} {loss['champion']:.4f} "
        f"({comparison['relative_change']:+.2%}, {verdict} the tolerance "
        f"{policy.slice_tolerance:.2%})"
    )


def _newest_data_snapshot(instance: DagsterInstance) -> str | None:
    keys = instance.get_dynamic_partitions(data_snapshots.name)
    return max(keys, key=snapshot_number) if keys else None


def _overall_loss(slices: pl.DataFrame) -> float:
    return float(slices.filter(pl.col("slice") == OVERALL)["loss"][0])


def _report_frame(
    partition: str,
    slices: dict[str, pl.DataFrame],
    versions: dict[str, str | None],
    sft: dict | None,
) -> pl.DataFrame:
    """The table's rows: each model's preference slices, then the sft validation loss of both."""
    frames = [
        frame.with_columns(
            model=pl.lit(role),
            model_version=pl.lit(versions[role], pl.String),
            loss=pl.lit(None, pl.Float64),
        )
        for role, frame in slices.items()
    ]
    if sft is not None:
        frames.append(
            pl.DataFrame(
                {
                    "slice": [SFT_SLICE, SFT_SLICE],
                    "pairs": pl.Series([None, None], dtype=pl.Int64),
                    "preference_accuracy": pl.Series([None, None], dtype=pl.Float64),
                    "mean_margin": pl.Series([None, None], dtype=pl.Float64),
                    "model": ["candidate", "champion"],
                    "model_version": [None, sft["champion_version"]],
                    "loss": [sft["candidate_loss"], sft["champion_loss"]],
                }
            )
        )
    return pl.concat(frames, how="diagonal_relaxed").with_columns(
        partition=pl.lit(partition), evaluated_at=pl.lit(datetime.now(timezone.utc))
    )


def _comparison(report: pl.DataFrame) -> pl.DataFrame:
    """One row per slice: both models' accuracy (the loss on the sft slice) side by side."""
    measured = report.with_columns(value=pl.coalesce("preference_accuracy", "loss"))
    wide = measured.pivot(on="model", index="slice", values="value")
    if "champion" not in wide.columns:
        wide = wide.with_columns(champion=pl.lit(None, pl.Float64))
    candidate = report.filter(pl.col("model") == "candidate").select(
        "slice", "pairs", "mean_margin"
    )
    return (
        wide.join(candidate, on="slice", how="left")
        .select("slice", "pairs", "candidate", "champion", candidate_mean_margin="mean_margin")
        .sort(pl.col("slice") == SFT_SLICE, pl.col("slice") != OVERALL, "slice")
    )


def _accuracy_picture(comparison: pl.DataFrame, path: Path, partition: str, champion) -> Path:
    accuracy = comparison.filter(pl.col("slice") != SFT_SLICE)
    return slice_bars_png(
        accuracy["slice"].to_list(),
        accuracy["candidate"].to_list(),
        accuracy["champion"].to_list() if champion is not None else None,
        path,
        f"{partition}: candidate vs champion (v{champion.version})"
        if champion
        else f"{partition}: candidate",
        ylabel="preference accuracy",
    )


def _write_margins(margins: dict[str, pl.DataFrame], sources: pl.DataFrame, path: Path) -> Path:
    """Every pair's margin per model, to check or plot the report's numbers from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [frame.with_columns(model=pl.lit(role)) for role, frame in margins.items()]
    pl.concat(frames).join(sources, on="pair_id", how="left").write_parquet(path)
    return path


def _log_to_mlflow(
    mlflow_tracking: MlflowResource, run_id: str, report: pl.DataFrame, files: list[Path]
) -> None:
    client = mlflow_tracking.client()
    for row in report.iter_rows(named=True):
        # apart from the trainer's own eval/ metrics of the same run
        prefix = "dpo_report" if row["model"] == "candidate" else "dpo_report_champion"
        if row["slice"] == SFT_SLICE:
            client.log_metric(run_id, f"{prefix}/{SFT_SLICE}", row["loss"])
            continue
        name = "" if row["slice"] == OVERALL else f"{row['slice'].replace(':', '_')}_"
        client.log_metric(run_id, f"{prefix}/{name}preference_accuracy", row["preference_accuracy"])
        client.log_metric(run_id, f"{prefix}/{name}reward_margin", row["mean_margin"])
    for path in files:
        client.log_artifact(run_id, str(path), "dpo_evaluation")
