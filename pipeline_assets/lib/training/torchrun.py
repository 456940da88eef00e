"""The torchrun command line for the trainer: what the training asset launches, the tests run and a
user can paste into a shell to debug a run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TRAINER_MODULE = "pipeline_assets.trainer"
SCORER_MODULE = "pipeline_assets.trainer.score"  # evaluation's scoring program
REFERENCE_MODULE = "pipeline_assets.trainer.reference"  # DPO's reference pass


def torchrun_executable() -> list[str]:
    """The ``torchrun`` beside this interpreter (the same virtual environment), else
    ``python -m torch.distributed.run``."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_command(
    nproc_per_node: int,
    trainer_args: list[str],
    max_restarts: int = 0,
    module: str = TRAINER_MODULE,
) -> list[str]:
    """One node, a free rendezvous port (``--standalone``), the trainer (or ``module``) as a
    module."""
    return [
        *torchrun_executable(),
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *trainer_args,
    ]


def torchrun_env(threads_per_rank: int) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(threads_per_rank),
        # torchrun's restarts are unreliable when the rendezvous store is shared with the agent.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }
