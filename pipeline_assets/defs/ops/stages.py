"""The pipeline's stages as the report, the sizer and the cost model count them, defined once: each
stage's name (``lib.ops.sizing.STAGES`` gives its unit of work and parallelism), the asset whose
materializations measured it, and the metadata fields holding its work and its tokens."""

from dataclasses import dataclass

from dagster import AssetKey

from pipeline_assets.defs.keys import (
    BRONZE_RECORDS,
    EVALUATION_REPORT,
    GOLD_SEQUENCES,
    GOLD_TOKENIZER,
    SILVER_RECORDS,
    TRAINING_CHECKPOINT,
)
from pipeline_assets.lib.ops.sizing import STAGES


@dataclass(frozen=True)
class MeasuredStage:
    name: str
    asset: AssetKey
    work: str  # the sizer's unit of work (lib.ops.sizing.STAGES)
    tokens: str | None = None  # the report's tokens, where the stage counts any


PIPELINE_STAGES = (
    MeasuredStage("bronze", BRONZE_RECORDS, "input_chars"),
    MeasuredStage("silver", SILVER_RECORDS, "input_chars"),
    MeasuredStage("gold/tokenizer", GOLD_TOKENIZER, "input_chars"),
    MeasuredStage("gold/sequences", GOLD_SEQUENCES, "input_chars", tokens="tokens"),
    MeasuredStage("training", TRAINING_CHECKPOINT, "tokens_trained", tokens="tokens_trained"),
    MeasuredStage("evaluation", EVALUATION_REPORT, "tokens_scored"),  # both models' tokens
)
STAGE = {stage.name: stage for stage in PIPELINE_STAGES}
if list(STAGE) != list(STAGES):
    raise RuntimeError(f"the measured stages {list(STAGE)} are not the sizer's {list(STAGES)}")
