"""gold/tokenizer and gold/sequences: every silver batch, tokenized and packed into one data snapshot."""

import hashlib
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from pipeline_assets.contracts import GoldSequence, GoldTokenizer, conform, polars_schema, validate
from pipeline_assets.defs.automation import once_when_missing
from pipeline_assets.defs.gold.cadence import SNAPSHOT_REASON_TAG
from pipeline_assets.defs.gold.checks import GOLD_CHECK_SPECS, JudgedSnapshot, blocking_failures, judge_snapshot
from pipeline_assets.defs.keys import GOLD_SEQUENCES, GOLD_TOKENIZER, SILVER_RECORDS
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.partitions import data_snapshots, snapshot_key, snapshot_version
from pipeline_assets.defs.silver.order import blocked_batches
from pipeline_assets.lib.chat_format import PAD, prefix_text, response_text
from pipeline_assets.lib.gold import SEQUENCES_PER_BLOCK, build_sequences, fit_long_records, in_snapshot_order, token_statistics
from pipeline_assets.lib.sizing import text_chars
from pipeline_assets.lib.splits import SEARCH, VALIDATION, assign_split, split_shares
from pipeline_assets.lib.tokenizer import check_tokenizer, encode_records, tokenizer_from_json, tokenizer_to_json, train_bpe
from pipeline_assets.lib.tokenizer_sample import TokenizerSample, sample_for_tokenizer
from pipeline_assets.resources import GoldPolicy, LakeResource

_KINDS = {"delta", "polars"}
_LEFT_OUT_SHOWN = 1000  # rows of the left-out table in the metadata; the counts are always whole


def read_snapshot(lake: LakeResource, version: int | None = None) -> pl.DataFrame:
    """A data snapshot in its defined order (split, sequence_index): Delta keeps rows, not their order."""
    scan = lake.scan("gold", "sequences", version)
    if scan is None:
        raise ValueError("gold/sequences does not exist yet: materialize it first")
    return in_snapshot_order(scan)


def usable_silver(context: AssetExecutionContext, lake: LakeResource) -> tuple[pl.DataFrame, int, list[str]]:
    """Every silver batch whose blocking checks (on silver and bronze) passed, at one pinned version; and the
    batches left out. Silver's dedup leaves out the same batches."""
    scan, version, blocked = scan_usable_silver(context, lake)
    return scan.collect(), version, blocked


def scan_usable_silver(context: AssetExecutionContext, lake: LakeResource) -> tuple[pl.LazyFrame, int, list[str]]:
    """``usable_silver``, not read yet."""
    version = lake.version("silver", "records")
    if version is None:
        raise ValueError("silver/records does not exist yet: materialize silver first")
    blocked = sorted(blocked_batches(context.instance))
    return lake.scan("silver", "records", version).filter(~pl.col("batch_id").is_in(blocked)), version, blocked


@asset(
    key=GOLD_TOKENIZER,
    group_name="gold",
    deps=[SILVER_RECORDS],
    kinds={"delta", "tokenizers"},
    automation_condition=once_when_missing(),
    retry_policy=TRANSIENT,
    description="tokenizer.json (byte-level BPE trained on a sample of silver's training split capped at "
    "PIPELINE_TOKENIZER_SAMPLE_CHARS characters, or the file PIPELINE_TOKENIZER names); each Delta version is one tokenizer.",
)
def gold_tokenizer(context: AssetExecutionContext, lake: LakeResource, gold_policy: GoldPolicy) -> MaterializeResult:
    stopwatch = Stopwatch()
    if gold_policy.tokenizer_path:
        tokenizer = _provided_tokenizer(gold_policy.tokenizer_path)
        origin, silver_version, sample_metadata = gold_policy.tokenizer_path, None, {"input_chars": 0}
    else:
        silver, silver_version, _ = scan_usable_silver(context, lake)
        sample = _tokenizer_sample(silver, silver_version, gold_policy)
        context.log.info(f"training byte-level BPE ({gold_policy.vocab_size} tokens) on {sample.records.height} of "
                         f"{sample.train_records} training records ({sample.chars:,} of {sample.train_chars:,} characters, "
                         f"capped at {sample.max_chars:,})")
        tokenizer = train_bpe(_chat_texts(sample.records), vocab_size=gold_policy.vocab_size)
        origin = "trained on silver/records (a capped sample of the training split)"
        sample_metadata = _sample_metadata(sample)
    text = tokenizer_to_json(tokenizer)
    row = pl.DataFrame({
        "tokenizer_json": [text],
        "sha256": [hashlib.sha256(text.encode()).hexdigest()],
        "vocab_size": [tokenizer.get_vocab_size()],
        "origin": [origin],
        "silver_version": [silver_version],
        "created_at": [datetime.now(timezone.utc)],
    })
    row = validate(conform(row, GoldTokenizer), GoldTokenizer)
    commit = lake.overwrite("gold", "tokenizer", row)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(commit, polars_schema(GoldTokenizer), upstream_versions={"silver/records": silver_version},
                                   input_bytes=len(text), stopwatch=stopwatch),
            "tokenizer_version": commit.version,
            "vocab_size": tokenizer.get_vocab_size(),
            "sha256": row["sha256"][0],
            "origin": origin,
            **sample_metadata,
        }
    )


