"""Run under torchrun: the trainer's gradients for its first global batch, gathered to rank 0.

torchrun --nproc-per-node N gradient_probe.py OUT.pt <trainer arguments>
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from pipeline_assets.trainer.config import parse_args
from pipeline_assets.trainer.data import rank_micro_batches
from pipeline_assets.trainer.parallel import init_distributed
from pipeline_assets.trainer.train import Trainer

out, config = sys.argv[1], parse_args(sys.argv[2:])
env = init_distributed("cpu")
trainer = Trainer(config, env, reporter=None)
indexes = rank_micro_batches(
    len(trainer.snapshot.train),
    config.seed,
    0,
    env.rank,
    env.world_size,
    config.micro_batch_size,
    config.grad_accum_steps,
)
loss = trainer.backward([trainer.snapshot.train.batch(chosen, env.device) for chosen in indexes])
gradients = {}
for name, parameter in trainer.model.named_parameters():
    gradient = parameter.grad
    gradients[name] = gradient.full_tensor() if isinstance(gradient, DTensor) else gradient
if env.rank == 0:
    torch.save({"loss": loss, "gradients": gradients}, out)
torch.distributed.destroy_process_group()
