"""The trainer against TRL's ``SFTTrainer``: tokens/s on the same small Qwen2, the same packed rows.

Both sides train one process with the same threads (``CORES``), fp32 on CPU, sdpa attention, no
activation checkpointing (TRL's default turns it on; the trainer has none), the same micro-batch
and accumulation, and the same rows: gold's packed rows of a synthetic snapshot
(documents of realistic lengths over a 32k vocabulary), given to TRL as pre-tokenized rows with
their document lengths (``seq_lengths``, TRL's padding-free packing format: position ids restart at
each document) and the loss mask as ``completion_mask``. Tokens/s counts real (not padding) tokens
on both sides, over the steps after the first ``WARM_STEPS`` (warm on both sides).

The ratio is the trainer's tokens/s over TRL's: at least 1.0 is the goal (issue 34 §6).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench.training import run_torchrun, speeds, write_snapshot_of
from pipeline_assets.trainer.config import TrainConfig

CORES = 2
VOCAB = 32768
SEQ_LEN = 512
MICRO_BATCH, ACCUMULATION = 2, 2
STEPS, WARM_STEPS = 14, 4
ROUNDS = 2  # each side runs this many times, alternating: the best run, the least disturbed
QWEN2 = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ_LEN,
    tie_word_embeddings=False,
    vocab_size=VOCAB,
)


def qwen2_folder(folder: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2)).save_pretrained(folder)
    return folder


def documents(n_records: int, seed: int = 0) -> pl.DataFrame:
    """Chat-record-like documents: lengths log-normal around 180 tokens (cut to SEQ_LEN), the
    first third a prompt without loss."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(180), 0.6, n_records).astype(int), 16, SEQ_LEN)
    ids = [rng.integers(1, VOCAB, length).tolist() for length in lengths]
    masks = [[False] * (n // 3) + [True] * (n - n // 3) for n in lengths.tolist()]
    return pl.DataFrame(
        {
            "record_id": [f"r{number:06d}" for number in range(n_records)],
            "split": ["validation" if number % 20 == 0 else "train" for number in range(n_records)],
            "input_ids": ids,
            "loss_mask": masks,
            "n_tokens": lengths.astype(np.int64),
        },
        schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Boolean)},
    )


def write_snapshot(lake_uri: str, n_records: int) -> tuple[int, pl.DataFrame]:
    """The snapshot both sides train on, and its training rows."""
    number, sequences = write_snapshot_of(lake_uri, documents(n_records), SEQ_LEN)
    return number, sequences.filter(pl.col("split") == "train")


def ours(root: Path, model: Path, snapshot: int, train_rows: pl.DataFrame) -> float:
    """Real tokens/s of the trainer: its tokens/s (whole rows) times the rows' real share."""
    config = TrainConfig(
        lake_uri=str(root.parent / "lake"),
        snapshot=snapshot,
        checkpoint_uri=str(root / "checkpoints"),
        partition="bench",
        base_model=str(model),
        steps=STEPS,
        log_every=1,
        eval_every=STEPS,
        eval_max_sequences=4,
        checkpoint_every_steps=STEPS + 1,
        warmup_steps=2,
        micro_batch_size=MICRO_BATCH,
        grad_accum_steps=ACCUMULATION,
        scratch_dir=str(root / "scratch"),
    )
    log = run_torchrun(1, CORES, config.to_args())
    measured = [tokens for tokens, _ in speeds(log)][WARM_STEPS - 1 :]  # speeds drops step 1
    real_share = train_rows["real_tokens"].sum() / (train_rows.height * SEQ_LEN)
    return float(statistics.median(measured) * real_share)


_TRL_PROGRAM = """
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import SFTConfig, SFTTrainer

rows_file, model_dir, out_dir, micro, accumulation, steps, warm = sys.argv[1:8]
rows = json.load(open(rows_file))
dataset = Dataset.from_dict(rows)

class StepClock(TrainerCallback):
    def __init__(self):
        self.marks = []
    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())

clock = StepClock()
model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
config = SFTConfig(
    output_dir=out_dir, max_steps=int(steps), per_device_train_batch_size=int(micro),
    gradient_accumulation_steps=int(accumulation), learning_rate=1e-4, lr_scheduler_type="constant",
    logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
    dataloader_num_workers=0, padding_free=True, packing=False, max_length=None,
    gradient_checkpointing=False,
    completion_only_loss=True, dataset_kwargs={"skip_prepare_dataset": False}, seed=0,
)
trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, callbacks=[clock])
trainer.train()
print(json.dumps({"step_ends": clock.marks}))
"""


def trl(root: Path, model: Path, train_rows: pl.DataFrame) -> float:
    """Real tokens/s of TRL's SFTTrainer on the same rows: the rows' mean real tokens per step over
    the median step time after the warm-up (its sampler shuffles them)."""
    steps_rows = MICRO_BATCH * ACCUMULATION * STEPS
    rows = train_rows.head(steps_rows)
    lengths = rows["document_lengths"].to_list()
    real = [sum(n) for n in lengths]
    payload = {
        "input_ids": [ids[:n] for ids, n in zip(rows["input_ids"].to_list(), real, strict=True)],
        "completion_mask": [
            [int(x) for x in mask[:n]]
            for mask, n in zip(rows["loss_mask"].to_list(), real, strict=True)
        ],
        "seq_lengths": lengths,
    }
    root.mkdir(parents=True, exist_ok=True)
    rows_file = root / "trl_rows.json"
    rows_file.write_text(json.dumps(payload))
    env = {**os.environ, "OMP_NUM_THREADS": str(CORES), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _TRL_PROGRAM, str(rows_file), str(model), str(root / "out")]
        + [str(MICRO_BATCH), str(ACCUMULATION), str(STEPS), str(WARM_STEPS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"TRL exited {done.returncode}:\n{done.stderr[-4000:]}")
    marks = json.loads(done.stdout.strip().splitlines()[-1])["step_ends"]
    durations = np.diff(marks)[WARM_STEPS - 1 :]
    return float(np.mean(real)) * MICRO_BATCH * ACCUMULATION / float(np.median(durations))


def run() -> dict:
    started, load = time.perf_counter(), os.getloadavg()[0]
    speeds: dict[str, list[float]] = {"trainer": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = qwen2_folder(root / "qwen2")
        snapshot, train_rows = write_snapshot(str(root / "lake"), n_records=800)
        train_rows = train_rows.sort("sequence_index")
        for number in range(ROUNDS):
            speeds["trainer"].append(ours(root / f"ours{number}", model, snapshot, train_rows))
            speeds["trl"].append(trl(root / f"trl{number}", model, train_rows))
    trainer_speed, trl_speed = float(max(speeds["trainer"])), float(max(speeds["trl"]))
    ratio = trainer_speed / trl_speed
    return {
        "device": "cpu",
        "cores": CORES,
        "model": {"family": "qwen2", **QWEN2},
        "seq_len": SEQ_LEN,
        "micro_batch": MICRO_BATCH,
        "accumulation": ACCUMULATION,
        "runs": {side: [round(float(v)) for v in values] for side, values in speeds.items()},
        "measured": f"trainer (--base-model, 1 process): {trainer_speed:,.0f} real tokens/s",
        "baseline": f"TRL {_trl_version()} SFTTrainer (padding-free, 1 process): "
        f"{trl_speed:,.0f} real tokens/s",
        "ratio": ratio,
        "ratio_is": "trainer real tokens/s / TRL SFTTrainer real tokens/s (best of each side's "
        "runs)",
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_1m": {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)},
        "target": "at least TRL's speed (ratio >= 1.0)",
        "target_met": ratio >= 1.0,
    }


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
