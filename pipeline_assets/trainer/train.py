"""The training program: ``torchrun --nproc-per-node N -m pipeline_assets.trainer --lake-uri ... ``.

``--objective sft`` (the default) trains next-token prediction on gold-v<N>; ``--objective dpo``
trains DPO on the preference pairs of dpo-v<N>, starting from ``--init-from`` (the SFT champion)
against the reference log-probabilities of gold/reference_logps at ``--reference-logps-version``.
One Trainer runs both: what differs is a ``trainer.objective.Objective``.

Exit codes: 0 trained to the last step; 143 stopped by SIGTERM or SIGINT after saving a checkpoint
(run the same command again to resume); 1 failed, with the reason in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from pipeline_assets.lib.ops.charts import loss_curve_png
from pipeline_assets.lib.uris import redact
from pipeline_assets.trainer.checkpoint import Checkpointer
from pipeline_assets.trainer.config import (
    EXIT_PREEMPTED,
    PRESETS,
    TrainConfig,
    architecture_flags,
    parse_args,
)
from pipeline_assets.trainer.data import (
    largest_token_id,
    rank_micro_batches,
    stream_indexes,
    validation_shard,
)
from pipeline_assets.trainer.export import (
    exported_config,
    load_weights,
    save_exported,
    save_hf_exported,
)
from pipeline_assets.trainer.hf_model import (
    BACKEND,
    FLASH,
    FLEX,
    SDPA,
    attention_implementation,
    base_model_facts,
    build_sharded,
    hf_starting_folder,
    parameter_counts,
    read_config,
)
from pipeline_assets.trainer.hf_model import flops_per_token as hf_flops_per_token
from pipeline_assets.trainer.metrics import Throughput, peak_flops
from pipeline_assets.trainer.model import Transformer, count_parameters, flops_per_token
from pipeline_assets.trainer.objective import build_objective
from pipeline_assets.trainer.parallel import (
    Distributed,
    attention_kernel,
    init_distributed,
    mixed_precision_policy,
    shard_model,
)
from pipeline_assets.trainer.report import Reporter
from pipeline_assets.trainer.storage import CheckpointStore, describe_files

log = logging.getLogger("pipeline_assets.trainer")
ATTENTION_DESCRIPTIONS = {
    "flex": "flex, FlexAttention with a document block mask (torch.compile'd on first use)",
    "dense": "dense, scaled_dot_product_attention with a (batch, 1, T, T) document mask",
    # the Hugging Face backend: transformers' kernels, each told the documents by position_ids
    SDPA: "sdpa, transformers' scaled_dot_product_attention with a document mask built from "
    "position_ids",
    FLEX: "flex_attention, transformers' FlexAttention with a document block mask built from "
    "position_ids",
    FLASH: "flash_attention_2, flash-attn's variable-length kernel over the documents that "
    "position_ids mark",
}
LOSS_CURVE = "loss_curve.png"


@dataclass
class Progress:
    """What, beyond model and optimizer, a checkpoint must hold to continue exactly."""

    step: int = 0
    position: int = 0  # training sequences consumed: the loader's place in its stream
    best_validation_loss: float = (
        math.inf
    )  # on the config's eval_split (the name predates the search split)
    history: list = field(default_factory=list)


class StopSignal:
    """Set by SIGTERM (preemption) or SIGINT (Dagster's run termination, Ctrl-C); acted on at the
    next step boundary, once every rank has agreed."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.received = True


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    env = init_distributed(config.device)
    _configure_logging(env.rank)
    reporter = Reporter(config.mlflow_run_id, config.mlflow_experiment) if env.rank == 0 else None
    try:
        code, metadata = Trainer(config, env, reporter).run()
    except Exception as exc:
        log.error(
            redact(
                f"training failed on rank {env.rank}: {type(exc).__name__}: "
                f"{exc}\n{traceback.format_exc()}"
            )
        )
        if reporter:
            reporter.finish({}, succeeded=False)
        return 1
    if reporter:
        reporter.finish(metadata, succeeded=code == 0)
    dist.destroy_process_group()
    return code


class Trainer:
    def __init__(self, config: TrainConfig, env: Distributed, reporter: Reporter | None):
        self.config, self.env, self.reporter = config, env, reporter
        self.objective = build_objective(config)
        self.hf_folder = hf_starting_folder(config.base_model, config.init_from)
        self.hf_config = read_config(self.hf_folder) if self.hf_folder else None
        vocab_size = self.hf_config.vocab_size if self.hf_config else config.vocab_size
        self.snapshot = self.objective.read_snapshot(
            dataclasses.replace(config, vocab_size=vocab_size)
        )
        if config.eval_split == "search" and self.eval_sequences == 0:
            raise ValueError(
                f"{self.snapshot.manifest.key} has fewer search sequences "
                f"({len(self.snapshot.search)}) than ranks ({env.world_size}): raise "
                "PIPELINE_SEARCH_FRACTION and cut a new snapshot"
            )
        torch.manual_seed(config.seed)  # the same initial weights on every rank and world size
        policy = mixed_precision_policy(config.mixed_precision, env.device)
        if self.hf_config:
            self._build_hf_model(policy)
        else:
            self._build_builtin_model(policy)
        self.optimizer = _adamw(self.model, config, fused=env.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup_cosine(config))
        self.store = CheckpointStore(config.checkpoint_uri, config.partition, config.scratch_dir)
        self.checkpointer = Checkpointer(
            self.store, env.checkpoint_group, keep=config.keep_checkpoints
        )
        self.progress = Progress()
        self.global_batch = config.global_batch(env.world_size)
        self.stop = StopSignal()

    def _build_builtin_model(self, policy: MixedPrecisionPolicy) -> None:
        config = self.config
        self.model_config = dataclasses.replace(
            PRESETS[config.preset],
            vocab_size=config.vocab_size,
            max_seq_len=self.snapshot.seq_len,
            dim=config.width or PRESETS[config.preset].dim,
        )
        head_dim = self.model_config.dim // self.model_config.n_heads
        self.attention_kernel = attention_kernel(config.attention, self.env.device, head_dim)
        model = Transformer(self.model_config, self.attention_kernel).to(self.env.device)
        if config.init_from:
            _load_initial_weights(model, config.init_from)
        self.n_parameters = count_parameters(model)
        self.model = shard_model(model, policy)
        self.flops_per_token = flops_per_token(self.model_config, self.snapshot.seq_len)
        self.model_name = config.preset
        self.model_facts = dataclasses.asdict(self.model_config)

    def _build_hf_model(self, policy: MixedPrecisionPolicy) -> None:
        """The base model (or a Hugging Face ``init_from``), its weights read into FSDP2 shards."""
        self._check_vocabulary()
        config, device = self.hf_config, self.env.device
        self.attention_kernel = attention_implementation(self.config.attention, device, config)
        self.model = build_sharded(self.hf_folder, config, self.attention_kernel, device, policy)
        self.n_parameters, _ = parameter_counts(self.model)
        self.flops_per_token = hf_flops_per_token(self.model, self.snapshot.seq_len)
        self.model_name = f"{config.architectures[0]} ({self.hf_folder})"
        self.model_facts = {
            "backend": BACKEND,
            "folder": self.hf_folder,
            "architecture": config.architectures[0],
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
        }

    def _check_vocabulary(self) -> None:
        """Refuse, before training, a snapshot with token ids the model has no embedding row for
        (a snapshot encoded with another tokenizer than the base model's)."""
        rows = self.hf_config.vocab_size
        largest = largest_token_id(self.config.lake_uri, self.snapshot.manifest)
        if largest >= rows:
            raise ValueError(
                f"{self.snapshot.manifest.key} holds token id {largest}, but the model of "
                f"{self.hf_folder} has {rows} embedding rows (config.json vocab_size): the "
                "snapshot was not encoded with this model's tokenizer"
            )

    # --- the run --------------------------------------------------------------------------------
    def run(self) -> tuple[int, dict]:
        self._resume()
        self._announce()
        throughput = Throughput(
            tokens_per_step=self.global_batch * self.snapshot.seq_len,
            flops_per_token=self.flops_per_token,
            peak_flops=peak_flops(self.env.device) * self.env.world_size,
        )
        last_save = time.monotonic()
        while self.progress.step < self.config.steps:
            stop, time_due = self._vote(
                self.stop.received,
                time.monotonic() - last_save > self.config.checkpoint_every_minutes * 60,
            )
            if stop:
                return self._stop_for_signal(), {}
            metrics, grad_norm = self._train_step()
            throughput.add_step()
            step = self.progress.step
            if step % self.config.log_every == 0 or step == self.config.steps:
                self._log_step(metrics, grad_norm, throughput.take())
            held_out_loss = None
            if step % self.config.eval_every == 0 or step == self.config.steps:
                held_out_loss = self._validate()
                throughput.restart()
            if (
                step % self.config.checkpoint_every_steps == 0
                or time_due
                or step == self.config.steps
            ):
                self._save(held_out_loss, final=step == self.config.steps)
                last_save = time.monotonic()
                throughput.restart()
        self.checkpointer.finish()
        return 0, self._finish()

    def _train_step(self) -> tuple[dict[str, float], float]:
        config, env = self.config, self.env
        micro_batches = [
            self.snapshot.train.batch(indexes, env.device)
            for indexes in rank_micro_batches(
                len(self.snapshot.train),
                config.seed,
                self.progress.position,
                env.rank,
                env.world_size,
                config.micro_batch_size,
                config.grad_accum_steps,
            )
        ]
        metrics = self.accumulate_gradients(micro_batches)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.position += self.global_batch
        return metrics, grad_norm.item()

    def backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """Gradients of the global batch's mean loss; returns that loss."""
        return self.accumulate_gradients(micro_batches)["loss"]

    def accumulate_gradients(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """Gradients of the global batch's mean loss (per loss token for SFT, per pair for DPO);
        returns that loss and the objective's other metrics, means over the global batch.

        Each rank normalises by the units of the whole global batch (one all_reduce of the ranks'
        counts), so every unit weighs the same whichever rank or micro-batch holds it; FSDP's
        gradient average divides by world size."""
        units = torch.stack([self.objective.units(batch) for batch in micro_batches]).sum()
        dist.all_reduce(units)
        sums: dict[str, torch.Tensor] = {}
        for number, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(number == len(micro_batches) - 1)
            losses = self.model(batch["input_ids"], batch["position_ids"], next_token_losses=True)
            loss, batch_sums = self.objective.loss(losses, batch, units, self.env.world_size)
            loss.backward()
            _add(sums, batch_sums)
        return self._global_means(sums, units)

    def _global_means(self, sums: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, float]:
        """This rank's sums, summed over the ranks, divided by the global units (already
        all-reduced)."""
        totals = torch.stack(list(sums.values()))
        dist.all_reduce(totals)
        return dict(zip(sums, (totals / units.clamp(min=1)).tolist()))

    @torch.no_grad()
    def _validate(self) -> float | None:
        """The objective's held-out metrics over the split ``eval_split`` (the same sequences every
        time); returns the held-out loss."""
        split, held_out = self.config.eval_split, self.snapshot.held_out(self.config.eval_split)
        usable = self.eval_sequences
        if usable == 0:
            return None
        mine = validation_shard(len(held_out), usable, self.env.rank, self.env.world_size)
        units = torch.zeros((), dtype=torch.long, device=self.env.device)
        sums: dict[str, torch.Tensor] = {}
        self.model.eval()
        for start in range(0, len(mine), self.config.micro_batch_size):
            batch = held_out.batch(
                mine[start : start + self.config.micro_batch_size], self.env.device
            )
            batch_units = self.objective.units(batch)
            losses = self.model(batch["input_ids"], batch["position_ids"], next_token_losses=True)
            _, batch_sums = self.objective.loss(losses, batch, batch_units, 1)
            units += batch_units
            _add(sums, batch_sums)
        self.model.train()
        dist.all_reduce(units)
        metrics = self.objective.evaluation(self._global_means(sums, units), split)
        self._report_metrics(metrics)
        loss = metrics[f"{split}_loss"]
        others = "".join(
            f", {name} {value:.4f}" for name, value in metrics.items() if name != f"{split}_loss"
        )
        self._info(
            f"step {self.progress.step}: {split} loss {loss:.4f}{others} over {usable} sequences"
        )
        return loss

    @property
    def eval_sequences(self) -> int:
        """How many held-out sequences each evaluation scores: a whole number per rank."""
        held_out = len(self.snapshot.held_out(self.config.eval_split))
        return (
            min(held_out, self.config.eval_max_sequences)
            // self.env.world_size
            * self.env.world_size
        )

    # --- checkpoints ----------------------------------------------------------------------------
    def _state(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),  # not tensors: the checkpoint's JSON part
            "progress": dataclasses.asdict(self.progress),
            f"rng/rank{self.env.rank}": torch.get_rng_state(),
        }

    def _save(self, validation_loss: float | None, final: bool = False) -> None:
        if validation_loss is not None and validation_loss < self.progress.best_validation_loss:
            self.progress.best_validation_loss = validation_loss
        extra = {"validation_loss": validation_loss} if validation_loss is not None else {}
        asynchronous = self.config.async_checkpoint and not final
        blocked = self.checkpointer.save(
            self.progress.step, self._state(), extra, asynchronous=asynchronous
        )
        self._report_metrics({"checkpoint_blocking_seconds": blocked})
        mode = "asynchronous" if asynchronous else "synchronous"
        self._info(
            f"step {self.progress.step}: {mode} checkpoint save blocked training for {blocked:.3f}s"
        )

    def _resume(self) -> None:
        state = self._state()
        step = self.checkpointer.load_newest(state)
        if step is None:
            self._info(f"no checkpoint under {self.store.uri}: starting from step 0")
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = Progress(**state["progress"])
        torch.set_rng_state(state[f"rng/rank{self.env.rank}"])
        self._info(
            f"resumed from {self.store.folder_uri(f'step-{step}')}: step {step}, "
            f"{self.progress.position} sequences consumed"
        )

    def _stop_for_signal(self) -> int:
        """Every rank saw the vote: save this step synchronously, then exit for a later resume."""
        if self.checkpointer.saved_step != self.progress.step:
            self.checkpointer.save(self.progress.step, self._state(), {}, asynchronous=False)
        self.checkpointer.finish()  # publishes this step's save if it was still in flight
        self._warning(
            f"stopped by a signal at step {self.progress.step}; checkpoint "
            f"step-{self.progress.step} is saved: run the same command again to resume"
        )
        return EXIT_PREEMPTED

    def _vote(self, *flags: bool) -> list[bool]:
        """Whether any rank raised each flag: every rank gets the same answer at the same step."""
        votes = torch.tensor([float(flag) for flag in flags], device=self.env.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return [bool(vote) for vote in votes.tolist()]

    # --- the end --------------------------------------------------------------------------------
    def _finish(self) -> dict:
        """Export the consolidated model and say what was produced."""
        full_state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        export_uri = self.store.folder_uri("final")
        metadata = {}
        if self.env.rank == 0:
            folder = self.store.prepare("final")
            about = {
                "snapshot": self.config.snapshot,
                "partition": self.config.partition,
                "steps": self.progress.step,
                "objective": self.config.objective,
                **self.snapshot.about(),
                "eval_split": self.config.eval_split,
                "eval_sequences": self.eval_sequences,
                **self._last_evaluation(),
                f"{self.config.eval_split}_loss": _finite(self.progress.best_validation_loss),
            }
            files = self._export(full_state, folder, about)
            metadata = self._summary(export_uri, folder)
            files += [LOSS_CURVE] if (folder / LOSS_CURVE).exists() else []
            self.store.upload("final", files)
            self.store.publish("final", {"files": describe_files(folder, files), **about})
        dist.barrier(group=self.env.checkpoint_group)
        return metadata

    def _export(self, full_state: dict, folder: Path, about: dict) -> list[str]:
        if not self.hf_config:
            return save_exported(full_state, self.model_config, folder, about)
        return save_hf_exported(
            {name.removeprefix("lm."): tensor for name, tensor in full_state.items()},
            self.hf_config,
            folder,
            {
                **about,
                "backend": BACKEND,
                "attention_implementation": self.attention_kernel,
                **base_model_facts(self.hf_folder, self.hf_config),
            },
            skip=self.model.tied_keys(),
        )

    def _summary(self, export_uri: str, export_folder: Path) -> dict:
        history = self.progress.history
        losses = [row["loss"] for row in history if "loss" in row]
        speeds = [row["tokens_per_second"] for row in history if "tokens_per_second" in row]
        best = self.checkpointer.best()
        summary = {
            "final_loss": losses[-1] if losses else None,
            "first_loss": losses[0] if losses else None,
            "best_validation_loss": _finite(self.progress.best_validation_loss),
            "steps": self.progress.step,
            "tokens_per_second": speeds[-1] if speeds else None,
            "parameters": self.n_parameters,
            "world_size": self.env.world_size,
            "export_uri": export_uri,
            "best_checkpoint_uri": best["uri"] if best else None,
            "checkpoint_uris": self.checkpointer.published,
            "mlflow_run_id": self.reporter.mlflow_run_id if self.reporter else None,
            "first_batch_sha256": self.first_batch_fingerprint,
            "tokens_trained": self.progress.position * self.snapshot.seq_len,
            "gpus": self.env.world_size if self.env.device.type == "cuda" else 0,
            "attention_kernel": self.attention_kernel,
            "objective": self.config.objective,
            **self.snapshot.about(),
            **self._last_evaluation(),
        }
        if self.reporter:
            self.reporter.tags(
                {
                    "export_uri": export_uri,
                    "best_checkpoint_uri": summary["best_checkpoint_uri"],
                    "checkpoint_uris": json.dumps(self.checkpointer.published[-20:]),
                }
            )
            picture = loss_curve_png(
                history,
                export_folder / LOSS_CURVE,
                f"{self.config.partition} · {self.model_name} · {self.env.world_size} rank(s)",
                self.objective.loss_unit,
            )
            if picture:
                self.reporter.artifact(picture)
        return summary

    def _last_evaluation(self) -> dict:
        """The objective's own metrics of the newest held-out evaluation (the loss is reported as
        the best)."""
        loss = f"{self.config.eval_split}_loss"
        newest = next((row for row in reversed(self.progress.history) if loss in row), {})
        return {name: value for name, value in newest.items() if name not in ("step", loss)}

    # --- reporting ------------------------------------------------------------------------------
    def _announce(self) -> None:
        config = self.config
        self._info(
            f"{self.model_name}: {self.n_parameters / 1e6:.2f}M parameters, world size "
            f"{self.env.world_size} ({self.env.backend}, {self.env.device.type}), global batch "
            f"{self.global_batch} x {self.snapshot.seq_len} tokens, {len(self.snapshot.train)} "
            f"training sequences ({self.snapshot.manifest.key}), steps {self.progress.step} -> "
            f"{config.steps}"
        )
        self._info(
            f"attention: {ATTENTION_DESCRIPTIONS[self.attention_kernel]} (--attention "
            f"{config.attention})"
        )
        if self.reporter and self.progress.step == 0:
            self.reporter.params(
                {
                    **dataclasses.asdict(config),
                    "world_size": self.env.world_size,
                    "parameters": self.n_parameters,
                    "global_batch": self.global_batch,
                    "seq_len": self.snapshot.seq_len,
                    "model": self.model_facts,
                }
            )
            self.reporter.tags(
                {
                    "partition": config.partition,
                    **self.snapshot.about(),
                    "torch_version": torch.__version__,
                    "device": _device_name(self.env.device),
                    "backend": self.env.backend,
                    "attention_kernel": self.attention_kernel,
                }
            )
            for uri, version, name in self.snapshot.inputs(config.lake_uri):
                self.reporter.dataset(uri, version, name)
            self.reporter.tags({"first_batch_sha256": self.first_batch_fingerprint})

    @functools.cached_property
    def first_batch_fingerprint(self) -> str:
        """SHA-256 of the token ids of the first global batch: equal fingerprints, equal data
        order."""
        first = stream_indexes(len(self.snapshot.train), self.config.seed, 0, self.global_batch)
        token_ids = self.snapshot.train.batch(first, torch.device("cpu"))["input_ids"].numpy()
        return hashlib.sha256(
            np.ascontiguousarray(token_ids.astype(np.int32)).tobytes()
        ).hexdigest()

    def _log_step(self, metrics: dict[str, float], grad_norm: float, speed: dict) -> None:
        """``metrics``: the objective's, ``loss`` first."""
        values = {
            **metrics,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            **speed,
        }
        self._report_metrics(values)
        objective = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        mfu = f", MFU {speed['mfu']:.1%}" if "mfu" in speed else ""
        self._info(
            f"step {self.progress.step}/{self.config.steps}: {objective}, lr "
            f"{values['learning_rate']:.2e}, grad norm {grad_norm:.3f}, "
            f"{speed['tokens_per_second']:,.0f} tokens/s{mfu}"
        )

    def _report_metrics(self, values: dict) -> None:
        row = {"step": self.progress.step, **values}
        self.progress.history.append(row)
        if self.reporter:
            self.reporter.metrics(self.progress.step, values)

    def _info(self, message: str) -> None:
        (self.reporter.info if self.reporter else log.info)(message)

    def _warning(self, message: str) -> None:
        (self.reporter.warning if self.reporter else log.warning)(message)


def _load_initial_weights(model: Transformer, folder: str) -> None:
    """Start from an exported model (``init_from``) of the run's architecture; any other is
    refused."""
    exported = exported_config(Path(folder))["model"]
    wanted = {
        **dataclasses.asdict(model.config),
        "max_seq_len": exported["max_seq_len"],
    }  # rotary tables: not weights
    if exported != wanted:
        raise ValueError(
            f"--init-from {folder} holds a model of another architecture ({_shape(exported)}) than "
            f"this run's ({_shape(wanted)}): {_flags_for(exported)}"
        )
    load_weights(model, Path(folder), device=str(next(model.parameters()).device))


def _shape(model: dict) -> str:
    return ", ".join(
        f"{name} {model[name]}"
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_multiple")
    )


def _flags_for(model: dict) -> str:
    try:
        flags = architecture_flags(model)
    except ValueError:
        return "no preset builds it"
    return "run with " + ", ".join(
        f"--{name.replace('_', '-')} {value}" for name, value in flags.items()
    )


def _add(sums: dict[str, torch.Tensor], more: dict[str, torch.Tensor]) -> None:
    for name, value in more.items():
        sums[name] = sums.get(name, 0) + value.double()


def _adamw(model: torch.nn.Module, config: TrainConfig, fused: bool) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms' gains are left alone."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": matrices, "weight_decay": config.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused or None
    )


def _warmup_cosine(config: TrainConfig):
    horizon = config.schedule_steps or config.steps

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, horizon - config.warmup_steps)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * min(progress, 1.0))
        )

    return factor


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _configure_logging(rank: int) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING,
        force=True,
    )
