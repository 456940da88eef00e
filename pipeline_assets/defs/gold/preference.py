"""gold/preference_sequences: each ingest batch's silver pairs tokenized and packed a pair a unit,
its own shard."""

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from pipeline_assets.contracts import GoldPreferenceSequence, conform, polars_schema, validate
from pipeline_assets.defs.automation import after_upstream_passes
from pipeline_assets.defs.check_helpers import contract_check_result
from pipeline_assets.defs.gold.assets import current_tokenizer
from pipeline_assets.defs.gold.checks import PREFERENCE_SHARD_CHECK_SPECS
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import (
    GOLD_PREFERENCE_SEQUENCES,
    GOLD_TOKENIZER,
    SILVER_PREFERENCE_PAIRS,
)
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.retries import TRANSIENT, refusal
from pipeline_assets.lib.gold.encoder import chat_encoder
from pipeline_assets.lib.gold.preference import (
    PAIR_INPUT,
    build_pair_sequences,
    tokenize_pairs_stage,
    with_context_column,
)
from pipeline_assets.lib.gold.sequences import SEQUENCES_PER_BLOCK, shard_seed
from pipeline_assets.lib.gold.splits import VALIDATION, assign_split
from pipeline_assets.resources.engine import BlockEngine, engine_used
from pipeline_assets.resources.lake import LakeResource

_LEFT_OUT_SHOWN = 1000  # rows of the left-out table in the metadata; the counts are always whole


@asset(
    key=GOLD_PREFERENCE_SEQUENCES,
    group_name="gold",
    deps=[SILVER_PREFERENCE_PAIRS, GOLD_TOKENIZER],
    partitions_def=ingest_batches,
    kinds={"delta", "polars"},
    check_specs=PREFERENCE_SHARD_CHECK_SPECS,
    retry_policy=TRANSIENT,
    automation_condition=after_upstream_passes(),
    description="One ingest batch's silver preference pairs, tokenized with gold/tokenizer and "
    "packed best-fit decreasing a pair a unit (chosen then rejected, both whole, in one row), per "
    "train/validation split by prompt; a pair longer than seq_len is left out and counted.",
)
def gold_preference_sequences(
    context: AssetExecutionContext,
    lake: LakeResource,
    gold_policy: GoldPolicy,
    ray_engine: BlockEngine,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    batch = context.partition_key
    silver_version = lake.version(*SILVER_PREFERENCE_PAIRS.path)
    if silver_version is None:
        raise refusal("silver/preference_pairs does not exist yet: materialize silver first")
    pairs = with_context_column(
        lake.read(
            *SILVER_PREFERENCE_PAIRS.path, version=silver_version, where=pl.col("batch_id") == batch
        )
    )
    tokenizer_version, spec = current_tokenizer(lake)
    pad_id = chat_encoder(spec).pad_id
    # All pairs of one prompt on one side: a held-out prompt's pairs were never trained on.
    split = assign_split(
        pairs.sort("record_id"), gold_policy.preference_validation_fraction, key="prompt_hash"
    )
    tokenized = ray_engine.run([tokenize_pairs_stage(spec)], split.select(PAIR_INPUT))
    rows, left_out, packing = build_pair_sequences(
        tokenized.kept, gold_policy.seq_len, shard_seed(gold_policy.shuffle_seed, batch), pad_id
    )
    labelled = rows.with_columns(
        batch_id=pl.lit(batch), tokenizer_version=pl.lit(tokenizer_version, pl.Int64)
    )
    shard = validate(
        conform(labelled, GoldPreferenceSequence), GoldPreferenceSequence
    )  # a broken shard is never committed
    commit = lake.replace_partition(
        *GOLD_PREFERENCE_SEQUENCES.path,
        shard,
        column="batch_id",
        value=batch,
        rows_per_group=SEQUENCES_PER_BLOCK,
    )
    context.log.info(
        f"batch {batch}: {packing['pairs_packed']} of {pairs.height} pairs in {shard.height} rows, "
        f"{packing['pairs_too_long']} longer than seq_len {gold_policy.seq_len} left out, "
        f"packing efficiency {packing['efficiency']:.4f}"
    )
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(GoldPreferenceSequence),
                upstream_versions={
                    "silver/preference_pairs": silver_version,
                    "gold/tokenizer": tokenizer_version,
                },
                input_bytes=int(pairs.estimated_size()),
                stopwatch=stopwatch,
            ),
            "tokenizer_version": tokenizer_version,
            "seq_len": gold_policy.seq_len,
            "pairs": pairs.height,
            # what a preference snapshot's cut reads of its shards, as of gold/sequences'
            "sequences": shard.height,
            "real_tokens": int(shard["real_tokens"].sum()),
            "pairs_packed": packing["pairs_packed"],
            "pairs_too_long": packing["pairs_too_long"],
            "pairs_left_out": table_metadata(left_out.sort("pair_id").head(_LEFT_OUT_SHOWN)),
            "sequences_by_split": MetadataValue.json(packing["sequences_by_split"]),
            "packing_efficiency": round(packing["efficiency"], 5),
            "tokens": int(tokenized.kept["n_tokens"].sum()) if tokenized.kept.height else 0,
            "validation_pairs": int((split["split"] == VALIDATION).sum()),
            "tokenized_on": engine_used(tokenized.counters["tokenize"]),
        },
        check_results=[contract_check_result(shard, GoldPreferenceSequence, check_name="contract")],
    )
