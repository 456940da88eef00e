"""Every setting, written once: its environment variable, its default and its meaning
(``SETTINGS``).

``Settings.from_env`` reads them; each policy field a setting sets takes its default, description
and value from it (``setting_field``, ``policy_from``); and the table in docs/settings.md is what
``python -m pipeline_assets.resources.settings`` prints (a test keeps the two equal). A default
that code below ``defs/`` also needs (``lib/``, ``trainer/``) is that layer's constant, named here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.formats import FORMATS
from pipeline_assets.lib.gold.conversations import DEFAULT_LOSS as DEFAULT_CONVERSATION_LOSS
from pipeline_assets.lib.gold.conversations import LOSS_MODES as CONVERSATION_LOSS_MODES
from pipeline_assets.lib.gold.preference import (
    VALIDATION_FRACTION as PREFERENCE_VALIDATION_FRACTION,
)
from pipeline_assets.lib.gold.sequences import DEFAULT_LONG_RECORDS, LONG_RECORD_MODES
from pipeline_assets.lib.ops.cost import Prices
from pipeline_assets.lib.silver.language import known_languages
from pipeline_assets.lib.silver.preference_rules import MAX_PAIRS_PER_PROMPT
from pipeline_assets.lib.silver.scorers import ScorerError, check_scorer, parse_scorers
from pipeline_assets.lib.stages import RAY_MIN_ROWS
from pipeline_assets.trainer.config import DEFAULT_BETA, TrainConfig

P = TypeVar("P", bound=BaseModel)
HOME = "$PIPELINE_HOME"  # a default under the home: resolved against PIPELINE_HOME when read
# (variable, raw value) -> value; a ValueError names the variable
Reader = Callable[[str, str], Any]


def text(variable: str, raw: str) -> str:
    return raw


def number(
    minimum: float | None = None, below: float | None = None, above: float | None = None
) -> Reader:
    def read(variable: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError as exc:
            raise ValueError(f"{variable}={raw!r} is not a number") from exc
        if minimum is not None and value < minimum:
            least = "zero" if minimum == 0 else f"{minimum:g}"
            raise ValueError(f"{variable}={value:g} must be {least} or more")
        if above is not None and value <= above:
            raise ValueError(f"{variable}={value:g} must be more than {above:g}")
        if below is not None and value >= below:
            raise ValueError(f"{variable}={value:g} must be below {below:g}")
        return value

    return read


def integer(minimum: int | None = None) -> Reader:
    as_number = number(minimum)
    return lambda variable, raw: int(as_number(variable, raw))


def length_ratio(variable: str, raw: str) -> float:
    value = number(0)(variable, raw)
    if 0 < value <= 1:
        raise ValueError(
            f"{variable}={value:g} must be more than 1 (a ratio of lengths), or 0 to only count it"
        )
    return value


def choice(*choices: str) -> Reader:
    def read(variable: str, raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"{variable}={raw!r} is not one of {', '.join(map(repr, choices))}")
        return raw

    return read


def json_object(variable: str, raw: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{variable} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{variable} must be a JSON object")
    return value


def field_mappings(variable: str, raw: str) -> dict[str, dict[str, str]]:
    """``{"<source>": {"<their field>": "<our field>"}}``, e.g.
    ``{"logs": {"completion": "response"}}``."""
    value = json_object(variable, raw)
    if not all(
        isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
        for m in value.values()
    ):
        raise ValueError(
            f'{variable} must look like {{"<source>": {{"<their field>": "<our field>"}}}}'
        )
    return value


def source_formats(variable: str, raw: str) -> dict[str, str]:
    """``{"<source>": "<record format>"}``, e.g. ``{"prefs": "preference"}``; a source not named is
    sft."""
    value = json_object(variable, raw)
    if not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f'{variable} must look like {{"<source>": "<record format>"}}')
    unknown = sorted({v for v in value.values() if v not in FORMATS})
    if unknown:
        raise ValueError(
            f"{variable} names unknown record format(s) {', '.join(unknown)}; "
            f"one of {', '.join(FORMATS)}"
        )
    return value


def language_codes(variable: str, raw: str) -> list[str]:
    """``en,de``: the languages silver keeps, as the language-ID model names them."""
    codes = sorted({code.strip().lower() for code in raw.split(",") if code.strip()})
    odd = [code for code in codes if not re.fullmatch(r"[a-z]{2,3}", code)]
    if odd:
        raise ValueError(
            f"{variable}={raw!r}: {', '.join(odd)} is not a language code (ISO 639-1, such as en)"
        )
    unknown = [code for code in codes if code not in known_languages()]
    if unknown:
        raise ValueError(
            f"{variable}={raw!r}: the language-ID model (lid.176) knows no language "
            f"{', '.join(unknown)}; it would reject every record"
        )
    return codes


def quality_models(variable: str, raw: str) -> str:
    """A JSON list of scorers (``lib.silver.scorers.ScorerSpec``), each a local model checked
    here, before any batch runs: a folder that is not a sequence classifier, a fastText file that
    does not load, a label the model lacks."""
    try:
        for spec in parse_scorers(raw, variable):
            if not uris.is_s3(spec.model):
                check_scorer(spec)
    except ScorerError as error:
        raise ValueError(f"{variable}: {error}") from None
    return raw


def kuberay_file(variable: str, raw: str) -> str:
    if os.environ.get("RAY_ADDRESS", "").strip():
        raise ValueError(
            f"RAY_ADDRESS and {variable} are both set: the data layers run on one Ray cluster, "
            "name one"
        )
    return raw


@dataclass(frozen=True)
class Setting:
    """One environment variable. ``field`` is its ``Settings`` field; ``None`` for a variable only a
    library reads (boto3, deltalake, Ray), listed so the docs show it."""

    variable: str
    default: Any
    meaning: str
    read: Reader = text
    field: str | None = None

    def value(self, home: str) -> Any:
        raw = os.environ.get(self.variable, "").strip()
        if raw:
            return self.read(self.variable, raw)
        if isinstance(self.default, str):
            return self.default.replace(HOME, home)
        return copy_of(self.default)

    def shown_default(self) -> str:
        if self.default in ("", None, []):
            return "unset"
        if isinstance(self.default, dict):
            return json.dumps(self.default)
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


def copy_of(value: Any) -> Any:
    return type(value)(value) if isinstance(value, (dict, list)) else value


def trainer_default(name: str):
    """The trainer's own default: one source for a by-hand run and for the Dagster resource."""
    return next(item.default for item in dataclasses.fields(TrainConfig) if item.name == name)


