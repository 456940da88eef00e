"""A rollout worker of an RL run (``python -m pipeline_assets.trainer.rl ... --worker N``).

Before each batch it loads the newest published policy version (``--lag`` versions behind it, to
test the staleness limit), samples ``group_size`` completions for each of ``prompts_per_update``
training prompts of rl/prompt_bank, rewards each with the prompt's verifier, and appends the batch
to rl/replay_buffer as ``pending`` rows with the version that generated them and each token's
behaviour log-probability. It keeps at most one update's worth of groups pending, so it never runs
far ahead of the learner, and stops when the learner marks the run done. A worker killed mid-batch
loses only its unwritten batch: appends are one commit.

With ``off_policy_steps`` k >= 0 it follows a schedule instead: the batch update u will take is
sampled with version max(0, u - k), waiting for it to be published, and drawn from a random state
seeded by (seed, worker, u). With one worker the learner then sees the same batches whatever the
timing (the run is reproducible); with k = 1 sampling still overlaps the learner's update.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from datetime import datetime, timezone

import polars as pl
import torch

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.encoder import ChatEncoder, EncoderSpec, chat_encoder
from pipeline_assets.lib.rl.replay import PENDING
from pipeline_assets.lib.rl.tasks import TRAIN
from pipeline_assets.lib.rl.verifiers import Verdict, verify
from pipeline_assets.trainer.config import RlConfig
from pipeline_assets.trainer.policy_store import PolicyStore, VersionPruned
from pipeline_assets.trainer.replay_io import ReplayTable
from pipeline_assets.trainer.sampling import sample_completions

log = logging.getLogger("pipeline_assets.trainer.rollout")
_POLL_SECONDS = 0.2
_AHEAD_UPDATES = (
    1  # pending groups a worker leaves in the buffer before it waits, in updates' worth: one
)
# update ahead keeps the learner busy; two doubled the lag (and cost reward, measured on the sort
# task)


def read_prompt_bank(lake_uri: str) -> pl.DataFrame:
    """rl/prompt_bank, on a local lake or S3."""
    return pl.read_delta(
        uris.join(lake_uri, "rl", "prompt_bank"),
        storage_options=uris.delta_storage_options(lake_uri),
    )


class Prompts:
    """The bank's prompts of one split (of ``tasks``, comma-separated; empty: all), each encoded as
    the policy reads it."""

    def __init__(self, lake_uri: str, split: str, encoder: ChatEncoder, tasks: str = ""):
        bank = read_prompt_bank(lake_uri)
        self.rows = bank.filter((pl.col("status") == "in_bank") & (pl.col("split") == split)).sort(
            "prompt_id"
        )
        if tasks:
            self.rows = self.rows.filter(pl.col("task").is_in(tasks.split(",")))
        if self.rows.is_empty():
            raise RuntimeError(
                f"rl/prompt_bank holds no {split} prompt{' of ' + tasks if tasks else ''}: "
                "materialize it first"
            )
        self.token_ids = encoder.encode_prompts(self.rows["prompt"].to_list())

    def __len__(self) -> int:
        return self.rows.height


def policy_encoder(config: RlConfig) -> ChatEncoder:
    """The policy's encoder: its tokenizer.json and, for a base model's policy, its chat template
    (as gold encoded the data it was trained on)."""
    return chat_encoder(EncoderSpec.from_files(config.tokenizer_path, config.chat_template_path))


def completion_text(encoder: ChatEncoder, token_ids: list[int]) -> str:
    """A completion's tokens decoded, special tokens left out."""
    return encoder.decode(token_ids).strip()


def judge(encoder: ChatEncoder, prompt: dict, token_ids: list[int], stop_ids: frozenset[int]):
    """The verifier's verdict on a completion; one that never ends its answer (no stop token) is
    wrong."""
    if not token_ids or token_ids[-1] not in stop_ids:
        return Verdict(0.0, "the answer never ended within max_new_tokens")
    return verify(prompt["verifier"], prompt["ground_truth"], completion_text(encoder, token_ids))


