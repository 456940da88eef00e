"""Run under torchrun with 2 ranks: DPO gradients of the two-row batch, rank 0 holding the row of
three pairs and rank 1 the row of one, FSDP2-sharded as the trainer shards; gathered to rank 0.

    torchrun --nproc-per-node 2 dpo_gradient_probe.py OUT.pt
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeline_assets.trainer.parallel import init_distributed, mixed_precision_policy, shard_model
from pipeline_assets_tests.trainer.dpo_batches import (
    batch_loss,
    batch_of,
    policy_and_reference,
    two_rank_rows,
)

out = sys.argv[1]
env = init_distributed("cpu")
policy, reference = policy_and_reference()
policy = shard_model(policy, mixed_precision_policy("auto", env.device))
rows = two_rank_rows()
mine = rows[env.rank : env.rank + 1]
pairs_per_rank = [torch.zeros((), dtype=torch.long) for _ in range(env.world_size)]
dist.all_gather(pairs_per_rank, torch.tensor(int(mine["pair_ids"].list.len().sum())))
global_pairs = int(sum(pairs_per_rank))
loss, _ = batch_loss(policy, reference, batch_of(mine), global_pairs, env.world_size)
loss.backward()
logged_loss = loss.detach().clone()
dist.all_reduce(logged_loss)  # the average over ranks is the global batch's loss (gloo has no AVG)
logged_loss /= env.world_size
gradients = {}
for name, parameter in policy.named_parameters():
    gradient = parameter.grad
    gradients[name] = gradient.full_tensor() if isinstance(gradient, DTensor) else gradient
if env.rank == 0:
    torch.save(
        {
            "loss": logged_loss,
            "gradients": gradients,
            "pairs_per_rank": [int(n) for n in pairs_per_rank],
        },
        out,
    )
dist.destroy_process_group()
