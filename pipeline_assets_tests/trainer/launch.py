"""Starting, waiting for and stopping real torchrun jobs in tests."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline_assets.lib.training.torchrun import (
    torchrun_command,
    torchrun_env,
    torchrun_executable,
)
from pipeline_assets.trainer.config import TrainConfig
from pipeline_assets.trainer.train import EXIT_PREEMPTED
from pipeline_assets_tests.trainer.synthetic import VOCAB


def tiny_config(lake_uri: str, snapshot: int, checkpoint_uri: str, **overrides) -> TrainConfig:
    values = dict(
        lake_uri=lake_uri,
        snapshot=snapshot,
        checkpoint_uri=checkpoint_uri,
        partition=f"gold-v{snapshot}",
        preset="tiny",
        vocab_size=VOCAB,
        steps=120,
        micro_batch_size=2,
        grad_accum_steps=2,
        lr=3e-3,
        warmup_steps=10,
        log_every=1,
        eval_every=40,
        checkpoint_every_steps=10,
        keep_checkpoints=2,
        scratch_dir=str(Path(checkpoint_uri).parent / "scratch")
        if "://" not in checkpoint_uri
        else "",
    )
    values.update(overrides)
    return TrainConfig(**values)


class Job:
    """One torchrun job, its combined output in a file."""

    def __init__(self, config: TrainConfig, log_path: Path, nproc: int = 2):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**environ_without_mlflow(), **torchrun_env(threads_per_rank=1)}
        self.process = subprocess.Popen(
            torchrun_command(nproc, config.to_args()),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self.kill_all()
            self._log.close()

    def wait_for(self, path: Path, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"the job ended before {path} appeared:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not appear in {timeout}s:\n{self.output()}")
            time.sleep(0.05)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """What losing the node does: every process of the job ends at once (workers run in their
        own sessions)."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """What a scheduler's preemption notice does: SIGTERM to torchrun, which forwards it to
        the workers."""
        os.kill(self.process.pid, signal.SIGTERM)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def run_job(config: TrainConfig, log_path: Path, nproc: int = 2, timeout: float = 240) -> str:
    job = Job(config, log_path, nproc)
    code = job.wait(timeout)
    assert code == 0, f"torchrun exited {code}:\n{job.output()}"
    return job.output()


def partition_dir(config: TrainConfig) -> Path:
    """The folder of the partition's checkpoints, for a local checkpoint_uri."""
    return Path(config.checkpoint_uri) / config.partition


def final_weights(config: TrainConfig) -> dict:
    return load_file(str(partition_dir(config) / "final" / "model.safetensors"))


def with_checkpoints_at(config: TrainConfig, checkpoint_uri: str, **overrides) -> TrainConfig:
    return dataclasses.replace(config, checkpoint_uri=checkpoint_uri, **overrides)


def environ_without_mlflow() -> dict:
    """This process's environment less MLFLOW_TRACKING_URI, so that a job started from a test
    logs nowhere."""
    return {name: value for name, value in os.environ.items() if name != "MLFLOW_TRACKING_URI"}


def assert_same_weights(actual: dict, expected: dict) -> None:
    """Both hold the same tensors, bit for bit."""
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=0, atol=0, msg=f"{name} differs"
        )


def probe_gradients(config: TrainConfig, out: Path) -> dict:
    """The loss and the gradients two torchrun ranks compute for the first global batch
    (gradient_probe.py)."""
    probe = Path(__file__).with_name("gradient_probe.py")
    command = [
        *torchrun_executable(),
        "--standalone",
        "--nproc-per-node=2",
        str(probe),
        str(out),
        *config.to_args(),
    ]
    env = {**environ_without_mlflow(), **torchrun_env(1)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out, weights_only=True)


def assert_close_gradients(gradients: dict, model: torch.nn.Module, atol: float) -> None:
    """``gradients`` holds the gradient of every parameter of ``model``, each equal up
    to rounding."""
    reference = dict(model.named_parameters())
    assert gradients.keys() == reference.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(
            gradient, reference[name].grad, rtol=1e-4, atol=atol, msg=f"gradient of {name}"
        )


def kill_once_saved(config: TrainConfig, step: int, log_path: Path) -> None:
    """Starts the job and SIGKILLs every process of it once ``step`` is checkpointed, before
    the job ends."""
    job = Job(config, log_path)
    job.wait_for(partition_dir(config) / f"step-{step}" / "COMPLETE.json")
    job.kill_all()
    job.wait()
    assert not (partition_dir(config) / "final").exists(), (
        "the kill came after the end: nothing tested"
    )


def assert_sigkill_then_restart_matches(
    config: TrainConfig, workspace: Path, step: int, uninterrupted: dict
) -> None:
    """A job killed after checkpointing ``step`` resumes at or after it and ends with
    ``uninterrupted``'s weights."""
    killed = with_checkpoints_at(config, str(workspace / "killed"))
    kill_once_saved(killed, step, workspace / "killed-1.log")
    output = run_job(killed, workspace / "killed-2.log")
    resumed_at = int(re.search(r"resumed from .*step-(\d+): step", output).group(1))
    assert step <= resumed_at < config.steps
    assert_same_weights(final_weights(killed), uninterrupted)


def stop_by_sigterm(config: TrainConfig, step: int, log_path: Path) -> int:
    """Starts the job, SIGTERMs it once ``step`` is checkpointed and returns the step it stopped
    (and saved) at."""
    job = Job(config, log_path)
    job.wait_for(partition_dir(config) / f"step-{step}" / "COMPLETE.json")
    job.terminate()
    job.wait()
    output = job.output()
    assert f"exitcode  : {EXIT_PREEMPTED}" in output or "stopped by a signal" in output, output
    stop_step = int(re.search(r"stopped by a signal at step (\d+)", output).group(1))
    last_trained = max(int(trained) for trained in re.findall(r"step (\d+)/\d+: loss", output))
    assert stop_step == last_trained < config.steps, "no trained step may be lost"
    return stop_step


def assert_rerun_resumes_and_matches(
    config: TrainConfig, stop_step: int, log_path: Path, uninterrupted: dict
) -> None:
    """The rerun of a job stopped at ``stop_step`` resumes there and ends with
    ``uninterrupted``'s weights."""
    rerun = run_job(config, log_path)
    assert f"step {stop_step}, " in re.search(r"resumed from .*", rerun).group(0)
    assert_same_weights(final_weights(config), uninterrupted)
