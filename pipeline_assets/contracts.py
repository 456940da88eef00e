"""Every record contract of the pipeline (pandera, polars backend), as each layer's document
(docs/bronze.md, docs/silver.md, docs/gold.md, ...) describes them.

Each layer validates its output against its contract before the Delta commit, so a frame that
breaks a contract never becomes a table version. ``polars_schema`` gives the exact column types a
layer must produce, so an all-null column still lands with its declared type.
"""

from __future__ import annotations

import re
from typing import Annotated

import pandera.polars as pa
import polars as pl
from pandera.engines.polars_engine import DateTime

from pipeline_assets.lib.formats import ROLES, TURN

UTC_TIMESTAMP = DateTime(time_zone_agnostic=False, time_zone="UTC", time_unit="us")


class LandingRecord(pa.DataFrameModel):
    """One accepted landing line, after the source's field mapping."""

    prompt: str
    response: str
    system: str = pa.Field(nullable=True)
    id: str = pa.Field(nullable=True)
    created_at: UTC_TIMESTAMP = pa.Field(nullable=True)
    meta: str = pa.Field(nullable=True, description="the source's meta object, as JSON")
    extra: str = pa.Field(nullable=True, description="every unknown field, verbatim, as JSON")

    class Config:
        strict = True
        coerce = False

    @pa.check("prompt", "response", name="not_blank")
    def _not_blank(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            pl.col(data.key).str.contains(r"\S")
        )  # a character strip_chars keeps


class PreferenceLandingRecord(pa.DataFrameModel):
    """One accepted landing line of a ``preference`` source: a prompt, the answer preferred and the
    one rejected, after the source's field mapping. A pair in TRL's conversational shape keeps its
    final user turn in ``prompt``, a leading system turn in ``system`` and the turns between in
    ``prompt_messages``."""

    prompt_messages: Annotated[pl.List, TURN] = pa.Field(
        nullable=True,
        description="the turns before the prompt, after any leading system turn; null for none",
    )
    prompt: str
    chosen: str
    rejected: str
    system: str = pa.Field(nullable=True)
    score_chosen: float = pa.Field(nullable=True)
    score_rejected: float = pa.Field(nullable=True)
    id: str = pa.Field(nullable=True)
    created_at: UTC_TIMESTAMP = pa.Field(nullable=True)
    meta: str = pa.Field(nullable=True, description="the source's meta object, as JSON")
    extra: str = pa.Field(nullable=True, description="every unknown field, verbatim, as JSON")

    class Config:
        strict = True
        coerce = False

    @pa.check("prompt", "chosen", "rejected", name="not_blank")
    def _not_blank(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col(data.key).str.contains(r"\S"))

    @pa.check("prompt_messages", name="chat_shape")
    def _chat_shape(cls, data: pa.PolarsData) -> pl.LazyFrame:
        """Known roles and no blank turn (null: a prompt with no earlier turns)."""
        return data.lazyframe.select(_known_roles_no_blank_turn(pl.col(data.key)).fill_null(True))


class ConversationLandingRecord(pa.DataFrameModel):
    """One accepted landing line of a ``conversation`` source: its turns in order (the ShareGPT
    shape's already mapped to roles and contents), after the source's field mapping."""

    messages: Annotated[pl.List, TURN] = pa.Field(
        description="the turns in order: role (system, user or assistant) and content"
    )
    id: str = pa.Field(nullable=True)
    created_at: UTC_TIMESTAMP = pa.Field(nullable=True)
    meta: str = pa.Field(nullable=True, description="the source's meta object, as JSON")
    extra: str = pa.Field(nullable=True, description="every unknown field, verbatim, as JSON")

    class Config:
        strict = True
        coerce = False

    @pa.check("messages", name="chat_shape")
    def _chat_shape(cls, data: pa.PolarsData) -> pl.LazyFrame:
        """Known roles, no blank turn, an assistant turn last."""
        turns = pl.col(data.key)
        return data.lazyframe.select(
            _known_roles_no_blank_turn(turns)
            & (turns.list.eval(pl.element().struct.field("role")).list.last() == "assistant")
        )