class RolloutWorker:
    def __init__(self, config: RlConfig):
        self.config, self.name = config, f"worker-{config.worker}"
        self.policies = PolicyStore(config.checkpoint_uri, config.partition, config.scratch_dir)
        self.table = ReplayTable(config.lake_uri)
        self.encoder = policy_encoder(config)
        self.prompts = Prompts(config.lake_uri, TRAIN, self.encoder, config.tasks)
        self.stop_ids = self.encoder.stop_ids
        self._seed_draws(f"{config.seed}:{config.worker}:{uuid.uuid4()}")  # a restart draws anew
        self.model, self.loaded = None, None

    def _seed_draws(self, seed: str) -> None:
        """The prompts' and the samples' random state."""
        self.choice = random.Random(seed)
        self.generator = torch.Generator().manual_seed(self.choice.randrange(2**62))

    def run(self) -> int:
        batches = 0
        while not self.policies.done():
            if self.roll_once(batches):
                batches += 1
            else:
                time.sleep(_POLL_SECONDS)
        log.info(f"{self.name}: the run is done after {batches} batch(es)")
        return 0

    def roll_once(self, number: int) -> bool:
        """Append batch ``number`` with the newest policy (less the lag), or with the version the
        schedule (``off_policy_steps``) gives the next update; False when there is none to use
        yet, the learner has enough pending, or the learner pruned the version meanwhile."""
        if self._far_ahead():
            return False
        version = self._policy_version() if self.config.off_policy_steps < 0 else self._scheduled()
        if version is None:
            return False
        try:
            self._load(version)
        except VersionPruned:
            log.info(f"policy v{version} was pruned before {self.name} loaded it: reading again")
            return False
        self.table.append(self._batch(version, number))
        return True

    def _policy_version(self) -> int | None:
        newest = self.policies.newest()
        return None if newest is None else max(0, newest - self.config.lag)

    def _scheduled(self) -> int | None:
        """The version the next update's batch is sampled with, once published, its draws seeded
        by that update: a restarted worker redraws the batch its predecessor did not write."""
        update = self.table.updates_taken(self.config.partition)
        version = max(0, update - self.config.off_policy_steps)
        newest = self.policies.newest()
        if newest is None or version > newest:
            return None
        self._seed_draws(f"{self.config.seed}:{self.config.worker}:{update}")
        return version

    def _far_ahead(self) -> bool:
        return (
            self.table.pending_groups(self.config.partition)
            >= _AHEAD_UPDATES * self.config.prompts_per_update
        )

    def _load(self, version: int) -> None:
        if version != self.loaded:
            self.model, _, _ = self.policies.load(version, reader=self.name)
            self.model.eval()
            self.loaded = version

    def _batch(self, version: int, number: int) -> pl.DataFrame:
        chosen = self.choice.sample(range(len(self.prompts)), self.config.prompts_per_update)
        prompt_ids = [self.prompts.token_ids[index] for index in chosen]
        completions = sample_completions(
            self.model,
            prompt_ids,
            self.config.group_size,
            self.config.max_new_tokens,
            self.stop_ids,
            generator=self.generator,
            pad_id=self.encoder.pad_id,
        )
        now = datetime.now(timezone.utc)
        batch_id = f"{self.name}-{uuid.uuid4().hex[:12]}"
        rows = []
        for row, completion in enumerate(completions):
            prompt = self.prompts.rows.row(chosen[completion.prompt_index], named=True)
            text = completion_text(self.encoder, completion.token_ids)
            verdict = judge(self.encoder, prompt, completion.token_ids, self.stop_ids)
            rows.append(
                {
                    "rollout_id": f"{batch_id}-{row}",
                    "run": self.config.partition,
                    "group_id": f"{batch_id}-g{completion.prompt_index}",
                    "prompt_id": prompt["prompt_id"],
                    "policy_version": version,
                    "generated_at": now,
                    "worker": self.name,
                    "prompt_token_ids": prompt_ids[completion.prompt_index],
                    "completion_token_ids": completion.token_ids,
                    "behaviour_logps": completion.logps,
                    "completion": text,
                    "reward": verdict.reward,
                    "verifier_detail": verdict.detail,
                    "status": PENDING,
                    "consumed_by_version": None,
                    "updated_at": now,
                }
            )
        log.info(
            f"{self.name}: batch {number} with policy v{version}: mean reward "
            f"{sum(r['reward'] for r in rows) / len(rows):.3f}"
        )
        return pl.DataFrame(rows, schema_overrides={"consumed_by_version": pl.Int64})


def run(config: RlConfig) -> int:
    torch.set_num_threads(1)
    return RolloutWorker(config).run()
