"""gold/tokenizer, and gold/sequences: each ingest batch's silver records (of every format trained
with sft's loss) tokenized and packed into its own shard."""

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from pipeline_assets.contracts import GoldSequence, GoldTokenizer, conform, polars_schema, validate
from pipeline_assets.defs.automation import after_upstream_passes, once_when_missing
from pipeline_assets.defs.batch_gates import BatchGates
from pipeline_assets.defs.format_tables import SFT_OBJECTIVE_TABLES
from pipeline_assets.defs.gold.checks import SHARD_CHECK_SPECS, judge_shard
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import (
    GOLD_SEQUENCES,
    GOLD_TOKENIZER,
    REFERENCE_BASE_MODEL,
    SILVER_RECORDS,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.retries import TRANSIENT, refusal
from pipeline_assets.lib.formats import SFT, RecordFormat, text_chars
from pipeline_assets.lib.gold.base_model import folder_encoder_spec, inspect_base_model
from pipeline_assets.lib.gold.chat_format import conversation_text
from pipeline_assets.lib.gold.encoder import EncoderSpec, chat_encoder
from pipeline_assets.lib.gold.manifest import read_manifest, sequences_scan, snapshot_number
from pipeline_assets.lib.gold.sequences import (
    SEQUENCES_PER_BLOCK,
    build_sequences,
    fit_long_records,
    gold_records,
    shard_seed,
    token_statistics,
    tokenize_stage,
)
from pipeline_assets.lib.gold.splits import SEARCH, VALIDATION, split_shares
from pipeline_assets.lib.gold.tokenizer import (
    check_tokenizer,
    tokenizer_from_json,
    tokenizer_to_json,
    train_bpe,
)
from pipeline_assets.lib.gold.tokenizer_sample import TokenizerSample, sample_for_tokenizer
from pipeline_assets.resources.base_model import SETTING as BASE_MODEL_SETTING
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.engine import BlockEngine, engine_used
from pipeline_assets.resources.lake import LakeResource

_KINDS = {"delta", "polars"}
SFT_OBJECTIVE_SILVER = [tables.silver for tables in SFT_OBJECTIVE_TABLES]
_LEFT_OUT_SHOWN = 1000  # rows of the left-out table in the metadata; the counts are always whole


def read_snapshot(lake: LakeResource, key: str) -> pl.DataFrame:
    """A whole data snapshot (every shard its manifest lists) in its defined order, global
    sequence_index."""
    manifest = read_manifest(lake.uri, snapshot_number(key))
    return manifest.in_order(sequences_scan(lake.uri, manifest)).collect()


def scan_usable_silver(
    context: AssetExecutionContext, lake: LakeResource, batch_gates: BatchGates
) -> tuple[dict[RecordFormat, pl.LazyFrame], dict[str, int]]:
    """Every silver batch whose blocking checks (on silver and bronze) passed, of each format
    trained with sft's loss whose table exists, at one pinned version each (by table name), not
    read yet. Silver's dedup leaves out the same batches."""
    if lake.version(*SILVER_RECORDS.path) is None:
        raise refusal("silver/records does not exist yet: materialize silver first")
    blocked = sorted(batch_gates.blocked(context.instance))
    scans, versions = {}, {}
    for tables in SFT_OBJECTIVE_TABLES:
        version = lake.version(*tables.silver.path)
        if version is None:
            continue
        versions[tables.silver.to_user_string()] = version
        scans[tables.fmt] = lake.scan(*tables.silver.path, version).filter(
            ~pl.col("batch_id").is_in(blocked)
        )
    return scans, versions


NO_TOKENIZER_SAMPLE = (
    "no silver training records to train a tokenizer on: gold waits for prompt/response records "
    "or conversations (or a tokenizer.json named by PIPELINE_TOKENIZER)"
)


def tokenizer_waits(
    lake: LakeResource, gold_policy: GoldPolicy, base_model: BaseModelResource | None = None
) -> str | None:
    """Why gold/tokenizer cannot be made yet (no silver table of a format trained with sft's loss
    holds a record to train it on), or None."""
    if gold_policy.tokenizer_path or (base_model is not None and base_model.configured):
        return None
    for tables in SFT_OBJECTIVE_TABLES:
        rows = lake.scan(*tables.silver.path)
        if rows is not None and rows.select(pl.len()).collect().item() > 0:
            return None
    return NO_TOKENIZER_SAMPLE


@dataclass(frozen=True)
class _TokenizerSource:
    """What one gold/tokenizer version is made of, and what its metadata says about where from."""

    spec: EncoderSpec
    vocab_size: int
    origin: str
    metadata: dict
    silver_versions: dict[str, int] = field(default_factory=dict)
    base_model_version: str | None = None


@asset(
    key=GOLD_TOKENIZER,
    group_name="gold",
    deps=[*SFT_OBJECTIVE_SILVER, REFERENCE_BASE_MODEL],
    kinds={"delta", "tokenizers"},
    automation_condition=once_when_missing(),
    retry_policy=TRANSIENT,
    description="The base model's tokenizer.json and chat template when PIPELINE_BASE_MODEL is "
    "set; else tokenizer.json (byte-level BPE trained on a sample of silver's training split, "
    "sft records and conversations, capped at PIPELINE_TOKENIZER_SAMPLE_CHARS characters, or the "
    "file PIPELINE_TOKENIZER names) for the built-in chat format. Each Delta version is one "
    "tokenizer.",
)
def gold_tokenizer(
    context: AssetExecutionContext,
    lake: LakeResource,
    gold_policy: GoldPolicy,
    batch_gates: BatchGates,
    base_model: BaseModelResource,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    if base_model.configured:
        source = _base_model_source(base_model)
    elif gold_policy.tokenizer_path:
        source = _provided_source(gold_policy.tokenizer_path)
    else:
        source = _trained_source(context, lake, gold_policy, batch_gates)
    spec = source.spec
    row = pl.DataFrame(
        {
            "tokenizer_json": [spec.tokenizer_json],
            "chat_template": [spec.chat_template],
            "special_tokens": [spec.special_tokens_json],
            "base_model_version": [source.base_model_version],
            "sha256": [spec.sha256],
            "vocab_size": [source.vocab_size],
            "origin": [source.origin],
            "silver_version": [source.silver_versions.get(SILVER_RECORDS.to_user_string())],
            "created_at": [datetime.now(timezone.utc)],
        },
        schema_overrides={
            name: pl.String for name in ("chat_template", "special_tokens", "base_model_version")
        },
    )
    row = validate(conform(row, GoldTokenizer), GoldTokenizer)
    commit = lake.overwrite("gold", "tokenizer", row, add_columns=True)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(GoldTokenizer),
                upstream_versions=source.silver_versions or {"silver/records": None},
                input_bytes=len(spec.tokenizer_json),
                stopwatch=stopwatch,
            ),
            "tokenizer_version": commit.version,
            "vocab_size": source.vocab_size,
            "sha256": spec.sha256,
            "origin": source.origin,
            "chat_layout": "the base model's chat template"
            if spec.chat_template is not None
            else "the built-in chat format",
            **source.metadata,
        }
    )


