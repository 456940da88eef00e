"""evaluation/report: the candidate and the champion on exactly the same held-out data, per
slice; a first fine-tune of a base model, the candidate and the base model it started from."""

import tempfile
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from pipeline_assets.contracts import EvaluationSlice, conform, polars_schema, validate
from pipeline_assets.defs.automation import after_upstream_passes
from pipeline_assets.defs.base_models import tokenizer_base_model
from pipeline_assets.defs.format_tables import SFT_OBJECTIVE_TABLES
from pipeline_assets.defs.keys import (
    EVALUATION_REPORT,
    REFERENCE_BASE_MODEL,
    REFERENCE_EVAL_SETS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import data_snapshots
from pipeline_assets.defs.policies import RegistryPolicy
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.scoring import run_scoring_program
from pipeline_assets.defs.snapshots import partition_metadata, snapshot_versions
from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.manifest import read_manifest, sequences_scan
from pipeline_assets.lib.gold.sequences import SCORED_COLUMNS, pack_documents
from pipeline_assets.lib.ops.charts import slice_bars_png
from pipeline_assets.lib.silver.decontam import NO_EVAL_SETS
from pipeline_assets.lib.training.eval_sample import capped_validation
from pipeline_assets.lib.training.promotion import OVERALL
from pipeline_assets.lib.training.torchrun import SCORER_MODULE
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.launcher import TorchrunLauncher
from pipeline_assets.resources.mlflow_tracking import MlflowResource

_SAMPLED_COLUMNS = (
    "input_ids",
    "loss_mask",
    "position_ids",
    "document_lengths",
    "record_ids",
    "real_tokens",
)


@asset(
    key=EVALUATION_REPORT,
    group_name="evaluation",
    deps=[TRAINING_CHECKPOINT, REFERENCE_EVAL_SETS, REFERENCE_BASE_MODEL],
    partitions_def=data_snapshots,
    kinds={"delta", "pytorch", "mlflow"},
    automation_condition=after_upstream_passes(),
    retry_policy=TRANSIENT,  # MLflow's SQLite takes one writer at a time
    # with registry/model_version: one of them at a time (the instance's pool limit)
    pool="model_registry",
    description="Loss and perplexity on gold's validation split (overall and per source, "
    "conversation sources included) and on "
    "the eval-set responses, for the candidate and the current champion on the same rows (with "
    "no champion yet, the base model the candidate was fine-tuned from).",
)
def evaluation_report(
    context: AssetExecutionContext,
    lake: LakeResource,
    eval_sets: EvalSetsResource,
    launcher: TorchrunLauncher,
    mlflow_tracking: MlflowResource,
    registry_policy: RegistryPolicy,
    base_model: BaseModelResource,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    partition = context.partition_key
    versions = snapshot_versions(context.instance, partition)
    trained = partition_metadata(context.instance, TRAINING_CHECKPOINT, partition)
    if trained is None:
        raise Failure(
            allow_retries=False,
            description=f"training/checkpoint has no materialization for {partition}: train it "
            "first",
        )
    data = EvaluationData.load(lake, eval_sets, versions, registry_policy.eval_max_tokens)
    context.log.info(
        f"scoring {data.validation_sequences[0]} of {data.validation_sequences[1]} validation "
        f"sequences ({data.validation_tokens[0]:,} of {data.validation_tokens[1]:,} tokens; cap "
        f"{registry_policy.eval_max_tokens:,})"
    )
    candidate_dir, problem = launcher.store(partition).fetch_verified("final")
    if candidate_dir is None:
        raise Failure(
            allow_retries=False,
            description=f"the exported model of {partition} is not usable: {problem}",
        )

    seen = mlflow_tracking.version_by_alias(registry_policy.model_name, "champion")
    started_from = (
        None if seen else tokenizer_base_model(lake, versions["gold/tokenizer"], base_model)
    )
    champion, champion_note = comparable_champion(
        seen,
        registry_policy.model_name,
        trained["mlflow_run_id"],
        versions["gold/tokenizer"],
        f"the candidate is judged against the base model it was fine-tuned from "
        f"({base_model.uri}), scored on the same rows"
        if started_from
        else "the candidate is judged against the uniform baseline",
    )
    models = {"candidate": (candidate_dir, None)}
    if started_from is not None:
        models["base_model"] = (Path(started_from.path), f"base {started_from.version[:12]}")
    scratch = Path(launcher.scratch()) / "evaluation"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as folder:
        if champion is not None:
            model_dir = mlflow_tracking.download_model(
                registry_policy.model_name, str(champion.version), Path(folder)
            )
            models["champion"] = (model_dir, str(champion.version))
        losses = score_under_torchrun(
            context,
            launcher,
            data.rows,
            {role: path for role, (path, _) in models.items()},
            Path(folder),
        )
    frames = [
        data.report(losses[role], partition, role, version) for role, (_, version) in models.items()
    ]
    context.log.info(
        f"candidate: overall loss {frames[0].filter(pl.col('slice') == OVERALL)['loss'][0]:.4f}"
    )
    context.log.info(champion_note)

    report = validate(conform(pl.concat(frames), EvaluationSlice), EvaluationSlice)
    commit = lake.replace_partition(
        "evaluation", "report", report, column="partition", value=partition
    )
    comparison = _comparison(report)
    picture = slice_bars_png(
        comparison["slice"].to_list(),
        comparison["candidate"].to_list(),
        comparison["reference"].to_list() if champion or started_from else None,
        Path(launcher.scratch()) / "reports" / partition / "evaluation.png",
        f"{partition}: candidate vs champion (v{champion.version})"
        if champion
        else f"{partition}: candidate vs the base model"
        if started_from
        else f"{partition}: candidate",
    )
    _log_to_mlflow(mlflow_tracking, trained["mlflow_run_id"], report, picture)
    overall = comparison.filter(pl.col("slice") == OVERALL).row(0, named=True)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(EvaluationSlice),
                upstream_versions=versions,
                input_bytes=data.validation.estimated_size(),
                stopwatch=stopwatch,
            ),
            "candidate_loss": overall["candidate"],
            "candidate_perplexity": overall["candidate_perplexity"],
            "champion_loss": overall["champion"],
            "base_model_loss": overall["base_model"],
            "champion_version": str(champion.version) if champion else None,
            # registry/model_version refuses to promote on these numbers once the alias has moved
            "champion_at_evaluation": str(seen.version) if seen else None,
            "champion": champion_note,
            "slices": table_metadata(comparison),
            "picture": MetadataValue.path(str(picture)),
            "validation_records": data.validation_records,
            "validation_sequences_scored": data.validation_sequences[0],
            "validation_sequences": data.validation_sequences[1],
            "validation_tokens_scored": data.validation_tokens[0],
            "validation_tokens": data.validation_tokens[1],
            "eval_max_tokens": registry_policy.eval_max_tokens,
            "eval_items": data.eval_items,
            "eval_set_tokens": data.eval_set_tokens,
            "scored_on": data.scored_on,
            "models_scored": len(frames),
            "tokens_scored": data.tokens_per_model * len(frames),
        }
    )


