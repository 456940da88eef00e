"""reference/eval_sets: benchmark items the data must not contain (maintained outside the pipeline)."""

from dagster import AssetSpec

from pipeline_assets.defs.keys import REFERENCE_EVAL_SETS

eval_sets = AssetSpec(
    REFERENCE_EVAL_SETS,
    description="Benchmark items (JSONL: eval_set, item_id, prompt, response) under PIPELINE_EVAL_SETS_URI. "
    "Silver decontaminates against them; evaluation scores on them.",
    group_name="reference",
    kinds={"jsonl"},
)
