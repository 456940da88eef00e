"""Model presets and the training configuration, with the command line that fills it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

# The trainer's exit code after a SIGTERM/SIGINT stop that saved a checkpoint (128 + SIGTERM, as a
# shell reports a process SIGTERM ended): the same command resumes.
EXIT_PREEMPTED = 143
EVAL_SPLITS = ("validation", "search")  # gold's held-out splits (pipeline_assets.lib.gold.splits)
ATTENTION_SETTINGS = (
    "auto",
    "flex",
    "dense",
)  # the attention kernel (parallel.attention_kernel resolves auto)
OBJECTIVES = (
    "sft",
    "dpo",
)  # next-token prediction on gold-v<N>, or DPO on the pairs of dpo-v<N> (trainer.objective)
DEFAULT_BETA = 0.1  # DPO's KL strength, the paper's and TRL's default (trainer.dpo uses it too)
NO_VERSION = -1  # an unset Delta version


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int = 8192
    max_seq_len: int = 512
    ffn_multiple: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def ffn_dim(self) -> int:
        """SwiGLU's hidden width: 8/3 of dim (as many parameters as a 4x GELU MLP), rounded up."""
        hidden = int(8 * self.dim / 3)
        return -(-hidden // self.ffn_multiple) * self.ffn_multiple


# From a few seconds per step on one CPU core to a few hundred million parameters on a GPU.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4),
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8),
    "base": ModelConfig(dim=1024, n_layers=8, n_heads=16, ffn_multiple=256),  # ~110M parameters
    "large": ModelConfig(dim=1024, n_layers=24, n_heads=16, ffn_multiple=256),  # ~310M parameters
}


@dataclass(frozen=True)
class TrainConfig:
    lake_uri: str
    # N of the data snapshot gold-v<N> (objective dpo: dpo-v<N>): the manifest row the trainer reads
    snapshot: int
    checkpoint_uri: str
    partition: str
    preset: str = "tiny"
    # a Hugging Face model folder to post-train instead of a preset (its config sets the
    # architecture and the vocabulary; preset, width and vocab_size are then not used)
    base_model: str = ""
    width: int = 0  # the model's dim instead of the preset's (a search dimension); 0: the preset's
    vocab_size: int = 8192
    steps: int = 200
    # the learning-rate schedule's length; 0: steps (a search's short trials share the long one)
    schedule_steps: int = 0
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 50
    eval_max_sequences: int = 256
    # the held-out split the loss is measured on; hparam search's trials use "search"
    eval_split: str = "validation"
    checkpoint_every_steps: int = 50
    checkpoint_every_minutes: float = 10.0
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    mixed_precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # auto: flex on GPU, dense on CPU (ATTENTION_SETTINGS); with base_model: flash-attn 2 on a GPU
    # when installed, else flex_attention, else sdpa (trainer.hf_model.attention_implementation)
    attention: str = "auto"
    device: str = "auto"
    scratch_dir: str = ""
    mlflow_run_id: str = ""
    mlflow_experiment: str = "pipeline_assets"
    objective: str = "sft"  # OBJECTIVES
    beta: float = DEFAULT_BETA  # dpo: the KL strength of the sigmoid loss
    # an exported model folder (trainer.export) to start from; dpo: the SFT champion, required.
    # A Hugging Face folder (this trainer's export of a base model, or any) is trained as the base
    # model; a built-in export needs this run's preset, width and vocab_size (``starting_flags``).
    init_from: str = ""
    reference_logps_version: int = (
        NO_VERSION  # dpo, required: the Delta version of gold/reference_logps to read
    )

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.width and self.width % PRESETS[self.preset].n_heads:
            raise ValueError(
                f"width {self.width} is not a multiple of the {self.preset} preset's "
                f"{PRESETS[self.preset].n_heads} heads"
            )
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(
                f"unknown eval split {self.eval_split!r}; choose one of {', '.join(EVAL_SPLITS)}"
            )
        if self.attention not in ATTENTION_SETTINGS:
            raise ValueError(
                f"unknown attention {self.attention!r}; choose one of "
                f"{', '.join(ATTENTION_SETTINGS)}"
            )
        if self.keep_checkpoints < 2:
            raise ValueError(
                "keep_checkpoints must be at least 2, so a corrupt newest one leaves a previous one"
            )
        self._check_objective()
        for name in (
            "steps",
            "micro_batch_size",
            "warmup_steps",
            "grad_accum_steps",
            "log_every",
            "eval_every",
            "checkpoint_every_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def _check_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}"
            )
        if self.objective != "dpo":
            if self.reference_logps_version != NO_VERSION:
                raise ValueError("--reference-logps-version is for --objective dpo only")
            return
        if not self.init_from:
            raise ValueError(
                "--objective dpo needs --init-from: the exported SFT model the policy starts from "
                "(the reference model whose log-probabilities gold/reference_logps holds)"
            )
        if self.reference_logps_version < 0:
            raise ValueError(
                "--objective dpo needs --reference-logps-version: the Delta version of "
                "gold/reference_logps to read the reference log-probabilities at"
            )
        if self.beta <= 0:
            raise ValueError(f"beta must be positive, got {self.beta}")

    def global_batch(self, world_size: int) -> int:
        return self.micro_batch_size * self.grad_accum_steps * world_size

    def to_args(self) -> list[str]:
        """The command line that rebuilds this config: what the asset passes and a user can
        rerun."""
        return dataclass_args(self)