def _base_model_source(base_model: BaseModelResource) -> _TokenizerSource:
    """The base model's own tokenizer, chat template and the special tokens the template reads;
    nothing is trained. A model or template gold cannot use is refused (not retried)."""
    try:
        folder = base_model.local_folder()
        model = inspect_base_model(folder)
        spec = folder_encoder_spec(folder)
        chat_encoder(spec)  # renders a probe: a template that cannot be cut into turns stops here
    except ValueError as error:  # BaseModelError is one
        raise refusal(f"{BASE_MODEL_SETTING}={base_model.uri}: {error}") from error
    return _TokenizerSource(
        spec=spec,
        vocab_size=model.vocab_size,
        origin=f"base model {base_model.uri}",
        base_model_version=model.version,
        metadata={
            "base_model_uri": MetadataValue.path(base_model.uri),
            "base_model_version": model.version,
            "input_chars": 0,
        },
    )


def _provided_source(path: str) -> _TokenizerSource:
    tokenizer = _provided_tokenizer(path)
    return _TokenizerSource(
        spec=EncoderSpec(tokenizer_to_json(tokenizer)),
        vocab_size=tokenizer.get_vocab_size(),
        origin=path,
        metadata={"input_chars": 0},
    )


def _trained_source(
    context: AssetExecutionContext,
    lake: LakeResource,
    gold_policy: GoldPolicy,
    batch_gates: BatchGates,
) -> _TokenizerSource:
    silver, silver_versions = scan_usable_silver(context, lake, batch_gates)
    sample = _tokenizer_sample(silver, silver_versions, gold_policy)
    context.log.info(
        f"training byte-level BPE ({gold_policy.vocab_size} tokens) on {sample.records.height} "
        f"of {sample.train_records} training records ({sample.chars:,} of "
        f"{sample.train_chars:,} characters, capped at {sample.max_chars:,})"
    )
    tokenizer = train_bpe(
        map(conversation_text, sample.records["messages"].to_list()),
        vocab_size=gold_policy.vocab_size,
    )
    return _TokenizerSource(
        spec=EncoderSpec(tokenizer_to_json(tokenizer)),
        vocab_size=tokenizer.get_vocab_size(),
        origin=f"trained on {', '.join(silver_versions)} (a capped sample of the training split)",
        silver_versions=silver_versions,
        metadata=_sample_metadata(sample),
    )


def _tokenizer_sample(
    silver: dict[RecordFormat, pl.LazyFrame], silver_versions: dict[str, int], policy: GoldPolicy
) -> TokenizerSample:
    sample = sample_for_tokenizer(
        silver, policy.tokenizer_sample_chars, policy.validation_fraction, policy.search_fraction
    )
    if sample.train_records == 0:
        read = ", ".join(f"{table} v{version}" for table, version in silver_versions.items())
        raise Failure(allow_retries=False, description=f"{NO_TOKENIZER_SAMPLE} ({read})")
    if sample.records.is_empty():
        raise Failure(
            allow_retries=False,
            description="no training record fits the tokenizer sample's cap of "
            f"{sample.max_chars:,} characters (PIPELINE_TOKENIZER_SAMPLE_CHARS): the first record "
            "in sample order is longer",
        )
    return sample


def _sample_metadata(sample: TokenizerSample) -> dict:
    """What the tokenizer trained on; input_chars (the sizer's measure of the stage's work) is the
    sample's text."""
    return {
        "sample_records": sample.records.height,
        "sample_chars": sample.chars,
        "training_split_records": sample.train_records,
        "training_split_chars": sample.train_chars,
        "sample_chars_cap": sample.max_chars,
        "input_chars": sample.chars,
    }


def _provided_tokenizer(path: str):
    try:
        tokenizer = tokenizer_from_json(Path(path).read_text())
        check_tokenizer(tokenizer)
    except (
        Exception
    ) as exc:  # a missing file, bad JSON (tokenizers has its own error type), missing tokens
        raise Failure(
            allow_retries=False, description=f"PIPELINE_TOKENIZER={path} cannot be used: {exc}"
        ) from exc
    return tokenizer


@asset(
    key=GOLD_SEQUENCES,
    group_name="gold",
    deps=[*SFT_OBJECTIVE_SILVER, GOLD_TOKENIZER],
    partitions_def=ingest_batches,
    kinds=_KINDS,
    check_specs=SHARD_CHECK_SPECS,
    retry_policy=TRANSIENT,
    automation_condition=after_upstream_passes(),
    description="One ingest batch's silver records and conversations (every format trained with "
    "sft's loss), tokenized, packed (best-fit decreasing) and shuffled, per train/validation/"
    "search split: the batch's shard, built once, as soon as its silver passes. A data snapshot "
    "(gold/snapshots) lists shards; a new tokenizer version rebuilds every shard.",
)
def gold_sequences(
    context: AssetExecutionContext,
    lake: LakeResource,
    gold_policy: GoldPolicy,
    ray_engine: BlockEngine,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    batch = context.partition_key
    records, silver_versions = _sft_objective_rows(lake, batch, gold_policy)
    tokenizer_version, spec = current_tokenizer(lake)
    encoder = chat_encoder(spec)
    tokenized = ray_engine.run([tokenize_stage(spec, gold_policy.conversation_loss)], records)
    encoded = tokenized.kept
    context.log.info(
        f"batch {batch}: tokenized {encoded.height} records, {int(encoded['n_tokens'].sum())} "
        f"tokens (gold/tokenizer v{tokenizer_version}) in "
        f"{engine_used(tokenized.counters['tokenize'])}"
    )
    fitted = _fit_long_records(context, encoded, gold_policy)
    encoded = fitted.records
    sequences, packing = build_sequences(
        encoded,
        seq_len=gold_policy.seq_len,
        pad_id=encoder.pad_id,
        seed=shard_seed(gold_policy.shuffle_seed, batch),
    )
    sequences = validate(
        conform(_shard_rows(sequences, batch, tokenizer_version), GoldSequence), GoldSequence
    )
    commit = lake.replace_partition(
        "gold",
        "sequences",
        sequences,
        column="batch_id",
        value=batch,
        rows_per_group=SEQUENCES_PER_BLOCK,
    )
    checks = judge_shard(sequences, gold_policy)
    context.log.info(
        f"batch {batch}: {sequences.height} sequences, packing efficiency "
        f"{packing['efficiency']:.4f}"
    )
    stats = token_statistics(encoded)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(GoldSequence),
                upstream_versions={**silver_versions, "gold/tokenizer": tokenizer_version},
                input_bytes=int(records.estimated_size()),
                stopwatch=stopwatch,
            ),
            "tokenizer_version": tokenizer_version,
            "sequences": sequences.height,
            "seq_len": gold_policy.seq_len,
            "packing_efficiency": round(packing["efficiency"], 5),
            "sequences_by_split": MetadataValue.json(packing["sequences_by_split"]),
            "long_records": gold_policy.long_records,
            "conversation_loss": gold_policy.conversation_loss,
            "truncated_documents": fitted.truncated_documents,
            "dropped_long_records": fitted.left_out.height,
            "dropped_long_records_by_reason": MetadataValue.json(
                dict(fitted.left_out["reason"].value_counts().iter_rows())
            ),
            "long_records_left_out": table_metadata(
                fitted.left_out.sort("record_id").head(_LEFT_OUT_SHOWN)
            ),
            "tokens": stats["tokens"],
            "tokenized_on": engine_used(tokenized.counters["tokenize"]),
            "real_tokens": int(sequences["real_tokens"].sum()),
            "validation_tokens": int(
                encoded.filter(pl.col("split") == VALIDATION)["n_tokens"].sum()
            ),
            "search_tokens": int(encoded.filter(pl.col("split") == SEARCH)["n_tokens"].sum()),
            "input_chars": text_chars(records),
            "tokens_by_source": table_metadata(stats["by_source"]),
            "tokens_per_record": MetadataValue.json(stats["per_record_quantiles"]),
            "validation_share_by_source": table_metadata(split_shares(records)),
        },
        check_results=checks,
    )


