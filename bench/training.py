"""Trainer: tokens/s of real torchrun jobs and the time a checkpoint save blocks training.

On CPU (the default, what ``make bench`` runs):

* tokens/s of the ``tiny`` and ``small`` presets on 2 ranks (1 thread each) beside 1 rank (2
  threads), at the same global batch, so both use the machine's 2 cores: what data parallelism
  (FSDP's all-gathers and reduce-scatters over gloo) costs or gains against intra-op threading;
* the seconds an asynchronous checkpoint save blocks training beside a synchronous one, on 2 ranks:
  the reason ``--async-checkpoint`` is the default. This is the primary ratio (async / sync, < 1).

The GPU measurement (tokens/s and MFU of the ``base`` preset in bf16) is ``bench/training_gpu.py``:
it needs nothing but torch, so it runs on a bare GPU machine.

Every job trains on a synthetic gold snapshot of vocabulary 8192 (the tokenizer's size), so the
embedding and output layers cost what they cost in a real run; tokens/s is the trainer's own
number, the median of its log lines after the first (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from pipeline_assets.contracts import GoldSequence, conform, validate
from pipeline_assets.defs.gold.manifest import cut_manifest
from pipeline_assets.lib.gold.sequences import build_sequences
from pipeline_assets.lib.training.torchrun import torchrun_command, torchrun_env
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.trainer.config import TrainConfig

VOCAB = 8192
PAD_ID = 0
CORES = 2  # the CPU benchmark's budget, whatever the machine has: 1 rank x 2 threads or 2 ranks x 1
SEQ_LEN = 256
MICRO_BATCH = 4
GLOBAL_BATCH = 8
THROUGHPUT_STEPS = {"tiny": (16, 4), "small": (8, 2)}  # preset: (steps, log_every)
LAYOUT_ORDER = (
    1,
    2,
    2,
    1,
)  # ranks of each throughput job: drift in the machine's other load hits both alike
CHECKPOINT_STEPS, CHECKPOINT_EVERY = 15, 5  # saves at 5 and 10 measured; 15 is the final one
JOB_TIMEOUT_S = 300


_SPEED = re.compile(r"step (\d+)/\d+: loss .*?, ([\d,.]+) tokens/s(?:, MFU ([\d.]+)%)?")
_BLOCKED = re.compile(
    r"step (\d+): (asynchronous|synchronous) checkpoint save blocked training for ([\d.]+)\s*s"
)


# --- the data ---------------------------------------------------------------------------------
def counting_documents(n_records: int, max_len: int, seed: int) -> pl.DataFrame:
    """Documents that count upwards from a random start (as the trainer tests' are), over VOCAB ids;
    a third of each is prompt (no loss), every tenth document is validation."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max_len // 8, max_len, n_records)
    starts = rng.integers(1, VOCAB, n_records)
    ids = [
        ((start + np.arange(length)) % (VOCAB - 1) + 1).tolist()
        for start, length in zip(starts, lengths, strict=True)
    ]
    masks = [
        [False] * (length // 3) + [True] * (length - length // 3) for length in lengths.tolist()
    ]
    return pl.DataFrame(
        {
            "record_id": [f"r{number:06d}" for number in range(n_records)],
            "split": ["validation" if number % 10 == 0 else "train" for number in range(n_records)],
            "input_ids": ids,
            "loss_mask": masks,
            "n_tokens": lengths.astype(np.int64),
        },
        schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Boolean)},
    )


def write_gold(lake_uri: str, n_records: int, seq_len: int, seed: int = 0) -> int:
    """One gold shard packed from counting documents up to seq_len tokens, and a snapshot of it;
    returns the snapshot's number."""
    number, _ = write_snapshot_of(
        lake_uri, counting_documents(n_records, seq_len, seed), seq_len, seed
    )
    return number


def write_snapshot_of(
    lake_uri: str, documents: pl.DataFrame, seq_len: int, seed: int = 0
) -> tuple[int, pl.DataFrame]:
    """``documents`` (record_id, split, input_ids, loss_mask, n_tokens) packed as gold packs them
    into one shard, and a snapshot of it: (the snapshot's number, the packed rows)."""
    sequences, _ = build_sequences(documents, seq_len=seq_len, seed=seed, pad_id=PAD_ID)
    sequences = sequences.with_columns(
        batch_id=pl.lit("bench"), tokenizer_version=pl.lit(0, pl.Int64)
    )
    lake = LakeResource(uri=lake_uri)
    lake.replace_partition(
        "gold",
        "sequences",
        validate(conform(sequences, GoldSequence), GoldSequence),
        column="batch_id",
        value="bench",
    )
    manifest = cut_manifest(lake, ["bench"], tokenizer_version=0, seq_len=seq_len, reason="bench")
    return manifest[0].number, sequences


# --- the jobs ---------------------------------------------------------------------------------
class Workspace:
    """A lake with one gold snapshot, and a fresh checkpoint folder for every job (none resumes)."""

    def __init__(self, root: Path, n_records: int, seq_len: int):
        self.root = root
        self.lake_uri = str(root / "lake")
        self.snapshot = write_gold(self.lake_uri, n_records, seq_len)
        self._jobs = 0

    def train(self, nproc: int, threads_per_rank: int, **overrides) -> str:
        """Run one torchrun job to its end; returns rank 0's log."""
        self._jobs += 1
        name = f"job{self._jobs}"
        values = dict(
            vocab_size=VOCAB,
            warmup_steps=5,
            eval_max_sequences=8,
            scratch_dir=str(self.root / "scratch" / name),
        )
        values.update(overrides)
        values.setdefault("eval_every", values["steps"])
        values.setdefault("checkpoint_every_steps", values["steps"] + 1)  # only the final save
        config = TrainConfig(
            lake_uri=self.lake_uri,
            snapshot=self.snapshot,
            checkpoint_uri=str(self.root / name),
            partition="bench",
            **values,
        )
        return run_torchrun(nproc, threads_per_rank, config.to_args())