def _known_roles_no_blank_turn(turns: pl.Expr) -> pl.Expr:
    turn = pl.element()
    return turns.list.eval(
        turn.struct.field("role").is_in(ROLES) & turn.struct.field("content").str.contains(r"\S")
    ).list.all()


class Provenance(pa.DataFrameModel):
    """Where a landing record came from and when it arrived: what bronze adds to every format."""

    record_id: str = pa.Field(unique=True, str_length={"min_value": 32, "max_value": 32})
    source: str = pa.Field(str_length={"min_value": 1})
    source_file: str = pa.Field(str_length={"min_value": 1})
    source_line: pl.Int64 = pa.Field(ge=1)
    batch_id: str = pa.Field(str_length={"min_value": 1})
    ingested_at: UTC_TIMESTAMP
    content_hash: str = pa.Field(str_length={"min_value": 32, "max_value": 32})


class BronzeRecord(Provenance, LandingRecord):  # the landing fields first, then provenance
    """A landing record plus provenance."""


class BronzePreferenceRecord(Provenance, PreferenceLandingRecord):
    """A preference landing record plus provenance."""


class BronzeConversation(Provenance, ConversationLandingRecord):
    """A conversation landing record plus provenance."""


QUARANTINE_REASON = (
    r"^(invalid_json|not_an_object|invalid_utf8|blank_line|truncated_file|unreadable_file"
    r"|unsupported_format|already_ingested|too_deep:(meta|extra)"
    r"|unknown_role|empty_turn|no_assistant_turn|ends_on_(user|system)_turn"
    r"|prompt_ends_on_(assistant|system)_turn|system_twice|(not_one_turn|not_assistant):[a-z_]+"
    r"|(missing_field|wrong_type|empty_field|invalid_timestamp):[a-z_]+)$"
)


class QuarantineRecord(pa.DataFrameModel):
    """A landing line (or Parquet row, or whole file) that failed the landing contract, verbatim."""

    raw: str = pa.Field(
        description="the line as read (invalid UTF-8 bytes replaced), or the row as JSON"
    )
    source: str = pa.Field(str_length={"min_value": 1})
    source_file: str = pa.Field(str_length={"min_value": 1})
    source_line: pl.Int64 = pa.Field(ge=0, description="0 when the whole file is unreadable")
    batch_id: str = pa.Field(str_length={"min_value": 1})
    reason: str = pa.Field(str_matches=QUARANTINE_REASON)
    detail: str

    class Config:
        strict = True
        coerce = False


HASH_128 = {"str_length": {"min_value": 32, "max_value": 32}}
# the user's scorers' columns (polars' regex has no lookahead: a preference record's own
# score_chosen and score_rejected, nullable, match it too)
SCORE_COLUMNS = r"^score_[a-z0-9_]+$"
FRACTION = {"ge": 0.0, "le": 1.0}


class Curated(pa.DataFrameModel):
    """What silver adds to every format's bronze record.

    Text columns are normalized. ``cluster_id`` is the survivor of its near-duplicate cluster (the
    record itself when it has no duplicates); the ``q_*`` columns are the quality-rule values its
    judged answer was judged on (lib.silver.quality.QUANTITIES).
    """

    exact_hash: str = pa.Field(**HASH_128)
    cluster_id: str = pa.Field(**HASH_128)
    q_words: float = pa.Field(ge=0)
    q_mean_word_length: float = pa.Field(ge=0)
    q_symbol_word_ratio: float = pa.Field(ge=0)
    q_alpha_word_fraction: float = pa.Field(**FRACTION)
    q_duplicate_line_fraction: float = pa.Field(**FRACTION)
    q_duplicate_line_char_fraction: float = pa.Field(**FRACTION)
    q_top_2gram_char_fraction: float = pa.Field(**FRACTION)
    q_duplicate_5gram_char_fraction: float = pa.Field(**FRACTION)
    language: str = pa.Field(description="ISO 639-1, of the judged answer (lid.176)")
    language_score: float = pa.Field(gt=0.0, le=1.0, description="the model's probability of it")
    score: float = pa.Field(
        alias=SCORE_COLUMNS,
        regex=True,
        required=False,
        nullable=True,
        description="score_<name>: each of the user's scorers (PIPELINE_QUALITY_MODELS); "
        "preference pairs also score_<name>_rejected",
    )


