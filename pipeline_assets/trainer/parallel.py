"""Process group, device and FSDP2 sharding: one ``fully_shard`` per block, then the root."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pipeline_assets.trainer.model import Transformer


@dataclass(frozen=True)
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    # A gloo group of its own for checkpoints: an asynchronous save runs its collectives in a
    # background thread, which must never interleave with training's on the same group.
    checkpoint_group: dist.ProcessGroup


def init_distributed(device: str = "auto") -> Distributed:
    """Join the torchrun job (or start a one-process group when run without torchrun)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    checkpoint_group = dist.new_group(backend="gloo")
    return Distributed(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"),
        backend=backend,
        checkpoint_group=checkpoint_group,
    )


def mixed_precision_policy(setting: str, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU (``auto``), full fp32 on CPU."""
    bf16 = setting == "bf16" or (setting == "auto" and device.type == "cuda")
    if not bf16:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


FLEX_MIN_HEAD_DIM = (
    16  # FlexAttention's CUDA kernel (Triton's tl.dot) needs at least 16 channels per head
)


def attention_kernel(setting: str, device: torch.device, head_dim: int) -> str:
    """The model's attention kernel: ``auto`` is FlexAttention on CUDA and the dense mask elsewhere.
    ``flex`` where it cannot train is refused before training starts: FlexAttention has no backward
    on CPU, and no CUDA kernel for heads narrower than 16."""
    flex_trains = device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM
    if setting == "auto":
        return "flex" if flex_trains else "dense"
    if setting == "flex" and not flex_trains:
        raise ValueError(
            f"--attention flex needs a CUDA device and heads of at least {FLEX_MIN_HEAD_DIM} "
            f"channels (this run: {device.type}, {head_dim} channels per head); use --attention "
            "auto or dense"
        )
    return setting


def shard_model(model: Transformer, policy: MixedPrecisionPolicy) -> Transformer:
    """FSDP2: each block is a unit (its parameters gathered just for its forward and backward);
    the root holds the embedding, which the output layer shares, and the final norm."""
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