def run_torchrun(nproc: int, threads_per_rank: int, args: list[str]) -> str:
    env = {**os.environ, **torchrun_env(threads_per_rank)}
    env.pop("MLFLOW_TRACKING_URI", None)
    process = subprocess.Popen(
        torchrun_command(nproc, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: the session it started
        output, _ = process.communicate()
        raise RuntimeError(f"torchrun ran past {JOB_TIMEOUT_S}s:\n{output[-4000:]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"torchrun exited {process.returncode}:\n{output[-4000:]}")
    return output


# --- reading the logs -------------------------------------------------------------------------
def speeds(log: str) -> list[tuple[float, float | None]]:
    """(tokens/s, MFU or None) of every step line after the first (warm-up)."""
    lines = [
        (float(m[2].replace(",", "")), float(m[3]) / 100 if m[3] else None)
        for m in _SPEED.finditer(log)
    ]
    if len(lines) < 2:
        raise ValueError(f"fewer than 2 step lines with tokens/s in the log:\n{log[-4000:]}")
    return lines[1:]


def median_tokens_per_second(log: str) -> float:
    return statistics.median(tokens for tokens, _ in speeds(log))


def blocking_seconds(log: str, steps: int) -> list[float]:
    """The blocking time of each save before the last step (the final save is always
    synchronous)."""
    found = [float(m[3]) for m in _BLOCKED.finditer(log) if int(m[1]) < steps]
    if not found:
        raise ValueError(f"no checkpoint save before step {steps} in the log:\n{log[-4000:]}")
    return found


# --- CPU --------------------------------------------------------------------------------------
def cpu_job(workspace: Workspace, nproc: int, **overrides) -> str:
    """A job on the CPU budget: CORES threads in all, the same global batch whatever the ranks."""
    return workspace.train(
        nproc,
        CORES // nproc,
        micro_batch_size=MICRO_BATCH,
        grad_accum_steps=GLOBAL_BATCH // (MICRO_BATCH * nproc),
        **overrides,
    )


def tokens_per_second(workspace: Workspace, preset: str, nproc: int) -> float:
    steps, log_every = THROUGHPUT_STEPS[preset]
    return median_tokens_per_second(
        cpu_job(workspace, nproc, preset=preset, steps=steps, log_every=log_every)
    )


def best_tokens_per_second(workspace: Workspace, preset: str) -> dict:
    """The best of each layout's jobs: the least disturbed by whatever else the machine does."""
    runs: dict[int, list[float]] = {1: [], 2: []}
    for nproc in LAYOUT_ORDER:
        runs[nproc].append(tokens_per_second(workspace, preset, nproc))
    return {"1_rank": max(runs[1]), "2_ranks": max(runs[2])}


def checkpoint_blocking(workspace: Workspace, asynchronous: bool) -> float:
    log = cpu_job(
        workspace,
        2,
        preset="small",
        steps=CHECKPOINT_STEPS,
        log_every=CHECKPOINT_STEPS,
        checkpoint_every_steps=CHECKPOINT_EVERY,
        async_checkpoint=asynchronous,
    )
    return statistics.median(blocking_seconds(log, CHECKPOINT_STEPS))


def run() -> dict:
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Workspace(Path(tmp), n_records=600, seq_len=SEQ_LEN)
        speed = {preset: best_tokens_per_second(workspace, preset) for preset in THROUGHPUT_STEPS}
        blocked = {
            "async": checkpoint_blocking(workspace, True),
            "sync": checkpoint_blocking(workspace, False),
        }
    scaling = {preset: s["2_ranks"] / s["1_rank"] for preset, s in speed.items()}
    ratio = blocked["async"] / blocked["sync"]
    return {
        "device": "cpu",
        "cores": CORES,
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB,
        "global_batch": GLOBAL_BATCH,
        "jobs_per_layout": LAYOUT_ORDER.count(1),
        "measured": "; ".join(f"{p} 2 ranks: {s['2_ranks']:,.0f} tok/s" for p, s in speed.items())
        + f"; async save blocks {blocked['async']:.3f}s",
        "baseline": "; ".join(f"{p} 1 rank: {s['1_rank']:,.0f} tok/s" for p, s in speed.items())
        + f"; sync save blocks {blocked['sync']:.3f}s",
        "ratio": ratio,
        "ratio_is": "median blocking seconds of an asynchronous checkpoint save / a synchronous "
        "one (small, 2 ranks)",
        "tokens_per_second": {p: {k: round(v) for k, v in s.items()} for p, s in speed.items()},
        "scaling_2_over_1": {p: round(v, 3) for p, v in scaling.items()},
        "checkpoint_blocking_seconds": {k: round(v, 4) for k, v in blocked.items()},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_1m": {
            "before": round(load, 2),
            "after": round(os.getloadavg()[0], 2),
        },  # others' work skews it
        "target": "async save blocks training less than a sync save (ratio < 1.0)",
        "target_met": ratio < 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="folder for training.json (else printed only)")
    args = parser.parse_args(argv)
    name = "training"
    result = {"benchmark": name, **run()}
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