PRICES = Prices()
SETTINGS: tuple[Setting, ...] = (
    Setting("PIPELINE_HOME", "./.pipeline", "root of everything local below", field="home"),
    Setting(
        "PIPELINE_LANDING_URI",
        f"{HOME}/landing",
        "landing zone, local path or `s3://bucket/prefix`",
        field="landing_uri",
    ),
    Setting(
        "PIPELINE_LAKE_URI",
        f"{HOME}/lake",
        "Delta tables, local path or `s3://bucket/prefix`",
        field="lake_uri",
    ),
    Setting(
        "PIPELINE_CHECKPOINT_URI",
        f"{HOME}/checkpoints",
        "training checkpoints, local or `s3://`",
        field="checkpoint_uri",
    ),
    Setting(
        "PIPELINE_EVAL_SETS_URI",
        f"{HOME}/reference/eval_sets",
        "benchmark items the data must not contain",
        field="eval_sets_uri",
    ),
    Setting(
        "MLFLOW_TRACKING_URI",
        f"sqlite:///{HOME}/mlflow.db",
        "experiment tracking and registry (may hold a password: see operations.md, On a cluster)",
        field="mlflow_tracking_uri",
    ),
    Setting(
        "DAGSTER_HOME",
        f"{HOME}/dagster",
        "Dagster instance (runs, events, sensors)",
        field="dagster_home",
    ),
    Setting(
        "PIPELINE_FIELD_MAPPINGS",
        {},
        'per source, their field -> ours: `{"logs": {"completion": "response"}}`',
        field_mappings,
        "field_mappings",
    ),
    Setting(
        "PIPELINE_SOURCE_FORMATS",
        {},
        "per source, its record format (`lib/formats.py`): `sft` (prompt, response; the default), "
        "`preference` (prompt, chosen, rejected, optional `score_chosen`, `score_rejected`) or "
        "`conversation` (`messages`: role and content turns, or ShareGPT's `conversations`): "
        '`{"prefs": "preference", "chats": "conversation"}`; an unknown format exits 2',
        source_formats,
        "source_formats",
    ),
    Setting(
        "PIPELINE_MAX_QUARANTINE_RATE",
        0.05,
        "blocking: a source's quarantined share of one batch",
        number(),
        "max_quarantine_rate",
    ),
    Setting(
        "PIPELINE_VOLUME_TOLERANCE",
        0.20,
        "warning: rows per input MB against the trailing median",
        number(),
        "volume_tolerance",
    ),
    Setting(
        "PIPELINE_FRESHNESS_SLA_HOURS",
        24.0,
        "warning: age of a source's newest record",
        number(),
        "freshness_sla_hours",
    ),
    Setting(
        "PIPELINE_QUALITY_THRESHOLDS",
        {},
        'per source quality-rule overrides: `{"logs": {"min_words": 3}}`',
        json_object,
        "quality_thresholds",
    ),
    Setting(
        "PIPELINE_MAX_PAIRS_PER_PROMPT",
        MAX_PAIRS_PER_PROMPT,
        "preference pairs kept a normalized prompt, over every batch; the rest are rejected as "
        "`pair_cap`",
        integer(1),
        "max_pairs_per_prompt",
    ),
    Setting(
        "PIPELINE_PREFERENCE_MAX_LENGTH_RATIO",
        0.0,
        "preference pairs: reject a pair whose chosen and rejected lengths differ by more than "
        "this factor either way (`pair:length_ratio`); 0 only counts the pairs beyond 4x",
        length_ratio,
        "max_length_ratio",
    ),
    Setting(
        "PIPELINE_LANGUAGES",
        [],
        "ISO 639-1 codes silver keeps (`en,de`); the others are rejected as `language`; unset: "
        "every record's language is recorded, none rejected for it",
        language_codes,
        "languages",
    ),
    Setting(
        "PIPELINE_QUALITY_MODELS",
        "[]",
        'the user\'s scorers, a JSON list: `[{"name": "edu", "model": "<HF sequence-classification '
        'folder or fastText file>", "text": "response", "min": 2.5}]`; each writes `score_<name>`, '
        "and a record below `min` is rejected as `quality_model` (docs/silver.md, Model scorers)",
        quality_models,
        "quality_models",
    ),
    Setting(
        "PIPELINE_PREFERENCE_VALIDATION_FRACTION",
        PREFERENCE_VALIDATION_FRACTION,
        "preference pairs: the share of prompts held out, with all their pairs, for preference "
        "accuracy",
        number(),
        "preference_validation_fraction",
    ),
    Setting(
        "PIPELINE_BASE_MODEL",
        "",
        "a Hugging Face model folder (local or `s3://`) to post-train, with its tokenizer and chat "
        "template; unset: the built-in preset trained from scratch",
        field="base_model",
    ),
    Setting(
        "PIPELINE_BASE_MODEL_LR",
        2e-5,
        "the learning rate of training from the base model (TRL's SFT default; the presets from "
        "scratch keep the trainer's own)",
        number(above=0),
        "base_model_lr",
    ),
    Setting(
        "PIPELINE_TOKENIZER",
        "",
        "a `tokenizer.json` to use instead of training byte-level BPE on silver",
        field="tokenizer_path",
    ),
    Setting(
        "PIPELINE_VOCAB_SIZE", 8192, "vocabulary of the trained tokenizer", integer(), "vocab_size"
    ),
    Setting(
        "PIPELINE_TOKENIZER_SAMPLE_CHARS",
        100_000_000,
        "the trained tokenizer's sample of silver's training split: records in ascending order of "
        "a hash of their content, taken while their texts (system, prompt, response) total at most "
        "this many characters",
        integer(1),
        "tokenizer_sample_chars",
    ),
    Setting("PIPELINE_SEQ_LEN", 512, "packed sequence length", integer(), "seq_len"),
    Setting(
        "PIPELINE_LONG_RECORDS",
        DEFAULT_LONG_RECORDS,
        "a record longer than `PIPELINE_SEQ_LEN`: `truncate` it (an sft record's response is "
        "cut, a conversation after its last assistant turn that fits), or `drop` it (see "
        "gold.md); either way it keeps its prompt",
        choice(*LONG_RECORD_MODES),
        "long_records",
    ),
    Setting(
        "PIPELINE_CONVERSATION_LOSS",
        DEFAULT_CONVERSATION_LOSS,
        "what a conversation trains on: `all` its assistant turns, or the `last` alone (for "
        "sources where only the final answer should train); system and user turns never",
        choice(*CONVERSATION_LOSS_MODES),
        "conversation_loss",
    ),
    Setting(
        "PIPELINE_VALIDATION_FRACTION",
        0.02,
        "share of records in the validation split",
        number(),
        "validation_fraction",
    ),
    Setting(
        "PIPELINE_SEARCH_FRACTION",
        0.02,
        "share of records in the search split (hyperparameter search selects on it; taken from "
        "train only, validation never changes)",
        number(),
        "search_fraction",
    ),
    Setting(
        "PIPELINE_SHUFFLE_SEED", 20261121, "seed of the sequence shuffle", integer(), "shuffle_seed"
    ),
    Setting(
        "PIPELINE_SNAPSHOT_MIN_NEW_FRACTION",
        0.10,
        "cut a new data snapshot when the tokens of the gold shards built since the last cut reach "
        "this share of the last snapshot's",
        number(),
        "snapshot_min_new_fraction",
    ),
    Setting(
        "PIPELINE_TRAIN_NPROC",
        2,
        "torchrun ranks per node (GPUs on a GPU node)",
        integer(),
        "train_nproc",
    ),
    Setting(
        "PIPELINE_TRAIN_THREADS_PER_RANK",
        1,
        "`OMP_NUM_THREADS` of each rank",
        integer(),
        "train_threads_per_rank",
    ),
    Setting(
        "PIPELINE_TRAIN_DEVICE",
        "auto",
        "`auto` (CUDA when present: NCCL + bf16), `cuda` or `cpu` (gloo, fp32)",
        text,
        "train_device",
    ),
    Setting(
        "PIPELINE_TRAIN_PRESET",
        trainer_default("preset"),
        "model size: `tiny`, `small`, `base` (~110M), `large` (~310M)",
        field="train_preset",
    ),
    Setting(
        "PIPELINE_TRAIN_STEPS",
        trainer_default("steps"),
        "optimizer steps per training run",
        integer(),
        "train_steps",
    ),
    Setting(
        "PIPELINE_TRAIN_CHECKPOINT_EVERY",
        trainer_default("checkpoint_every_steps"),
        "steps between checkpoints (a killed run resumes from the newest)",
        integer(),
        "train_checkpoint_every",
    ),
    Setting(
        "PIPELINE_SEARCH_TRIALS",
        6,
        "configurations training/hparam_search samples from its grid",
        integer(1),
        "search_trials",
    ),
    Setting(
        "PIPELINE_SEARCH_MIN_STEPS",
        10,
        "steps of every search trial at the first rung",
        integer(1),
        "search_min_steps",
    ),
    Setting(
        "PIPELINE_SEARCH_MAX_STEPS",
        90,
        "steps of the search's last rung (and every trial's schedule)",
        integer(1),
        "search_max_steps",
    ),
    Setting(
        "PIPELINE_DPO_STEPS",
        60,  # a short, gentle run from an already trained sft model
        "optimizer steps per DPO run (`training/dpo_checkpoint`)",
        integer(1),
        "dpo_steps",
    ),
    Setting(
        "PIPELINE_DPO_LR",
        3e-5,
        "DPO's peak learning rate (far below sft's: DPO nudges a trained model; see training.md, "
        "DPO)",
        number(),
        "dpo_lr",
    ),
    Setting("PIPELINE_DPO_BETA", DEFAULT_BETA, "DPO's KL strength", number(), "dpo_beta"),
    Setting("PIPELINE_MODEL_NAME", "sft-model", "the registered model's name", field="model_name"),
    Setting(
        "PIPELINE_DPO_MODEL_NAME",
        "dpo-model",
        "the registered model DPO candidates are judged against (its `champion` alias)",
        field="dpo_model_name",
    ),
    Setting(
        "PIPELINE_MLFLOW_EXPERIMENT",
        "pipeline_assets",
        "MLflow experiment of training runs",
        field="mlflow_experiment",
    ),
    Setting(
        "PIPELINE_MLFLOW_ARTIFACT_URI",
        f"{HOME}/mlartifacts",
        "where MLflow stores run artifacts",
        field="mlflow_artifact_root",
    ),
    Setting(
        "PIPELINE_MLFLOW_UI_URL",
        "http://127.0.0.1:5000",
        "the MLflow UI links in Dagster metadata point here",
        field="mlflow_ui_url",
    ),
    Setting(
        "PIPELINE_PROMOTION_MARGIN",
        0.005,
        "blocking gate: relative validation-loss improvement over the champion; for `dpo-model`, "
        "preference-accuracy gain (absolute; over chance for a first model), or at level accuracy "
        "the relative mean-margin gain",
        number(),
        "promotion_margin",
    ),
    Setting(
        "PIPELINE_SLICE_TOLERANCE",
        0.02,
        "blocking gate: relative loss increase allowed on any slice; for `dpo-model`, the relative "
        "sft validation-loss increase and the preference accuracy (absolute) any source may lose",
        number(),
        "slice_tolerance",
    ),
    Setting(
        "PIPELINE_EVAL_MAX_TOKENS",
        2_000_000,
        "validation tokens evaluation scores per model (a fixed sample)",
        integer(),
        "eval_max_tokens",
    ),
    Setting(
        "RAY_ADDRESS",
        "",
        "the Ray cluster silver's and gold's block stages run on; unset: a local Ray for large "
        "batches",
    ),
    Setting(
        "PIPELINE_RAY_MIN_ROWS",
        RAY_MIN_ROWS,
        "without `RAY_ADDRESS`, batches this large start a local Ray; smaller ones run in the "
        "step's process",
        integer(0),
        "ray_min_rows",
    ),
    Setting(
        "PIPELINE_KUBERAY",
        "",
        "a YAML file of dagster-ray `KubeRayInteractiveJob` settings: each silver and gold step "
        "gets its own KubeRay `RayJob` and every batch runs there (not with `RAY_ADDRESS`)",
        kuberay_file,
        "kuberay_config",
    ),
    Setting(
        "PIPELINE_PRICE_CORE_HOUR",
        PRICES.core_hour,
        "$ per vCPU-hour, for the pipeline report's cost model",
        number(),
        "core_hour_usd",
    ),
    Setting("PIPELINE_PRICE_GPU_HOUR", PRICES.gpu_hour, "$ per GPU-hour", number(), "gpu_hour_usd"),
    Setting(
        "PIPELINE_SPOT_DISCOUNT",
        PRICES.spot_discount,
        "fraction off on spot capacity (0.6: pay 40%)",
        number(),
        "spot_discount",
    ),
    Setting(
        "PIPELINE_EXECUTOR",
        "in_process",
        "how a launched run executes its steps: `in_process` (one process per run; a process per "
        "step would cost seconds of imports each on a small machine) or `multiprocess` (steps side "
        "by side)",
        field="executor",
    ),
    Setting(
        "PIPELINE_RETRY_DELAY_SECONDS",
        10.0,
        "first wait of the retry policy on stages that can fail for a moment (doubling, 3 retries)",
        number(),
        "retry_delay_seconds",
    ),
    Setting(
        "AWS_MAX_ATTEMPTS",
        6,
        "tries of one S3 request to the landing zone, the first included",
        integer(),
        "s3_max_attempts",
    ),
    Setting(
        "PIPELINE_RETENTION_DAYS",
        7.0,
        "the retention job's window: old Delta files, checkpoints and abandoned staging older than "
        "this are deleted (see operations.md, Retention)",
        number(0),
        "retention_days",
    ),
    Setting(
        "AWS_ENDPOINT_URL",
        "",
        "any S3-compatible store (with the other `AWS_*` variables), through dagster-aws and "
        "deltalake",
    ),
    Setting(
        "PIPELINE_RL_BANK_TASKS",
        3000,
        "generated verifiable tasks in `rl/prompt_bank`",
        integer(1),
        "rl_bank_tasks",
    ),
    Setting(
        "PIPELINE_RL_BANK_SEED", 20261126, "the task generator's seed", integer(), "rl_bank_seed"
    ),
    Setting(
        "PIPELINE_RL_HELD_OUT_FRACTION",
        0.2,
        "bank prompts held out (by hash) for held-out accuracy",
        number(0, below=1),
        "rl_held_out_fraction",
    ),
    Setting(
        "PIPELINE_RL_GROUP_SIZE",
        8,
        "completions per prompt: GRPO's group",
        integer(2),
        "rl_group_size",
    ),
    Setting(
        "PIPELINE_RL_UPDATES",
        60,
        "GRPO updates of an RL run (a run's config may give its own `updates`)",
        integer(1),
        "rl_updates",
    ),
    Setting(
        "PIPELINE_RL_WARM_START_MAX_STEPS",
        600,
        "most sft steps that tune a starting policy too weak for GRPO on the bank's training "
        "prompts first (0: none)",
        integer(0),
        "rl_warm_start_max_steps",
    ),
    Setting(
        "PIPELINE_RL_ROLLOUT_WORKERS",
        1,
        "rollout processes beside the RL learner",
        integer(1),
        "rl_rollout_workers",
    ),
    Setting(
        "PIPELINE_RL_MAX_STALENESS",
        2,
        "policy versions a rollout may lag the update that consumes it; older ones are dropped",
        integer(0),
        "rl_max_staleness",
    ),
    Setting(
        "PIPELINE_RL_MAX_PENDING_SECONDS",
        600.0,
        "how long a rollout may wait unconsumed before the freshness check fails",
        number(above=0),
        "rl_max_pending_seconds",
    ),
)
BY_FIELD = {s.field: s for s in SETTINGS if s.field}