def _tokenizer_sample(silver: pl.LazyFrame, silver_version: int, gold_policy: GoldPolicy) -> TokenizerSample:
    sample = sample_for_tokenizer(silver, gold_policy.tokenizer_sample_chars, gold_policy.validation_fraction,
                                  gold_policy.search_fraction)
    if sample.train_records == 0:
        raise Failure(allow_retries=False, description=f"no silver training records to train a tokenizer on (silver/records v{silver_version})")
    if sample.records.is_empty():
        raise Failure(allow_retries=False, description=f"no training record fits the tokenizer sample's cap of {sample.max_chars:,} "
                      "characters (PIPELINE_TOKENIZER_SAMPLE_CHARS): the first record in sample order is longer")
    return sample


def _sample_metadata(sample: TokenizerSample) -> dict:
    """What the tokenizer trained on; input_chars (the sizer's measure of the stage's work) is the sample's text."""
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
    except Exception as exc:  # a missing file, bad JSON (tokenizers has its own error type), missing tokens
        raise Failure(allow_retries=False, description=f"PIPELINE_TOKENIZER={path} cannot be used: {exc}") from exc
    return tokenizer


def _chat_texts(frame: pl.DataFrame) -> list[str]:
    return [
        prefix_text(system, prompt) + response_text(response)
        for system, prompt, response in frame.select("system", "prompt", "response").iter_rows()
    ]