class SilverRecord(Curated, BronzeRecord):  # the bronze fields first
    """A bronze record that survived normalization, dedup, decontamination and the quality gate."""


class PairMeasures(pa.DataFrameModel):
    prompt_hash: str = pa.Field(
        **HASH_128,
        description="the normalized prompt's, after its earlier turns when it has any: the split "
        "and the per-prompt cap go by it",
    )
    length_log_ratio: float = pa.Field(
        ge=0, description="|log(chars of chosen / chars of rejected)|: DPO's length bias"
    )


class SilverPreferencePair(PairMeasures, Curated, BronzePreferenceRecord):
    """A preference pair that survived silver's stages and the pair rules
    (lib.silver.preference_rules)."""


class ConversationMeasures(pa.DataFrameModel):
    prompt_hash: str = pa.Field(
        **HASH_128,
        description="the normalized first user turn's (of an empty text, with none): the split "
        "goes by it, so variants of one conversation share a side",
    )


class SilverConversation(ConversationMeasures, Curated, BronzeConversation):
    """A conversation that survived silver's stages: its turns normalized, its assistant turns
    judged by the quality rules."""


SILVER_STAGE = (
    r"^(exact_dup|near_dup|decontaminated|quality:[a-z0-9_]+|language|quality_model"
    r"|reward_disagrees|contradiction|pair_cap|pair:[a-z_]+)$"
)


class SilverReject(pa.DataFrameModel):
    """A bronze record silver removed: which stage removed it, and the evidence."""

    record_id: str = pa.Field(unique=True, **HASH_128)
    batch_id: str
    source: str
    source_file: str
    source_line: pl.Int64
    system: str = pa.Field(nullable=True)
    prompt: str = pa.Field(nullable=True, description="null for conversations, which have messages")
    response: str = pa.Field(
        nullable=True, description="sft records; preference pairs have chosen and rejected"
    )
    chosen: str = pa.Field(nullable=True)
    rejected: str = pa.Field(nullable=True)
    messages: Annotated[pl.List, TURN] = pa.Field(
        nullable=True, description="conversations: the turns as silver normalized them"
    )
    prompt_messages: Annotated[pl.List, TURN] = pa.Field(
        nullable=True, description="conversational preference pairs: the turns before the prompt"
    )
    stage: str = pa.Field(str_matches=SILVER_STAGE)
    evidence: str = pa.Field(description="JSON: what the stage matched or measured")
    duplicate_of: str = pa.Field(
        nullable=True, description="dedup: the cluster survivor's record_id"
    )
    jaccard: float = pa.Field(
        nullable=True, description="dedup: estimated Jaccard with the survivor"
    )
    eval_set: str = pa.Field(nullable=True)
    eval_item_id: str = pa.Field(nullable=True)
    matched_ngram: str = pa.Field(nullable=True)
    rule_value: float = pa.Field(nullable=True, description="quality: the measured value")
    rule_threshold: float = pa.Field(nullable=True, description="quality: the threshold it broke")

    class Config:
        strict = True
        coerce = False

    @pa.dataframe_check
    def _holds_its_text(cls, data: pa.PolarsData) -> pl.LazyFrame:
        """A prompt, or a conversation's turns."""
        return data.lazyframe.select(
            pl.col("prompt").is_not_null() | pl.col("messages").is_not_null()
        )


class MinhashIndexEntry(pa.DataFrameModel):
    """Hashes of one kept silver record: all later batches need of it for dedup."""

    record_id: str = pa.Field(unique=True, **HASH_128)
    batch_id: str
    exact_hash: str = pa.Field(**HASH_128)
    signature: pl.Binary = pa.Field(description="MinHash signature: num_perm little-endian uint32")
    response_signature: pl.Binary = pa.Field(
        nullable=True,
        description="MinHash signature of the answers alone (sft: the response; preference: chosen "
        "and rejected); null in entries written before it was stored",
    )
    band_keys: Annotated[pl.List, pl.Int64()] = pa.Field(description="one LSH key per band")
    lsh_params: str
    prompt_hash: str = pa.Field(
        nullable=True, description="preference pairs: the normalized prompt's hash"
    )

    class Config:
        strict = True
        coerce = False


