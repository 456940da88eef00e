"""What differs between training objectives, one class each: the snapshot a run reads, the loss of a
micro-batch, what a log step and a held-out evaluation report. The Trainer runs every objective the
same way: the stream, FSDP2, gradient accumulation, checkpoints, signals, MLflow.

An objective's loss is a mean over units of the global batch (SFT: loss tokens; DPO: pairs). Every
rank counts the units of its micro-batches, one all_reduce per step gives the global count, and each
micro-batch backpropagates its sum times ``world_size / global units``: FSDP2 averages gradients
over the ranks, so any world size and any accumulation give one process's gradients on the global
batch.
"""

from __future__ import annotations

import torch

from pipeline_assets.trainer.config import TrainConfig
from pipeline_assets.trainer.data import Snapshot, read_preference_snapshot, read_snapshot
from pipeline_assets.trainer.dpo import chosen_and_rejected, dpo_loss, summed_document_logps
from pipeline_assets.trainer.model import counted_loss_sum, counted_targets

Batch = dict[str, torch.Tensor]


class Objective:
    name: str
    loss_unit: str  # what the loss is a mean over, as a loss curve's axis says it

    def read_snapshot(self, config: TrainConfig) -> Snapshot:
        raise NotImplementedError

    def units(self, batch: Batch) -> torch.Tensor:
        """How many units of the loss's mean this batch holds (an integer tensor)."""
        raise NotImplementedError

    def loss(
        self, token_losses: torch.Tensor, batch: Batch, global_units: torch.Tensor, world_size: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """From the model's next-token losses of the batch (B, T-1, ``model(input_ids,
        position_ids, next_token_losses=True)``): (what this micro-batch backpropagates, the sums
        over its units of what a step reports: ``loss`` and the objective's own metrics; divided by
        the global units, they are the global batch's means)."""
        raise NotImplementedError

    def evaluation(self, means: dict[str, float], split: str) -> dict[str, float]:
        """What a held-out evaluation reports, from the means of ``loss``'s sums over the held-out
        rows; ``<split>_loss`` first (the loss the best checkpoint is chosen by)."""
        return {f"{split}_loss": means["loss"]}


class NextTokenPrediction(Objective):
    """SFT: the mean next-token cross-entropy per loss token of gold-v<N>'s packed sequences."""

    name = "sft"
    loss_unit = "nats/token"

    def read_snapshot(self, config: TrainConfig) -> Snapshot:
        return read_snapshot(config.lake_uri, config.snapshot, vocab_size=config.vocab_size)

    def units(self, batch: Batch) -> torch.Tensor:
        return counted_targets(batch["loss_mask"], batch["position_ids"]).sum()

    def loss(self, token_losses, batch, global_units, world_size):
        loss_sum, _ = counted_loss_sum(token_losses, batch["loss_mask"], batch["position_ids"])
        return loss_sum * (world_size / global_units.clamp(min=1)), {"loss": loss_sum.detach()}


class DirectPreference(Objective):
    """DPO on dpo-v<N>'s packed pairs against the reference log-probabilities stored with them: the
    mean sigmoid loss per pair, with the implicit rewards of ``trainer.dpo.dpo_loss``."""

    name = "dpo"
    loss_unit = "per pair"

    def __init__(self, beta: float):
        self.beta = beta

    def read_snapshot(self, config: TrainConfig) -> Snapshot:
        return read_preference_snapshot(
            config.lake_uri,
            config.snapshot,
            config.reference_logps_version,
            vocab_size=config.vocab_size,
        )

    def units(self, batch: Batch) -> torch.Tensor:
        reference = batch["reference_logps"]  # two documents a pair, checked when read
        return torch.tensor(reference.numel() // 2, device=reference.device)

    def loss(self, token_losses, batch, global_units, world_size):
        policy = summed_document_logps(-token_losses, batch["loss_mask"], batch["position_ids"])
        reference = batch["reference_logps"]
        if policy.numel() != reference.numel():
            raise ValueError(
                f"the policy finds {policy.numel()} documents in a batch whose reference "
                f"log-probabilities list {reference.numel()}: rows and reference pass disagree"
            )
        loss, means = dpo_loss(
            *chosen_and_rejected(policy),
            *chosen_and_rejected(reference),
            beta=self.beta,
            global_pairs=global_units,
            world_size=world_size,
        )
        pairs = means.pop("pairs")
        return loss, {name: mean * pairs for name, mean in means.items()}

    def evaluation(self, means: dict[str, float], split: str) -> dict[str, float]:
        return {
            f"{split}_loss": means["loss"],
            "eval/preference_accuracy": means["rewards/accuracies"],
            "eval/reward_margin": means["rewards/margins"],
        }


def build_objective(config: TrainConfig) -> Objective:
    return DirectPreference(config.beta) if config.objective == "dpo" else NextTokenPrediction()
