"""The launcher resource's commands: a scoring program with one rank runs as a plain process, with
several under torchrun (the evaluation and reference-pass tests run the one-rank path for real)."""

from __future__ import annotations

import sys

from pipeline_assets.lib.training.torchrun import SCORER_MODULE, torchrun_executable
from pipeline_assets.resources.launcher import TorchrunLauncher


def test_one_scoring_rank_is_a_plain_process_and_a_rank_a_gpu_is_torchrun(tmp_path):
    settings = dict(checkpoint_uri=str(tmp_path), nproc_per_node=2, threads_per_rank=3)
    on_cpu = TorchrunLauncher(**settings, device="cpu")
    command, ranks, threads = on_cpu.scoring_command(["--rows", "rows.parquet"], SCORER_MODULE)
    assert command == [sys.executable, "-m", SCORER_MODULE, "--rows", "rows.parquet"]
    assert (ranks, threads) == (1, 6), "one rank with every rank's threads"

    on_gpus = TorchrunLauncher(**settings, device="cuda")
    command, ranks, threads = on_gpus.scoring_command(["--rows", "rows.parquet"], SCORER_MODULE)
    launcher = torchrun_executable()
    assert command[: len(launcher)] == launcher and "--nproc-per-node=2" in command
    assert command[-4:] == ["-m", SCORER_MODULE, "--rows", "rows.parquet"]
    assert (ranks, threads) == (2, 3)