class MinhashBandEntry(pa.DataFrameModel):
    """One key of one kept silver record in ``silver/minhash_bands``: an LSH band's, (band -1) the
    first 60 bits of its exact hash, or (band -2, preference pairs) of its prompt hash."""

    band: pl.Int16 = pa.Field(ge=-2)
    band_key: pl.Int64
    record_id: str = pa.Field(**HASH_128)
    batch_id: str

    class Config:
        strict = True
        coerce = False
        unique = ["band", "record_id"]


class GoldTokenizer(pa.DataFrameModel):
    """One row: the tokenizer of this Delta version of gold/tokenizer."""

    tokenizer_json: str
    chat_template: str = pa.Field(
        nullable=True, description="the base model's Jinja chat template; null: the built-in format"
    )
    special_tokens: str = pa.Field(
        nullable=True,
        description="JSON object of the special tokens the chat template reads (bos_token, "
        "eos_token...); null with the built-in format",
    )
    base_model_version: str = pa.Field(
        nullable=True,
        str_length={"min_value": 64, "max_value": 64},
        description="sha256 of the base model's files; null without a base model",
    )
    sha256: str = pa.Field(
        str_length={"min_value": 64, "max_value": 64},
        description="of tokenizer.json; with a chat template, of the tokenizer and the template",
    )
    vocab_size: pl.Int64 = pa.Field(
        gt=0, description="the tokenizer's; with a base model, its embedding rows (config.json)"
    )
    origin: str = pa.Field(
        description="trained on silver, the provided file's path, or base model <uri>"
    )
    silver_version: pl.Int64 = pa.Field(
        nullable=True, ge=0, description="the silver/records version it was trained on"
    )
    created_at: UTC_TIMESTAMP

    class Config:
        strict = True


class PackedShard(pa.DataFrameModel):
    """What every packed row of a gold shard has, whatever the record format."""

    batch_id: str = pa.Field(
        str_length={"min_value": 1}, description="the shard: one ingest batch, packed on its own"
    )
    tokenizer_version: pl.Int64 = pa.Field(
        ge=0, description="the gold/tokenizer Delta version that encoded it"
    )
    split: str = pa.Field(isin=["train", "validation", "search"])
    sequence_index: pl.Int64 = pa.Field(
        ge=0, description="position after the seeded shuffle, per shard and split"
    )
    input_ids: Annotated[pl.List, pl.Int32()]
    loss_mask: Annotated[pl.List, pl.Boolean()] = pa.Field(
        description="true on response tokens (Delta has no unsigned ints)"
    )
    position_ids: Annotated[pl.List, pl.Int32()] = pa.Field(
        description="restart at 0 at every document"
    )
    document_lengths: Annotated[pl.List, pl.Int32()] = pa.Field(
        description="lengths of the packed pieces, in order"
    )

    class Config:
        strict = True
        coerce = False


class SequenceRecords(pa.DataFrameModel):
    record_ids: Annotated[pl.List, pl.String()] = pa.Field(
        description="the silver record of each piece"
    )
    real_tokens: pl.Int32 = pa.Field(ge=1)


class GoldSequence(SequenceRecords, PackedShard):
    """One packed training sequence of ``seq_len`` tokens, in its ingest batch's shard."""


class SequencePairs(pa.DataFrameModel):
    pair_ids: Annotated[pl.List, pl.String()] = pa.Field(
        description="the silver pair of documents 2k (chosen) and 2k + 1"
    )
    real_tokens: pl.Int32 = pa.Field(ge=1)


class GoldPreferenceSequence(SequencePairs, PackedShard):
    """One packed row of preference pairs: each pair's chosen then rejected document, whole, in one
    row."""

    @pa.dataframe_check
    def _two_documents_a_pair(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            pl.col("document_lengths").list.len() == 2 * pl.col("pair_ids").list.len()
        )