def architecture_flags(model: dict) -> dict:
    """The preset, width and vocab_size that rebuild an exported model's architecture (its
    pipeline.json's ``model``): what a run starting from it (``init_from``) must be given."""
    for name, preset in PRESETS.items():
        same_shape = dataclasses.replace(
            preset,
            dim=model["dim"],
            vocab_size=model["vocab_size"],
            max_seq_len=model["max_seq_len"],
        )
        if dataclasses.asdict(same_shape) == model:
            return {
                "preset": name,
                "width": 0 if model["dim"] == preset.dim else model["dim"],
                "vocab_size": model["vocab_size"],
            }
    raise ValueError(f"no preset builds the model {model}")


def starting_flags(folder: str | Path) -> dict:
    """What a run starting from the exported model in ``folder`` (``init_from``) must be given
    beside it: a built-in export's preset, width and vocab_size; nothing for a Hugging Face
    backend's export, whose config.json is the architecture."""
    if not (Path(folder) / EXPORT_ABOUT).is_file():
        return {}  # a Hugging Face folder the pipeline did not write: a base model
    about = exported_config(folder)
    if about.get("backend") == "huggingface":
        return {}
    return architecture_flags(about["model"])


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    return parse_dataclass(TrainConfig, argv, "torchrun ... -m pipeline_assets.trainer")