@asset(
    key=GOLD_SEQUENCES,
    group_name="gold",
    deps=[SILVER_RECORDS, GOLD_TOKENIZER],
    kinds=_KINDS,
    check_specs=GOLD_CHECK_SPECS,
    retry_policy=TRANSIENT,
    description="Tokenized, packed (best-fit decreasing) and shuffled sequences with a train/validation/search split. "
    "Each Delta version is one data snapshot, gold-v<N>, which the training assets pin; it becomes a "
    "data_snapshots partition only once its blocking checks pass. Cut on a cadence (the snapshot_cadence "
    "sensor), on the snapshot schedule, or by hand.",
)
def gold_sequences(context: AssetExecutionContext, lake: LakeResource, gold_policy: GoldPolicy) -> MaterializeResult:
    stopwatch = Stopwatch()
    silver, silver_version, blocked = usable_silver(context, lake)
    tokenizer_version = lake.version("gold", "tokenizer")
    if tokenizer_version is None:
        raise ValueError("gold/tokenizer does not exist yet: materialize it first")
    tokenizer = tokenizer_from_json(lake.read("gold", "tokenizer", version=tokenizer_version)["tokenizer_json"][0])
    if blocked:
        context.log.warning(f"left out {len(blocked)} batch(es) whose bronze or silver blocking checks failed: {', '.join(blocked)}")

    if silver.is_empty():
        raise Failure(allow_retries=False, description=f"no silver records to build a snapshot from (silver/records v{silver_version}, "
                      f"{len(blocked)} batch(es) left out as blocked)")
    records = assign_split(silver.sort("record_id"), gold_policy.validation_fraction,
                           search_fraction=gold_policy.search_fraction)
    encoded = encode_records(tokenizer, records).join(records.select("record_id", "source", "split"), on="record_id")
    context.log.info(f"tokenized {encoded.height} records: {int(encoded['n_tokens'].sum())} tokens")
    fitted = _fit_long_records(context, encoded, gold_policy)
    encoded = fitted.records
    sequences, packing = build_sequences(
        encoded, seq_len=gold_policy.seq_len, seed=gold_policy.shuffle_seed, pad_id=tokenizer.token_to_id(PAD)
    )
    sequences = validate(conform(sequences, GoldSequence), GoldSequence)
    previous = _previous_accepted_snapshot(context.instance, lake)
    commit = lake.overwrite("gold", "sequences", sequences, rows_per_group=SEQUENCES_PER_BLOCK)
    snapshot = snapshot_key(commit.version)
    checks = judge_snapshot(sequences, snapshot, previous, gold_policy)
    failed = blocking_failures(checks)
    if failed:
        context.log.error(f"{snapshot} is not a data snapshot: {'; '.join(r.description for r in failed)}; nothing trains on it")
    else:
        context.instance.add_dynamic_partitions(data_snapshots.name, [snapshot])
    reason = context.run.tags.get(SNAPSHOT_REASON_TAG, "requested by hand")
    context.log.info(f"data snapshot {snapshot} ({reason}): {sequences.height} sequences, packing efficiency {packing['efficiency']:.4f}")

    stats = token_statistics(encoded)
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit, polars_schema(GoldSequence),
                upstream_versions={"silver/records": silver_version, "gold/tokenizer": tokenizer_version},
                input_bytes=int(silver.estimated_size()), stopwatch=stopwatch,
            ),
            "data_snapshot": snapshot,
            "snapshot_accepted": not failed,
            "snapshot_reason": reason,
            "tokenizer_version": tokenizer_version,
            "batches_left_out": MetadataValue.json(blocked),
            "packing_efficiency": round(packing["efficiency"], 5),
            "sequences_by_split": MetadataValue.json(packing["sequences_by_split"]),
            "long_records": gold_policy.long_records,
            "truncated_documents": fitted.truncated_documents,
            "dropped_long_records": fitted.left_out.height,
            "dropped_long_records_by_reason": MetadataValue.json(dict(fitted.left_out["reason"].value_counts().iter_rows())),
            "long_records_left_out": table_metadata(fitted.left_out.sort("record_id").head(_LEFT_OUT_SHOWN)),
            "tokens": stats["tokens"],
            "validation_tokens": int(encoded.filter(pl.col("split") == VALIDATION)["n_tokens"].sum()),
            "search_tokens": int(encoded.filter(pl.col("split") == SEARCH)["n_tokens"].sum()),
            "input_chars": text_chars(silver),
            "tokens_by_source": table_metadata(stats["by_source"]),
            "tokens_per_record": MetadataValue.json(stats["per_record_quantiles"]),
            "validation_share_by_source": table_metadata(split_shares(records)),
        },
        check_results=checks,
    )


def _previous_accepted_snapshot(instance, lake: LakeResource) -> JudgedSnapshot | None:
    """The newest snapshot that passed its blocking checks: what drift and volume compare with."""
    accepted = instance.get_dynamic_partitions(data_snapshots.name)
    if not accepted:
        return None
    key = max(accepted, key=snapshot_version)
    return JudgedSnapshot.of(key, lake.scan("gold", "sequences", snapshot_version(key)))


def _fit_long_records(context: AssetExecutionContext, encoded: pl.DataFrame, gold_policy: GoldPolicy):
    """Every record fits one sequence with its prompt (PIPELINE_LONG_RECORDS); what was cut or left out is logged."""
    try:
        fitted = fit_long_records(encoded, gold_policy.seq_len, gold_policy.long_records)
    except ValueError as exc:
        raise Failure(allow_retries=False, description=str(exc)) from exc
    if fitted.truncated_documents or fitted.left_out.height:
        reasons = dict(fitted.left_out["reason"].value_counts().iter_rows())
        context.log.warning(
            f"records longer than seq_len {gold_policy.seq_len} ({gold_policy.long_records}): {fitted.truncated_documents} "
            f"truncated, {fitted.left_out.height} left out {reasons} (record ids in long_records_left_out)"
        )
    return fitted
