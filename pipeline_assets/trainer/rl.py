"""The RL overlay's learner: GRPO updates on the completions rollout workers leave in
rl/replay_buffer.

    torchrun --nproc-per-node 1 -m pipeline_assets.trainer.rl --lake-uri ... --partition rl-v0 ...
    python -m pipeline_assets.trainer.rl ... --worker 0        # a rollout worker (trainer.rollout)

The learner publishes the starting model as policy version 0, then per update: waits for
``prompts_per_update`` pending groups, takes them (``lib.rl.replay``: rows more than
``max_staleness`` versions behind are dropped as stale, the rest consumed), computes each
completion's advantage within its group, steps the clipped surrogate against the behaviour
log-probabilities (a row one or two versions old is corrected by its importance ratio), and
publishes version N+1 with its optimizer state. Every ``eval_every`` updates it measures held-out
accuracy by greedy decoding. SIGTERM stops it at the next update boundary with the newest version
published (exit 143); the same command resumes from it. At the end, groups with a right and a wrong
completion land as preference pairs (``<landing>/rl_rollouts/``), the run is marked done and the
workers stop. One learner process: data parallel learners (FSDP2 as the sft trainer) are the next
step (docs/rl.md, "Past one machine").
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import time
from pathlib import Path

import polars as pl
import torch

from pipeline_assets.lib.gold.sequences import pack_records
from pipeline_assets.lib.rl.replay import StalenessPolicy, preference_pairs_from_groups
from pipeline_assets.lib.rl.tasks import HELD_OUT, TRAIN
from pipeline_assets.trainer.config import EXIT_PREEMPTED, RlConfig, parse_dataclass
from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.grpo import (
    group_advantages,
    grpo_loss,
    pack_completions,
    policy_logps,
    zero_spread_groups,
)
from pipeline_assets.trainer.language_model import LanguageModel
from pipeline_assets.trainer.model import counted_loss_sum
from pipeline_assets.trainer.policy_store import METRICS_FILE, PolicyStore
from pipeline_assets.trainer.replay_io import ReplayTable, land_rollout_pairs
from pipeline_assets.trainer.report import Reporter
from pipeline_assets.trainer.rollout import Prompts, judge, policy_encoder, read_prompt_bank
from pipeline_assets.trainer.sampling import greedy_completions

log = logging.getLogger("pipeline_assets.trainer.rl")
_POLL_SECONDS = 0.25
_WARM_START_EVAL_EVERY = (
    5  # sft steps between held-out checks: the warm start stops just past the threshold
)


class Learner:
    def __init__(self, config: RlConfig):
        self.config = config
        self.policies = PolicyStore(config.checkpoint_uri, config.partition, config.scratch_dir)
        self.table = ReplayTable(config.lake_uri)
        self.staleness = StalenessPolicy(config.max_staleness, config.max_pending_seconds)
        self.encoder = policy_encoder(config)
        self.held_out = Prompts(config.lake_uri, HELD_OUT, self.encoder, config.tasks)
        self.stop_ids = self.encoder.stop_ids
        self.stopping = False
        self.reporter = Reporter(config.mlflow_run_id, config.mlflow_experiment)
        self.metrics_path = self.policies.store.local_folder(METRICS_FILE)

    def run(self) -> int:
        torch.manual_seed(self.config.seed)
        signal.signal(signal.SIGTERM, self._stop)
        version, model, optimizer = self._start()
        while version < self.config.updates:
            taken = self._wait_for_rollouts(version)
            if self.stopping:
                return self._stopped(version)
            if taken is None:
                return self._fail(
                    f"no fresh rollouts within {self.config.wait_seconds:g} s at policy v{version}"
                )
            metrics = self._update(model, optimizer, taken, version)
            version += 1
            self.policies.publish(version, model, optimizer, {"partition": self.config.partition})
            self.policies.prune(version, self.config.max_staleness)
            if version % self.config.eval_every == 0 or version == self.config.updates:
                metrics["held_out_accuracy"] = self.held_out_accuracy(model)
            self._report(version, metrics)
            if self.stopping:
                return self._stopped(version)
        return self._finish(version)

    def _stopped(self, version: int) -> int:
        self.reporter.info(
            f"stopped by a signal at policy v{version}: the same command resumes from it"
        )
        return EXIT_PREEMPTED

    # --- start and resume -----------------------------------------------------------------------
    def _start(self):
        newest = self.policies.newest()
        if newest is None:
            model, _ = load_exported(Path(self.config.init_from))
            warm_start = self._warm_start(model)
            optimizer = self._optimizer(model)
            self.policies.clear_done()
            self.policies.publish(
                0, model, None, {"partition": self.config.partition, **warm_start}
            )
            self.reporter.info(f"policy v0 from {self.config.init_from}: {warm_start}")
            return 0, model, optimizer
        model, _, folder = self.policies.load(newest, reader="learner")
        optimizer = self._optimizer(model)
        state = self.policies.optimizer_state(folder)
        if state is not None:
            optimizer.load_state_dict(state)
        self.reporter.info(f"resumed from policy v{newest}")
        return newest, model, optimizer

    def _row_width(self, model: LanguageModel, longest_document: int) -> int:
        """The learner's packed rows: ``pack_len`` tokens, at most the model's longest sequence,
        at least the longest document (sampling kept every one within the model's)."""
        return max(min(self.config.pack_len, model.max_seq_len), longest_document)

    def _optimizer(self, model) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            model.parameters(), lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0
        )

    def _warm_start(self, model) -> dict:
        """A starting policy that cannot do the task (held-out accuracy below
        ``warm_start_accuracy``) is tuned on the bank's training prompts first, until it can, or
        ``warm_start_max_steps`` steps."""
        accuracy = self.held_out_accuracy(model)
        if accuracy >= self.config.warm_start_accuracy:
            return {"warm_start_steps": 0, "warm_start_accuracy": accuracy}
        train = Prompts(self.config.lake_uri, TRAIN, self.encoder, self.config.tasks)
        examples = self.encoder.encode_records(
            train.rows.select(
                record_id="prompt_id",
                system=pl.lit(None, pl.String),
                prompt="prompt",
                response="ground_truth",
            ),
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.config.warm_start_lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        choice = random.Random(self.config.seed)
        step = 0
        for step in range(1, self.config.warm_start_max_steps + 1):
            batch = examples[
                choice.sample(
                    range(examples.height), min(self.config.warm_start_batch, examples.height)
                )
            ]
            width = self._row_width(model, int(batch["n_tokens"].max()))
            packed, _ = pack_records(batch, width, self.encoder.pad_id)  # gold's packer
            input_ids, position_ids = (
                torch.tensor(packed[c].to_list()) for c in ("input_ids", "position_ids")
            )
            model.train()
            loss_sum, count = counted_loss_sum(
                model(input_ids, position_ids, next_token_losses=True),
                torch.tensor(packed["loss_mask"].to_list()),
                position_ids,
            )
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / count).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % _WARM_START_EVAL_EVERY == 0:
                accuracy = self.held_out_accuracy(model)
                if accuracy >= self.config.warm_start_accuracy:
                    break
        self.reporter.info(
            f"warm start: {step} sft step(s) on the bank's training prompts, held-out accuracy "
            f"{accuracy:.3f}"
        )
        return {"warm_start_steps": step, "warm_start_accuracy": accuracy}

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    # --- one update -----------------------------------------------------------------------------
    def _wait_for_rollouts(self, version: int) -> tuple[pl.DataFrame, pl.DataFrame] | None:
        """(consumed, dropped) of the first take holding ``prompts_per_update`` fresh groups; None
        past the wait."""
        deadline, dropped = time.monotonic() + self.config.wait_seconds, []
        while time.monotonic() < deadline and not self.stopping:
            if self.table.pending_groups(self.config.partition) >= self.config.prompts_per_update:
                consumed, stale = self.table.take(
                    self.config.partition,
                    version,
                    self.staleness,
                    max_groups=self.config.prompts_per_update,
                )
                dropped.append(stale)
                if consumed["group_id"].n_unique() >= 1:
                    return consumed, pl.concat(dropped)
            time.sleep(_POLL_SECONDS)
        return None

    def _update(
        self, model, optimizer, taken: tuple[pl.DataFrame, pl.DataFrame], version: int
    ) -> dict:
        consumed, dropped = taken
        consumed = consumed.sort("group_id", "rollout_id")
        rewards = torch.tensor(consumed["reward"].to_list(), dtype=torch.float32)
        groups = torch.tensor(
            (consumed["group_id"].rank("dense") - 1).to_list(), dtype=torch.long
        )  # 0 .. G-1
        advantages = group_advantages(rewards, groups)
        prompts = consumed["prompt_token_ids"].to_list()
        completions = consumed["completion_token_ids"].to_list()
        longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
        rows = pack_completions(
            prompts,
            completions,
            consumed["behaviour_logps"].to_list(),
            advantages,
            self._row_width(model, longest),
            self.encoder.pad_id,
        )
        model.train()
        tokens = rows.loss_mask.sum().clamp(min=1)
        for _ in range(
            self.config.steps_per_update
        ):  # the same batch, its ratio moving away from 1
            new_logps = policy_logps(model, rows.input_ids, rows.loss_mask, rows.position_ids)
            loss_sum, stats = grpo_loss(
                new_logps,
                rows.behaviour_logps,
                rows.advantages,
                rows.loss_mask,
                clip_eps=self.config.clip_eps,
            )
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        lags = version - consumed["policy_version"]
        return {
            "loss": float(loss_sum.detach() / tokens),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "zero_spread_share": zero_spread_groups(rewards, groups) / int(groups.max() + 1),
            "staleness_mean": float(lags.mean()),
            "staleness_max": int(lags.max()),
            "dropped_stale": dropped.height,
            "groups": int(groups.max() + 1),
            "clip_fraction": float(stats["clipped"] / tokens),
            "approx_kl": float(stats["approx_kl"] / tokens),
        }

    # --- evaluation and reports -----------------------------------------------------------------
    def held_out_accuracy(self, model) -> float:
        """The share of held-out prompts whose greedy answer passes the prompt's verifier."""
        count = min(self.config.held_out_prompts, len(self.held_out))
        model.eval()
        answers = greedy_completions(
            model,
            self.held_out.token_ids[:count],
            self.config.max_new_tokens,
            self.stop_ids,
            pad_id=self.encoder.pad_id,
        )
        prompts = self.held_out.rows.head(count).iter_rows(named=True)
        right = [
            judge(self.encoder, prompt, answer, self.stop_ids).reward
            for prompt, answer in zip(prompts, answers, strict=True)
        ]
        return sum(right) / count

    def _report(self, version: int, metrics: dict) -> None:
        shown = ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
        )
        self.reporter.info(f"policy v{version}/{self.config.updates}: {shown}")
        self.reporter.metrics(version, {f"rl/{k}": float(v) for k, v in metrics.items()})
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as out:
            out.write(json.dumps({"policy_version": version, **metrics}) + "\n")

    def _finish(self, version: int) -> int:
        pairs = self._hand_off_pairs()
        self.policies.mark_done({"policy_version": version, "preference_pairs": pairs})
        self.reporter.finish(
            {}, succeeded=True, report=False
        )  # rl/policy reports from the metrics file
        return 0

    def _hand_off_pairs(self) -> int:
        """Groups with a right and a wrong completion, as preference pairs in the landing zone."""
        if not self.config.landing_uri:
            return 0
        rows = self.table.read(self.config.partition).filter(pl.col("status") == "consumed")
        bank = read_prompt_bank(self.config.lake_uri).select("prompt_id", "prompt")
        pairs = preference_pairs_from_groups(rows, bank.unique("prompt_id"))
        written = land_rollout_pairs(
            pairs,
            self.config.landing_uri,
            self.config.partition,
            self.config.scratch_dir or str(self.policies.store.scratch),
        )
        if written is not None:
            self.reporter.info(f"{pairs.height} preference pair(s) from the rollouts: {written}")
        return pairs.height

    def _fail(self, reason: str) -> int:
        self.policies.mark_done({"failed": reason})
        self.reporter.warning(reason)
        self.reporter.finish({}, succeeded=False, report=False)
        return 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = parse_dataclass(RlConfig, argv, "python -m pipeline_assets.trainer.rl")
    if config.worker >= 0:
        from pipeline_assets.trainer.rollout import run

        return run(config)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return Learner(config).run()


if __name__ == "__main__":
    sys.exit(main())