class GoldReferenceLogps(pa.DataFrameModel):
    """The reference model's log-probabilities of one packed row of a preference snapshot, per
    document."""

    snapshot: str = pa.Field(str_startswith="dpo-v")
    reference_model: str = pa.Field(
        description="<registered model>/<version>: the sft champion when the pass ran; "
        "base_model/<sha256 prefix>: the base model, with no champion yet"
    )
    batch_id: str = pa.Field(str_length={"min_value": 1})
    split: str = pa.Field(isin=["train", "validation", "search"])
    sequence_index: pl.Int64 = pa.Field(
        ge=0, description="the row's index in its shard and split, as gold stores it"
    )
    reference_logps: Annotated[pl.List, pl.Float64()] = pa.Field(
        description="per document of the row (chosen, rejected, ...): the summed log-probability "
        "of its response tokens"
    )

    class Config:
        strict = True
        coerce = False

    @pa.dataframe_check
    def _log_probabilities(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("reference_logps").list.max().fill_null(0.0) <= 0.0)


class GoldSnapshotManifest(pa.DataFrameModel):
    """One data snapshot: which gold shards, at which versions (lib.gold.manifest)."""

    snapshot: str = pa.Field(
        str_matches=r"^(gold|dpo)-v\d+$",
        unique=True,
        description="gold-v<N>, or dpo-v<N> for pairs",
    )
    number: pl.Int64 = pa.Field(
        ge=0,
        description="N of gold-v<N>: the Delta version of gold/snapshots this row was added in",
    )
    sequences_version: pl.Int64 = pa.Field(
        ge=0, description="the gold/sequences Delta version the shards are read at"
    )
    tokenizer_version: pl.Int64 = pa.Field(ge=0)
    seq_len: pl.Int64 = pa.Field(ge=1)
    batches: Annotated[pl.List, pl.String()] = pa.Field(
        description="the shards, in arrival order: the global order per split"
    )
    train_sequences: Annotated[pl.List, pl.Int64()] = pa.Field(
        description="per batch, in the order of batches"
    )
    validation_sequences: Annotated[pl.List, pl.Int64()]
    search_sequences: Annotated[pl.List, pl.Int64()]
    reason: str = pa.Field(description="why it was cut: the cadence, the schedule, or by hand")
    created_at: UTC_TIMESTAMP

    class Config:
        strict = True
        coerce = False


class EvaluationSlice(pa.DataFrameModel):
    """One model's held-out loss on one slice of one data snapshot."""

    partition: str = pa.Field(str_startswith="gold-v")
    model: str = pa.Field(isin=["candidate", "champion", "base_model"])
    model_version: str = pa.Field(
        nullable=True, description="registry version; null for an unregistered candidate"
    )
    slice: str = pa.Field(description="overall, source:<name> or eval:<set>")
    loss: float = pa.Field(ge=0)
    perplexity: float = pa.Field(ge=1)
    tokens: pl.Int64 = pa.Field(ge=1)
    documents: pl.Int64 = pa.Field(ge=1)
    evaluated_at: UTC_TIMESTAMP

    class Config:
        strict = True
        coerce = False


class DpoEvaluationSlice(pa.DataFrameModel):
    """One model's judgement of one slice of a preference snapshot's held-out pairs, or its sft
    validation loss."""

    partition: str = pa.Field(str_startswith="dpo-v")
    model: str = pa.Field(isin=["candidate", "champion"])
    model_version: str = pa.Field(
        nullable=True, description="<registered model>/<version>; null for the candidate"
    )
    slice: str = pa.Field(str_matches=r"^(overall|source:.+|sft_validation_loss)$")
    pairs: pl.Int64 = pa.Field(
        nullable=True, ge=1, description="held-out pairs judged; null on the sft slice"
    )
    preference_accuracy: float = pa.Field(
        nullable=True, ge=0, le=1, description="share of positive margins"
    )
    mean_margin: float = pa.Field(
        nullable=True, description="mean implicit reward margin (nats, times beta)"
    )
    loss: float = pa.Field(
        nullable=True, ge=0, description="sft_validation_loss only: nats per token"
    )
    evaluated_at: UTC_TIMESTAMP

    class Config:
        strict = True
        coerce = False

    @pa.dataframe_check
    def _pairs_or_loss(cls, data: pa.PolarsData) -> pl.LazyFrame:
        sft = pl.col("slice") == "sft_validation_loss"
        return data.lazyframe.select(
            pl.when(sft)
            .then(pl.col("loss").is_not_null() & pl.col("pairs").is_null())
            .otherwise(pl.col("pairs").is_not_null() & pl.col("loss").is_null())
        )