@dataclass(frozen=True)
class RlConfig:
    """One RL run (GRPO on rl/prompt_bank's verifiable prompts): what the learner and its rollout
    workers share. The learner and each worker are started with the same arguments (``to_args``), a
    worker with ``--worker``."""

    lake_uri: str
    checkpoint_uri: str
    partition: str  # the run's folder of policy versions in the checkpoint store
    tokenizer_path: str  # tokenizer.json of the policy (the sft champion's gold/tokenizer version)
    init_from: str  # the exported model the policy starts from
    # the chat template and its special tokens as one JSON file (lib.gold.encoder.EncoderSpec), for
    # a policy post-trained from a base model; empty: the built-in chat format
    chat_template_path: str = ""
    tasks: str = ""  # the bank's tasks to train on, comma-separated (e.g. "sort"); empty: all
    updates: int = 60
    prompts_per_update: int = 32
    group_size: int = 8
    max_new_tokens: int = 14
    # The learner packs completions (and warm-start examples) into rows of this many tokens, at
    # most the model's longest sequence: a base model taking 32k positions would otherwise attend
    # over one row holding the whole batch.
    pack_len: int = 512
    # Measured on the generated sort task (docs/rl.md, "What was measured"): a tenth of sft's
    # learning rate, four steps on each batch; at 1e-3 and above a freshly tuned policy collapses
    # within a few updates.
    lr: float = 3e-4
    steps_per_update: int = 4
    clip_eps: float = 0.2
    max_staleness: int = 2
    max_pending_seconds: float = 600.0
    seed: int = 1234
    eval_every: int = 10
    held_out_prompts: int = 200  # greedy accuracy is measured on this many held-out prompts
    # A starting policy below this held-out accuracy is first tuned on the bank's training prompts
    # (sft), at most warm_start_max_steps steps: GRPO learns only from groups with both a right and
    # a wrong answer.
    warm_start_accuracy: float = 0.3
    warm_start_max_steps: int = 600
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    landing_uri: str = (
        ""  # where groups with a right and a wrong completion land as preference pairs
    )
    wait_seconds: float = 120.0  # how long the learner waits for rollouts before it gives up
    worker: int = -1  # >= 0: this process is rollout worker number ``worker``, not the learner
    # workers sample with the policy ``lag`` versions behind the newest (a test of the staleness
    # limit)
    lag: int = 0
    # -1: a worker samples with the newest policy version, so how stale a batch is depends on
    # timing. k >= 0: update u trains on a batch sampled with version max(0, u - k), its prompts
    # and samples seeded by (seed, worker, u), so one worker's run is the same whatever the load:
    # 0 alternates sampling and updates (on-policy), 1 samples the next batch during an update.
    off_policy_steps: int = -1
    mlflow_run_id: str = ""
    mlflow_experiment: str = "pipeline_assets"
    scratch_dir: str = ""

    def __post_init__(self):
        for name in (
            "updates",
            "prompts_per_update",
            "max_new_tokens",
            "pack_len",
            "eval_every",
            "held_out_prompts",
            "steps_per_update",
            "warm_start_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.off_policy_steps > self.max_staleness:
            raise ValueError(
                f"off_policy_steps {self.off_policy_steps} exceeds max_staleness "
                f"{self.max_staleness}: every scheduled batch would be dropped as stale"
            )
        if self.off_policy_steps >= 0 and self.lag:
            raise ValueError("a worker follows either off_policy_steps or lag, not both")
        if self.group_size < 2:
            raise ValueError(
                "group_size must be at least 2: GRPO compares completions within a group"
            )

    def to_args(self) -> list[str]:
        return dataclass_args(self)


def dataclass_args(config) -> list[str]:
    """The command line that rebuilds a config dataclass: what an asset passes and a user can
    rerun."""
    args = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        flag = "--" + item.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + item.name.replace("_", "-"))
        elif (
            value not in ("", NO_VERSION) or item.default is dataclasses.MISSING
        ):  # unset: left out
            args += [flag, str(value)]
    return args


def parse_dataclass(cls, argv: list[str] | None, prog: str):
    """A config dataclass from its command line (``dataclass_args``'s)."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    for item in dataclasses.fields(cls):
        flag = "--" + item.name.replace("_", "-")
        required = item.default is dataclasses.MISSING
        if item.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=item.default)
        else:
            kind = {"int": int, "float": float}.get(str(item.type), str)
            parser.add_argument(
                flag, type=kind, required=required, default=None if required else item.default
            )
    return cls(**vars(parser.parse_args(argv)))


EXPORT_ABOUT = "pipeline.json"  # beside an exported model: what the pipeline knows about its run


def exported_config(folder: str | Path) -> dict:
    """An exported model's ``pipeline.json``: the preset's config under ``model``, and the run's
    facts (readable without torch: the code location loads this module)."""
    return json.loads((Path(folder) / EXPORT_ABOUT).read_text())
