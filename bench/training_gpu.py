"""Trainer on one GPU: tokens/s and MFU of the ``base`` preset (~110M parameters) in bf16.

Runs what the trainer runs: its own model (not compiled: the trainer compiles only FlexAttention,
the attention kernel it picks on CUDA), FSDP2 sharding, mixed-precision policy, loss and AdamW, at
gold's default sequence length and the trainer's default micro-batch, on packed synthetic rows
(several documents per row, so attention is document-masked as in training). It leaves out the
Delta loader so that it runs on a bare GPU machine with nothing but torch:

    python -m bench.training_gpu --out bench/results

Written to ``training_gpu.json`` with the device named; MFU counts 6 FLOPs per weight per token
plus attention (PaLM's formula) against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.trainer.config import PRESETS, TrainConfig
from pipeline_assets.trainer.metrics import peak_flops
from pipeline_assets.trainer.model import (
    Transformer,
    count_parameters,
    flops_per_token,
    loss_sum_and_count,
)
from pipeline_assets.trainer.parallel import (
    attention_kernel,
    init_distributed,
    mixed_precision_policy,
    shard_model,
)

MFU_TARGET = 0.40
# The trainer's defaults, read from where they are set, so the benchmark follows them.
VOCAB, SEQ_LEN = (
    GoldPolicy.model_fields["vocab_size"].default,
    GoldPolicy.model_fields["seq_len"].default,
)
MICRO_BATCH = TrainConfig.__dataclass_fields__["micro_batch_size"].default
WARMUP_STEPS, TIMED_STEPS = 8, 20


def packed_batch(device: torch.device, documents_per_row: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    cuts = torch.sort(
        torch.randint(1, SEQ_LEN, (MICRO_BATCH, documents_per_row - 1), generator=generator)
    ).values
    starts = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    starts.scatter_(1, cuts, 1)
    starts[:, 0] = 1
    index = torch.arange(SEQ_LEN).expand(MICRO_BATCH, SEQ_LEN)
    last_start = torch.cummax(torch.where(starts.bool(), index, 0), dim=1).values
    return {
        "input_ids": torch.randint(1, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=generator).to(
            device
        ),
        "position_ids": (index - last_start).to(device),
        "loss_mask": torch.ones(MICRO_BATCH, SEQ_LEN, dtype=torch.bool).to(device),
    }


def measure(preset: str) -> dict:
    env = init_distributed("cuda")
    config = dataclasses.replace(PRESETS[preset], vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    kernel = attention_kernel("auto", env.device, config.dim // config.n_heads)
    model = Transformer(config, kernel).to(env.device)
    parameters = count_parameters(model)
    model = shard_model(model, mixed_precision_policy("bf16", env.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = packed_batch(env.device)

    def step():
        loss_sum, count = loss_sum_and_count(
            model(batch["input_ids"], batch["position_ids"]), **batch
        )
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    torch.cuda.synchronize()
    tokens_per_second = TIMED_STEPS * MICRO_BATCH * SEQ_LEN / (time.perf_counter() - start)
    mfu = tokens_per_second * flops_per_token(config, SEQ_LEN) / peak_flops(env.device)
    torch.distributed.destroy_process_group()
    return {
        "preset": preset,
        "compiled": False,
        "attention_kernel": kernel,
        "parameters": parameters,
        "tokens_per_second": round(tokens_per_second),
        "mfu": round(mfu, 4),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.training_gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--preset", default="base")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench.training_gpu needs a CUDA GPU: torch.cuda.is_available() is False",
            file=sys.stderr,
        )
        return 1
    result = measure(args.preset)
    device = torch.cuda.get_device_name()
    summary = {
        "benchmark": "training_gpu",
        "at": datetime.now(timezone.utc).isoformat(),
        "device": device,
        "torch": torch.__version__,
        "seq_len": SEQ_LEN,
        "micro_batch_size": MICRO_BATCH,
        "mixed_precision": "bf16",
        **result,
        "measured": f"{result['preset']} ({result['parameters'] / 1e6:.0f}M), bf16, "
        f"{result['attention_kernel']} attention, "
        f"{device}: {result['tokens_per_second']:,} tok/s, MFU {result['mfu']:.1%}",
        "baseline": f"MFU {MFU_TARGET:.0%} of the dense bf16 peak",
        "ratio": round(result["mfu"] / MFU_TARGET, 3),
        "target": f"MFU >= {MFU_TARGET:.2f} on an H100-class GPU",
        "target_met": result["mfu"] >= MFU_TARGET,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "training_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