def _sft_objective_rows(
    lake: LakeResource, batch: str, gold_policy: GoldPolicy
) -> tuple[pl.DataFrame, dict[str, int]]:
    """The batch's silver rows of every format trained with sft's loss, as gold tokenizes them
    (``lib.gold.sequences.gold_records``: messages, split by each format's key), in record_id
    order, and the silver versions read."""
    frames, versions = [], {}
    for tables in SFT_OBJECTIVE_TABLES:
        version = lake.version(*tables.silver.path)
        if version is None and tables.fmt is SFT:
            raise refusal("silver/records does not exist yet: materialize silver first")
        if version is None:
            continue
        versions[tables.silver.to_user_string()] = version
        rows = lake.read(*tables.silver.path, version=version, where=pl.col("batch_id") == batch)
        frames.append(
            gold_records(
                rows,
                tables.fmt,
                gold_policy.validation_fraction,
                gold_policy.search_fraction,
            )
        )
    return pl.concat(frames).sort("record_id"), versions


def current_tokenizer(lake: LakeResource) -> tuple[int, EncoderSpec]:
    """The newest gold/tokenizer version and what builds its encoder."""
    version = lake.version("gold", "tokenizer")
    if version is None:
        raise refusal("gold/tokenizer does not exist yet: materialize it first")
    return version, tokenizer_spec(lake, version)


def tokenizer_spec(lake: LakeResource, version: int) -> EncoderSpec:
    """What builds the encoder of one gold/tokenizer version."""
    return EncoderSpec.from_row(lake.read("gold", "tokenizer", version=version).row(0, named=True))


def _shard_rows(sequences: pl.DataFrame, batch: str, tokenizer_version: int) -> pl.DataFrame:
    """The packed rows, labelled with their shard; a batch with no silver record left is an empty
    shard."""
    if sequences.width == 0:
        return pl.DataFrame(schema=polars_schema(GoldSequence))
    return sequences.with_columns(
        batch_id=pl.lit(batch), tokenizer_version=pl.lit(tokenizer_version, pl.Int64)
    )


def _fit_long_records(
    context: AssetExecutionContext, encoded: pl.DataFrame, gold_policy: GoldPolicy
):
    """Every record fits one sequence with its prompt (PIPELINE_LONG_RECORDS); what was cut or left
    out is logged."""
    try:
        fitted = fit_long_records(encoded, gold_policy.seq_len, gold_policy.long_records)
    except ValueError as exc:
        raise Failure(allow_retries=False, description=str(exc)) from exc
    if fitted.truncated_documents or fitted.left_out.height:
        reasons = dict(fitted.left_out["reason"].value_counts().iter_rows())
        context.log.warning(
            f"records longer than seq_len {gold_policy.seq_len} ({gold_policy.long_records}): "
            f"{fitted.truncated_documents} truncated, {fitted.left_out.height} left out {reasons} "
            "(record ids in long_records_left_out)"
        )
    return fitted
