"""How training jobs start: torchrun on one node."""

from __future__ import annotations

import sys

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.lib.training.torchrun import TRAINER_MODULE, torchrun_command, torchrun_env
from pipeline_assets.trainer.storage import CheckpointStore, local_scratch


class TorchrunLauncher(ConfigurableResource):
    """How training jobs start: one node, ``nproc_per_node`` ranks; gloo on CPU, NCCL on GPU."""

    checkpoint_uri: str = Field(
        description="root of training checkpoints: a local path or s3://bucket/prefix"
    )
    nproc_per_node: int = Field(
        default=2, description="ranks (processes) per node: GPUs on a GPU node"
    )
    threads_per_rank: int = Field(default=1, description="OMP_NUM_THREADS of each rank")
    device: str = Field(
        default="auto", description="auto (CUDA when present), cuda or cpu; the backend follows"
    )
    max_restarts: int = Field(
        default=0, description="torchrun's own restarts; Dagster's retry policy also resumes"
    )
    scratch_dir: str = Field(default="", description="local staging for checkpoints on S3")

    def command(
        self,
        trainer_args: list[str],
        nproc_per_node: int | None = None,
        module: str = TRAINER_MODULE,
    ) -> list[str]:
        return torchrun_command(
            nproc_per_node or self.nproc_per_node, trainer_args, self.max_restarts, module
        )

    def env(self) -> dict[str, str]:
        return torchrun_env(self.threads_per_rank)

    def scoring_ranks(self) -> tuple[int, int]:
        """(ranks, threads a rank) for evaluation's scoring: a rank a GPU; on CPU, one rank with the
        threads all the ranks would have, since a second process gains nothing on CPU and costs a
        start."""
        import torch  # only where a run scores, not at every code-location load

        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            return self.nproc_per_node, self.threads_per_rank
        return 1, self.nproc_per_node * self.threads_per_rank

    def scoring_command(self, args: list[str], module: str) -> tuple[list[str], int, int]:
        """(command, ranks, threads a rank) of a scoring program: under torchrun for several
        ranks; one rank runs as a plain process, the rank torchrun would make (rank 0 of 1, the
        programs' defaults), since with nothing to rendezvous its agent only adds a start."""
        ranks, threads = self.scoring_ranks()
        if ranks == 1:
            return [sys.executable, "-m", module, *args], ranks, threads
        return self.command(args, nproc_per_node=ranks, module=module), ranks, threads

    def scratch(self) -> str:
        """Local working space: staged checkpoints for S3, fetched exports, report pictures."""
        return local_scratch(self.scratch_dir)

    def store(self, partition: str, root: str | None = None) -> CheckpointStore:
        return CheckpointStore(root or self.checkpoint_uri, partition, self.scratch())

    def partitions(self) -> list[str]:
        """The folders directly under the checkpoint root: one per trained snapshot."""
        return self.store("").folders()