class EvaluationData:
    """The rows both models are scored on, loaded once at the snapshot's pinned versions."""

    def __init__(
        self,
        validation: pl.DataFrame,
        all_validation: pl.DataFrame,
        eval_packed: pl.DataFrame,
        eval_tokens: int,
        eval_items: int,
        slices: pl.DataFrame,
    ):
        """validation: the sampled sequences; all_validation: sequence_index and real_tokens of
        every one; eval_packed: the eval-set items' responses, packed like gold."""
        self.validation, self.slices = validation, slices
        self.rows = pl.concat([frame.select(SCORED_COLUMNS) for frame in (validation, eval_packed)])
        self.validation_sequences = (
            validation.height,
            all_validation.height,
        )  # (scored, in the snapshot)
        self.validation_tokens = (
            int(validation["real_tokens"].sum()),
            int(all_validation["real_tokens"].sum()),
        )
        self.validation_records = int(slices.filter(pl.col("slice") == OVERALL).height)
        self.eval_items, self.eval_set_tokens = eval_items, eval_tokens
        self.scored_on = (
            "the validation split and the eval sets"
            if eval_items
            else f"the validation split alone: {NO_EVAL_SETS}"
        )
        self.tokens_per_model = int(validation["real_tokens"].sum()) + self.eval_set_tokens

    @classmethod
    def load(
        cls, lake: LakeResource, eval_sets: EvalSetsResource | None, versions: dict, max_tokens: int
    ) -> "EvaluationData":
        """Without ``eval_sets``, the validation sample alone (its slices by source), nothing
        encoded."""
        manifest = read_manifest(lake.uri, versions["gold/snapshots"])
        validation, sizes = capped_validation(
            manifest, sequences_scan(lake.uri, manifest), max_tokens, list(_SAMPLED_COLUMNS)
        )
        if sizes.is_empty():
            raise Failure(
                allow_retries=False, description=f"{manifest.key} has no validation sequences"
            )
        record_ids = validation["record_ids"].explode().unique()
        sources = _record_sources(lake, versions, record_ids)
        slices = [
            pl.DataFrame({"record_id": record_ids, "slice": OVERALL}),
            sources.select("record_id", slice=pl.lit("source:") + pl.col("source")),
        ]
        items = None if eval_sets is None else eval_sets.items(eval_sets.files())
        if items is None or items.is_empty():
            return cls(
                validation,
                sizes,
                validation.select(SCORED_COLUMNS).clear(),
                0,
                0,
                pl.concat(slices),
            )
        items = items.with_columns(
            record_id=pl.concat_str(pl.lit("eval:"), "eval_set", pl.lit(":"), "item_id"),
            system=pl.lit(None, pl.String),
        )
        slices.append(items.select("record_id", slice=pl.lit("eval:") + pl.col("eval_set")))
        tokenizer_row = lake.read("gold", "tokenizer", version=versions["gold/tokenizer"])
        encoder = chat_encoder(EncoderSpec.from_row(tokenizer_row.row(0, named=True)))
        seq_len = int(validation["input_ids"].list.len().max())
        encoded = encoder.encode_records(items)
        eval_packed = pack_documents(encoded, seq_len, encoder.pad_id)
        return cls(
            validation,
            sizes,
            eval_packed,
            int(encoded["n_tokens"].sum()),
            encoded.height,
            pl.concat(slices),
        )

    def report(
        self, document_losses: pl.DataFrame, partition: str, role: str, version: str | None
    ) -> pl.DataFrame:
        """One model's slices from its per-document losses on ``rows``."""
        from pipeline_assets.trainer.evaluate import (
            slice_losses,  # polars only, but its module loads torch
        )

        return slice_losses(document_losses, self.slices).with_columns(
            partition=pl.lit(partition),
            model=pl.lit(role),
            model_version=pl.lit(version, pl.String),
            evaluated_at=pl.lit(datetime.now(timezone.utc)),
        )