class HparamTrial(pa.DataFrameModel):
    """One trial of a hyperparameter search at one rung."""

    partition: str = pa.Field(str_startswith="gold-v")
    trial: pl.Int64 = pa.Field(ge=0)
    rung: pl.Int64 = pa.Field(ge=0)
    steps: pl.Int64 = pa.Field(ge=1)
    search_loss: float = pa.Field(
        nullable=True, description="loss on gold's search split; null when the trial failed"
    )
    hyperparameters: str = pa.Field(description="JSON object")
    continued: bool = pa.Field(description="survived this rung")
    mlflow_run_id: str

    class Config:
        strict = True
        coerce = False


class RunFailure(pa.DataFrameModel):
    """A failed Dagster run, as the run-failure sensor recorded it."""

    run_id: str
    job_name: str
    partition: str = pa.Field(nullable=True)
    failed_steps: str = pa.Field(
        description="comma-separated step keys; empty when the run failed outside a step"
    )
    error: str
    failed_at: UTC_TIMESTAMP

    class Config:
        strict = True
        coerce = False


class PipelineStage(pa.DataFrameModel):
    """One stage of one pipeline report: what it processed, how fast, at what cost."""

    report_id: str
    snapshot: str = pa.Field(str_startswith="gold-v")
    stage: str
    rows: pl.Int64 = pa.Field(ge=0)
    input_mb: float = pa.Field(ge=0)
    tokens: pl.Int64 = pa.Field(ge=0)
    wall_seconds: float = pa.Field(ge=0)
    cpu_seconds: float = pa.Field(ge=0)
    gpu_seconds: float = pa.Field(ge=0)
    rows_per_second: float = pa.Field(ge=0)
    mb_per_second: float = pa.Field(ge=0)
    tokens_per_second: float = pa.Field(ge=0)
    share_of_wall: float = pa.Field(ge=0, le=1)
    cost_usd: float = pa.Field(ge=0)
    usd_per_million_tokens: float = pa.Field(ge=0)
    throughput: float = pa.Field(
        ge=0, description="tokens/s where the stage counts tokens, else rows/s"
    )
    unit: str = pa.Field(isin=["tokens/s", "rows/s"])

    class Config:
        strict = True
        coerce = False


class LandingManifestEntry(pa.DataFrameModel):
    """One landing file registered into an ingest batch."""

    uri: str
    source: str
    size: pl.Int64 = pa.Field(ge=0)
    modified: str
    checksum: str = pa.Field(str_length={"min_value": 64, "max_value": 64})
    batch_id: str
    registered_at: UTC_TIMESTAMP
    previous_checksum: str = pa.Field(
        nullable=True, description="set when the file changed after an earlier ingest"
    )

    class Config:
        strict = True


class PromptBankRow(pa.DataFrameModel):
    """One candidate of the RL prompt bank (lib.rl.prompt_bank): in the bank, or the stage that
    removed it, and why."""

    prompt_id: str = pa.Field(**HASH_128, description="of the prompt's text")
    source: str = pa.Field(
        str_length={"min_value": 1}, description="rl_tasks (generated) or a silver source"
    )
    task: str
    prompt: str = pa.Field(str_length={"min_value": 1})
    ground_truth: str
    verifier: str = pa.Field(
        description="exact_match, int_equal or regex:<pattern> (lib.rl.verifiers)"
    )
    split: str = pa.Field(isin=["train", "held_out"], description="by a hash of the prompt")
    status: str = pa.Field(
        description="in_bank, duplicate_prompt, decontaminated or quality:<rule>"
    )
    evidence: str = pa.Field(
        nullable=True, description="why a removed candidate was removed (JSON or text)"
    )

    class Config:
        strict = True
        coerce = False


