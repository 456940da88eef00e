"""Training's, DPO's and the search's hyperparameters."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.resources.settings import setting_field, trainer_default


class TrainingPolicy(ConfigurableResource):
    """Default hyperparameters of training/checkpoint; a run's config overrides any of them."""

    preset: str = setting_field("train_preset")
    steps: int = setting_field("train_steps")
    micro_batch_size: int = trainer_default("micro_batch_size")
    grad_accum_steps: int = trainer_default("grad_accum_steps")
    lr: float = trainer_default("lr")
    warmup_steps: int = trainer_default("warmup_steps")
    weight_decay: float = trainer_default("weight_decay")
    seed: int = trainer_default("seed")
    log_every: int = trainer_default("log_every")
    eval_every: int = trainer_default("eval_every")
    checkpoint_every_steps: int = setting_field("train_checkpoint_every")
    checkpoint_every_minutes: float = trainer_default("checkpoint_every_minutes")
    keep_checkpoints: int = trainer_default("keep_checkpoints")
    base_model_lr: float = setting_field("base_model_lr", gt=0)

    def hyperparameters(self, from_base_model: bool = False) -> dict:
        """The trainer's hyperparameters: fine-tuning a base model takes ``base_model_lr``, a
        preset trained from scratch ``lr``."""
        values = self.model_dump(exclude={"base_model_lr"})
        return {**values, "lr": self.base_model_lr} if from_base_model else values


class DpoPolicy(ConfigurableResource):
    """Hyperparameters of training/dpo_checkpoint: DPO from the sft champion, against the reference
    pass. The model's architecture is the champion's; a run's config overrides any of these."""

    steps: int = setting_field("dpo_steps")
    lr: float = setting_field("dpo_lr")
    beta: float = setting_field("dpo_beta")
    micro_batch_size: int = trainer_default("micro_batch_size")
    grad_accum_steps: int = trainer_default("grad_accum_steps")
    warmup_steps: int = 5
    weight_decay: float = (
        0.0  # pulling weights towards zero pulls the policy away from its reference
    )
    seed: int = trainer_default("seed")
    log_every: int = 5
    eval_every: int = 20
    checkpoint_every_steps: int = setting_field("train_checkpoint_every")
    checkpoint_every_minutes: float = trainer_default("checkpoint_every_minutes")
    keep_checkpoints: int = trainer_default("keep_checkpoints")

    def hyperparameters(self) -> dict:
        return self.model_dump()


class HparamSearchPolicy(ConfigurableResource):
    """What training/hparam_search explores, and how hard it prunes."""

    space: dict[str, list] = Field(
        default_factory=lambda: {
            "lr": [1e-3, 3e-3, 1e-2],
            "warmup_steps": [5, 20],
            "weight_decay": [0.0, 0.1],
            "width": [64, 128],
        },
        description="hyperparameter -> values; any TrainConfig field (width: the model's dim)",
    )
    base_model_space: dict[str, list] = Field(
        default_factory=lambda: {
            "lr": [1e-5, 2e-5, 5e-5],
            "warmup_steps": [5, 20],
            "weight_decay": [0.0, 0.1],
        },
        description="the space when a base model is fine-tuned: its architecture is its own (no "
        "width), its learning rates a fine-tune's",
    )
    trials: int = setting_field("search_trials", ge=1)
    min_steps: int = setting_field("search_min_steps", ge=1)
    max_steps: int = setting_field("search_max_steps", ge=1)
    eta: int = Field(
        default=3, description="keep the best 1/eta at each rung; budgets grow eta times"
    )
    seed: int = 0
    nproc_per_node: int = Field(
        default=1, description="ranks per trial: trials are short, one rank each"
    )