def _record_sources(lake: LakeResource, versions: dict, record_ids: pl.Series) -> pl.DataFrame:
    """record_id and source of ``record_ids``, from the silver table of each format packed into the
    snapshot (sft records, conversations) at the version it pins: two columns, not the text."""
    return pl.concat(
        [
            lake.scan(*tables.silver.path, version=version)
            .select("record_id", "source")
            .filter(pl.col("record_id").is_in(record_ids.implode()))
            .collect()
            for tables in SFT_OBJECTIVE_TABLES
            # silver/records unpinned is read at its newest, as before conversations were
            if (version := versions.get(tables.silver.to_user_string())) is not None
            or tables.fmt is SFT
        ]
    )


def score_under_torchrun(
    context: AssetExecutionContext,
    launcher: TorchrunLauncher,
    rows: pl.DataFrame,
    models: dict[str, Path],
    folder: Path,
) -> dict[str, pl.DataFrame]:
    """Per model, its per-document losses on ``rows``, scored by the scoring program under torchrun
    (a rank a GPU of the launcher's, else one rank with its threads), not in this process."""
    rows_file, out = folder / "rows.parquet", folder / "scores"
    rows.write_parquet(rows_file)
    models_args = [arg for role, path in models.items() for arg in ("--model", f"{role}={path}")]
    run_scoring_program(
        context,
        launcher,
        SCORER_MODULE,
        ["--rows", str(rows_file), "--out", str(out), *models_args],
        f"scoring {len(models)} model(s) on {rows.height} sequences",
    )
    return {
        role: (
            pl.concat([pl.read_parquet(part) for part in sorted(out.glob(f"{role}-rank*.parquet"))])
            .group_by("record_id")
            .agg(pl.sum("loss_sum"), pl.sum("tokens"))
        )
        for role in models
    }


def comparable_champion(
    champion, model_name: str, candidate_run_id: str, tokenizer_version: int | None, alone: str
):
    """The champion to compare with (``champion``, the alias's version now), or None with the
    reason; ``alone`` says what the candidate is judged against without one."""
    if champion is None:
        return None, f"no champion of {model_name} yet: {alone}"
    if champion.run_id == candidate_run_id:
        return None, f"the candidate is already champion ({model_name} v{champion.version})"
    tokenizer = champion.tags.get("delta.gold/tokenizer")
    if tokenizer != str(tokenizer_version):
        return None, (
            f"champion v{champion.version} used gold/tokenizer v{tokenizer}, the candidate's data "
            f"v{tokenizer_version}: they would read other text"
        )
    return champion, f"champion: {model_name} v{champion.version}, scored on the same rows"


def _comparison(report: pl.DataFrame) -> pl.DataFrame:
    """One row per slice: the candidate's loss beside the champion's or the base model's (the
    reference it is judged against), and its change on it."""
    wide = report.pivot(on="model", index="slice", values="loss")
    for role in ("champion", "base_model"):
        if role not in wide.columns:
            wide = wide.with_columns(pl.lit(None, pl.Float64).alias(role))
    perplexity = report.filter(pl.col("model") == "candidate").select(
        "slice", candidate_perplexity="perplexity"
    )
    return (
        wide.join(perplexity, on="slice")
        .with_columns(reference=pl.coalesce("champion", "base_model"))
        .with_columns(
            relative_change=(pl.col("candidate") - pl.col("reference")) / pl.col("reference")
        )
        .select(
            "slice",
            "candidate",
            "champion",
            "base_model",
            "reference",
            "relative_change",
            "candidate_perplexity",
        )
        .sort(pl.col("slice") != OVERALL, "slice")
    )


def _log_to_mlflow(
    mlflow_tracking: MlflowResource, run_id: str, report: pl.DataFrame, picture: Path
) -> None:
    client = mlflow_tracking.client()
    for row in report.iter_rows(named=True):
        prefix = "eval" if row["model"] == "candidate" else "eval_champion"
        client.log_metric(run_id, f"{prefix}/{row['slice'].replace(':', '_')}_loss", row["loss"])
    client.log_artifact(run_id, str(picture), "evaluation")