class ReplayBufferRow(pa.DataFrameModel):
    """One completion in the GRPO replay buffer (``rl/replay_buffer``, lib.rl.replay): what
    generated it, its tokens with the behaviour policy's log-probabilities, its reward, and whether
    an update consumed it."""

    rollout_id: str = pa.Field(unique=True, str_length={"min_value": 1})
    run: str = pa.Field(
        description="the RL run (its folder of policy versions): versions count from 0 in each run"
    )
    group_id: str = pa.Field(
        description="the completions sampled together for one prompt: GRPO's baseline group"
    )
    prompt_id: str
    policy_version: pl.Int64 = pa.Field(ge=0, description="the policy version that generated it")
    generated_at: UTC_TIMESTAMP
    worker: str = pa.Field(description="the rollout worker that generated it")
    prompt_token_ids: Annotated[pl.List, pl.Int64()]
    completion_token_ids: Annotated[pl.List, pl.Int64()]
    behaviour_logps: Annotated[pl.List, pl.Float64()] = pa.Field(
        description="per completion token: its log-probability under the generating policy (the "
        "importance ratio's denominator)"
    )
    completion: str = pa.Field(description="the completion's tokens, decoded")
    reward: float = pa.Field(description="the verifier's reward")
    verifier_detail: str = pa.Field(description="why the verifier gave that reward")
    status: str = pa.Field(isin=["pending", "consumed", "dropped_stale"])
    consumed_by_version: pl.Int64 = pa.Field(
        nullable=True,
        ge=0,
        description="the policy version whose update consumed or dropped it; null while pending",
    )
    updated_at: UTC_TIMESTAMP = pa.Field(
        description="when the row was written or its status last changed"
    )

    class Config:
        strict = True
        coerce = False

    @pa.dataframe_check
    def _one_logp_per_completion_token(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            pl.col("behaviour_logps").list.len() == pl.col("completion_token_ids").list.len()
        )

    @pa.dataframe_check
    def _consumed_by_version_once_taken(cls, data: pa.PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            (pl.col("status") == "pending") == pl.col("consumed_by_version").is_null()
        )


# Per record format (lib.formats), the contracts of its bronze and silver tables.
FORMAT_CONTRACTS: dict[str, tuple[type[pa.DataFrameModel], type[pa.DataFrameModel]]] = {
    "sft": (BronzeRecord, SilverRecord),
    "preference": (BronzePreferenceRecord, SilverPreferencePair),
    "conversation": (BronzeConversation, SilverConversation),
}


def polars_schema(model: type[pa.DataFrameModel]) -> pl.Schema:
    """The polars column types a contract declares, in declaration order (columns matched by a
    pattern, such as the scorers', left out: a frame has them or not)."""
    columns = model.to_schema().columns
    return pl.Schema(
        {name: column.dtype.type for name, column in columns.items() if not column.regex}
    )


def conform(frame: pl.DataFrame, model: type[pa.DataFrameModel]) -> pl.DataFrame:
    """Select and cast a frame to the contract's columns and types (empty frames included), and the
    columns its patterns match."""
    schema = polars_schema(model)
    missing = [name for name in schema if name not in frame.columns]
    if missing:
        raise ValueError(f"{model.__name__}: frame lacks column(s) {missing}")
    patterns = [
        (re.compile(name), column.dtype.type)
        for name, column in model.to_schema().columns.items()
        if column.regex
    ]
    matched = [
        pl.col(name).cast(dtype)
        for name in frame.columns
        if name not in schema
        for pattern, dtype in patterns
        if pattern.match(name)
    ]
    return frame.select(*(pl.col(name).cast(dtype) for name, dtype in schema.items()), *matched)


def validate(frame: pl.DataFrame, model: type[pa.DataFrameModel]) -> pl.DataFrame:
    """Validate eagerly with every failure reported (not just the first)."""
    return model.validate(frame, lazy=True)
