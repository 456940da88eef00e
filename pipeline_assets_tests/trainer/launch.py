"""Starting, waiting for and stopping real torchrun jobs in tests."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

from safetensors.torch import load_file

from pipeline_assets.lib.torchrun import torchrun_command, torchrun_env
from pipeline_assets.trainer.config import TrainConfig
from pipeline_assets_tests.trainer.synthetic import VOCAB


def tiny_config(lake_uri: str, snapshot: int, checkpoint_uri: str, **overrides) -> TrainConfig:
    values = dict(lake_uri=lake_uri, snapshot=snapshot, checkpoint_uri=checkpoint_uri, partition=f"gold-v{snapshot}",
                  preset="tiny", vocab_size=VOCAB, steps=120, micro_batch_size=2, grad_accum_steps=2, lr=3e-3,
                  warmup_steps=10, log_every=1, eval_every=40, checkpoint_every_steps=10, keep_checkpoints=2,
                  scratch_dir=str(Path(checkpoint_uri).parent / "scratch") if "://" not in checkpoint_uri else "")
    values.update(overrides)
    return TrainConfig(**values)


class Job:
    """One torchrun job, its combined output in a file."""

    def __init__(self, config: TrainConfig, log_path: Path, nproc: int = 2):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, **torchrun_env(threads_per_rank=1)}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.process = subprocess.Popen(torchrun_command(nproc, config.to_args()), stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)

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
        """What losing the node does: every process of the job ends at once (workers run in their own sessions)."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """What a scheduler's preemption notice does: SIGTERM to torchrun, which forwards it to the workers."""
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


def final_weights(config: TrainConfig) -> dict:
    return load_file(str(Path(config.checkpoint_uri) / config.partition / "final" / "model.safetensors"))


def with_checkpoints_at(config: TrainConfig, checkpoint_uri: str, **overrides) -> TrainConfig:
    return dataclasses.replace(config, checkpoint_uri=checkpoint_uri, **overrides)
