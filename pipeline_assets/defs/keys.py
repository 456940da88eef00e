"""Asset keys, exactly as the README's asset graph names them, and the other names one layer writes
and another reads. A record format's bronze and silver tables are named by its description
(lib.formats)."""

from dagster import AssetKey

from pipeline_assets.lib.formats import PREFERENCE, SFT

BRONZE_RECORDS = AssetKey(["bronze", SFT.bronze_table])
BRONZE_QUARANTINE = AssetKey(["bronze", "quarantine"])
BRONZE_PREFERENCE_RECORDS = AssetKey(
    ["bronze", PREFERENCE.bronze_table]
)  # the preference sources' records
REFERENCE_EVAL_SETS = AssetKey(["reference", "eval_sets"])
REFERENCE_BASE_MODEL = AssetKey(["reference", "base_model"])
REFERENCE_QUALITY_MODELS = AssetKey(["reference", "quality_models"])
SILVER_RECORDS = AssetKey(["silver", SFT.silver_table])
SILVER_REJECTS = AssetKey(["silver", "rejects"])
SILVER_PREFERENCE_PAIRS = AssetKey(
    ["silver", PREFERENCE.silver_table]
)  # the preference sources' curated pairs
SILVER_MINHASH_INDEX = AssetKey(["silver", "minhash_index"])
SILVER_MINHASH_BANDS = AssetKey(
    ["silver", "minhash_bands"]
)  # the index by band: what a new batch is joined with
GOLD_TOKENIZER = AssetKey(["gold", "tokenizer"])
GOLD_SEQUENCES = AssetKey(["gold", "sequences"])
GOLD_PREFERENCE_SEQUENCES = AssetKey(
    ["gold", "preference_sequences"]
)  # each batch's pairs, packed a pair a unit
GOLD_SNAPSHOTS = AssetKey(
    ["gold", "snapshots"]
)  # the manifests the README's graph draws between gold and training
GOLD_REFERENCE_LOGPS = AssetKey(
    ["gold", "reference_logps"]
)  # the reference model's log-probs of a preference snapshot
GOLD_PREFERENCE_SNAPSHOTS = AssetKey(
    ["gold", "preference_snapshots"]
)  # preference snapshots' manifests (dpo-v<N>)
TRAINING_HPARAM_SEARCH = AssetKey(["training", "hparam_search"])
TRAINING_CHECKPOINT = AssetKey(["training", "checkpoint"])
TRAINING_DPO_CHECKPOINT = AssetKey(["training", "dpo_checkpoint"])
EVALUATION_REPORT = AssetKey(["evaluation", "report"])
EVALUATION_DPO_REPORT = AssetKey(
    ["evaluation", "dpo_report"]
)  # held-out pairs: DPO candidate vs champion
REGISTRY_MODEL_VERSION = AssetKey(["registry", "model_version"])
REGISTRY_DPO_MODEL_VERSION = AssetKey(
    ["registry", "dpo_model_version"]
)  # dpo-model, gated on held-out pairs
OPS_PIPELINE_REPORT = AssetKey(["ops", "pipeline_report"])
RL_PROMPT_BANK = AssetKey(["rl", "prompt_bank"])  # prompts whose answer a rule checks
RL_POLICY = AssetKey(["rl", "policy"])
RL_REPLAY_BUFFER = AssetKey(["rl", "replay_buffer"])

# Where a training run keeps its exported model among its MLflow artifacts, for the registry.
MODEL_ARTIFACT_PATH = "model"
# The DPO report's slice holding the sft validation loss: the registry's gate reads it apart.
SFT_SLICE = "sft_validation_loss"
