"""The scoring programs (evaluation's, DPO's reference pass) launched from an asset: under torchrun
for several ranks, as a plain process for one."""

import os
import subprocess

from dagster import AssetExecutionContext, Failure

from pipeline_assets.lib.training.torchrun import torchrun_env
from pipeline_assets.resources.launcher import TorchrunLauncher


def run_scoring_program(
    context: AssetExecutionContext,
    launcher: TorchrunLauncher,
    module: str,
    args: list[str],
    what: str,
) -> None:
    """A scoring program (evaluation's, DPO's reference pass): a rank a GPU of the launcher's
    under torchrun, else one rank with its threads, not in this process; its lines go to the
    step's log."""
    command, ranks, threads = launcher.scoring_command([*args, "--device", launcher.device], module)
    context.log.info(f"{what}, {ranks} rank(s) x {threads} thread(s): {' '.join(command)}")
    finished = subprocess.run(
        command, env={**os.environ, **torchrun_env(threads)}, capture_output=True, text=True
    )
    for line in finished.stdout.splitlines():
        context.log.info(line)
    if finished.returncode != 0:
        raise Failure(
            description=f"{module} exited {finished.returncode}:\n{finished.stderr[-3000:]}"
        )