def default(name: str) -> Any:
    """The default of the setting that sets ``Settings.<name>``: what a policy's field starts at."""
    return copy_of(BY_FIELD[name].default)


def meaning(name: str) -> str:
    return BY_FIELD[name].meaning


def setting_field(name: str, **constraints) -> Any:
    """A policy's field that the setting behind ``Settings.<name>`` sets: the setting's default and
    meaning; ``policy_from`` fills it from the settings."""
    return Field(
        default=default(name),
        description=meaning(name),
        json_schema_extra={"setting": name},
        **constraints,
    )


def policy_from(policy: type[P], settings: Settings) -> P:
    """``policy`` with every field that a setting sets (``setting_field``) as the settings give
    it."""
    return policy(
        **{
            name: getattr(settings, info.json_schema_extra["setting"])
            for name, info in policy.model_fields.items()
            if isinstance(info.json_schema_extra, dict) and "setting" in info.json_schema_extra
        }
    )


@dataclass(frozen=True)
class Settings:
    """Every setting with a field (``SETTINGS``), as the environment gives it: ``from_env``."""

    home: str
    landing_uri: str
    lake_uri: str
    checkpoint_uri: str
    eval_sets_uri: str
    mlflow_tracking_uri: str
    dagster_home: str
    field_mappings: dict[str, dict[str, str]]
    source_formats: dict[str, str]
    max_quarantine_rate: float
    volume_tolerance: float
    freshness_sla_hours: float
    quality_thresholds: dict[str, dict[str, float]]
    max_pairs_per_prompt: int
    max_length_ratio: (
        float  # preference pairs: 0 counts the ratio only, a number also rejects beyond it
    )
    languages: list[str]
    quality_models: str  # the JSON list of scorers
    preference_validation_fraction: float
    base_model: str
    base_model_lr: float
    tokenizer_path: str
    vocab_size: int
    tokenizer_sample_chars: int
    seq_len: int
    long_records: str
    conversation_loss: str
    validation_fraction: float
    search_fraction: float
    shuffle_seed: int
    snapshot_min_new_fraction: float
    train_nproc: int
    train_threads_per_rank: int
    train_device: str
    train_preset: str
    train_steps: int
    train_checkpoint_every: int
    search_trials: int
    search_min_steps: int
    search_max_steps: int
    dpo_steps: int
    dpo_lr: float
    dpo_beta: float
    model_name: str
    dpo_model_name: str
    mlflow_experiment: str
    mlflow_artifact_root: str
    mlflow_ui_url: str
    promotion_margin: float
    slice_tolerance: float
    eval_max_tokens: int
    ray_min_rows: int
    # a file of dagster-ray KubeRayInteractiveJob settings; empty: RAY_ADDRESS or a local Ray
    kuberay_config: str
    core_hour_usd: float
    gpu_hour_usd: float
    spot_discount: float
    executor: str
    retry_delay_seconds: float
    s3_max_attempts: int  # AWS_MAX_ATTEMPTS: tries of one S3 request, the first included
    retention_days: float
    rl_bank_tasks: int
    rl_bank_seed: int
    rl_held_out_fraction: float
    rl_group_size: int
    rl_updates: int
    rl_warm_start_max_steps: int
    rl_rollout_workers: int
    rl_max_staleness: int
    rl_max_pending_seconds: float

    def prices(self) -> Prices:
        return Prices(
            core_hour=self.core_hour_usd,
            gpu_hour=self.gpu_hour_usd,
            spot_discount=self.spot_discount,
        )

    @classmethod
    def from_env(cls) -> Settings:
        """Each variable that is set, else its default; a bad value fails naming its variable."""
        home = str(Path(BY_FIELD["home"].value("")).resolve())
        return cls(
            home=home, **{name: s.value(home) for name, s in BY_FIELD.items() if name != "home"}
        )


def _cell(default: str) -> str:
    return default if default == "unset" else f"`{default}`"


def markdown_table() -> str:
    """docs/settings.md's table of every setting."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.variable}` | {_cell(s.shown_default())} | {s.meaning} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
