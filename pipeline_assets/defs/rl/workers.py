"""The RL run's rollout processes beside the learner: started with the run, restarted when one dies
before the learner marks the run done, stopped after it. Their pids are kept in ``workers.json``
beside their logs."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline_assets.trainer.policy_store import PolicyStore

_POLL_SECONDS = 0.5
_STOP_SECONDS = 30.0


class RolloutWorkers:
    def __init__(
        self,
        command: Callable[[int], list[str]],
        count: int,
        env: dict[str, str],
        folder: Path,
        policies: PolicyStore,
        log: Callable[[str], None],
    ):
        self.command, self.count, self.env, self.folder = command, count, env, folder
        self.policies, self.log = policies, log
        self.processes: dict[int, subprocess.Popen] = {}
        self.restarts = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rollout-workers", daemon=True)

    def __enter__(self) -> "RolloutWorkers":
        self.folder.mkdir(parents=True, exist_ok=True)
        for number in range(self.count):
            self._start(number)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._watcher.join()
        for process in self.processes.values():
            try:
                process.wait(
                    timeout=_STOP_SECONDS
                )  # they stop on their own once the run is marked done
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _start(self, number: int) -> None:
        with (self.folder / f"worker-{number}.log").open("a") as log:
            self.processes[number] = subprocess.Popen(
                self.command(number),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        pids = {str(n): process.pid for n, process in self.processes.items()}
        (self.folder / "workers.json").write_text(json.dumps(pids))

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_SECONDS):
            for number, process in list(self.processes.items()):
                code = process.poll()
                if code is not None and not self.policies.done():
                    self.restarts += 1
                    self.log(
                        f"rollout worker {number} exited with code {code} before the run was done: "
                        f"restarted (restart {self.restarts}; its log: "
                        f"{self.folder / f'worker-{number}.log'})"
                    )
                    self._start(number)
