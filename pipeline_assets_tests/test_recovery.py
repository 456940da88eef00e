"""`pipeline-assets run` killed or stopped mid-training: the next run recovers, resumes
and finishes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus

from pipeline_assets.lib.ops.processes import ProcessIdentity, start_ticks
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets.trainer.storage import CheckpointStore
from pipeline_assets_tests.conftest import cli_environment, write_landing_file

# A checkpoint is published when the next one starts (saves are asynchronous): the kill lands after
# step-5 is published, long before the last step.
STEPS = {"PIPELINE_TRAIN_STEPS": "40", "PIPELINE_TRAIN_CHECKPOINT_EVERY": "5"}
_NEVER = 600.0  # a bound for a hung test, not a timing expectation


def _environment(home: Path) -> dict[str, str]:
    return {**cli_environment(home), **STEPS}


def _start_run(home: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline_assets.cli.main", "run"],
            env=_environment(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli.main", *args],
        env=_environment(home),
        capture_output=True,
        text=True,
        timeout=_NEVER,
    )


def _wait_for(condition, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + _NEVER
    while not condition():
        assert process.poll() is None, (
            f"the run ended (exit {process.returncode}) too early:\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.05)


def _tree(pid: int) -> list[ProcessIdentity]:
    """``pid`` and its descendants (torchrun's ranks run in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(
            ProcessIdentity(pid=current, host="", boot_id="", started=start_ticks(current))
        )
        stack.extend(parents.get(current, []))
    return found


def _alive(processes: list[ProcessIdentity]) -> list[int]:
    return [
        p.pid
        for p in processes
        if p.started
        and start_ticks(p.pid) == p.started
        and "Z" not in Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[:1]
    ]


def _corpus(home: Path) -> None:
    """A small, uniform first dataset (issue 14: it must reach a champion although its rows cannot
    be packed to 0.98), beside the sample corpus's eval sets."""
    write_sample_corpus(
        home / "sample", records=200, eval_sets_dir=home / "reference" / "eval_sets"
    )
    write_landing_file(home / "landing", "support", "first.jsonl", support_answers(1000))


_OPENERS = [
    "Thanks for reaching out about",
    "Sorry for the trouble with",
    "Happy to help with",
    "Good question about",
    "We looked into",
    "Here is how to handle",
]
_TOPICS = [
    "your password",
    "the billing page",
    "a failed payment",
    "the mobile app",
    "two-factor login",
    "an export",
    "the invoice email",
    "a locked account",
    "the team plan",
    "a refund request",
    "the API key",
    "notifications",
]
_STEPS = [
    "open {place} and choose {item}",
    "sign out, wait {n} minutes and sign in again",
    "clear the cache of {item} on {place}",
    "check that {item} matches the one on {place}",
    "ask an admin to confirm {item} from {place}",
    "update the app, then retry {item} from {place}",
    "send us {item} shown on {place}",
    "turn {item} off and on again under {place}",
]
_PLACES = [
    "settings",
    "the dashboard",
    "your profile",
    "the security tab",
    "the billing tab",
    "the help center",
    "the account menu",
    "the admin console",
]
_ITEMS = [
    "the reset link",
    "the card number",
    "the device",
    "the email address",
    "the backup code",
    "the workspace",
    "the browser",
    "the subscription",
    "the token",
    "the region",
]
_CLOSERS = [
    "Reply here if it still fails.",
    "Let us know how it goes.",
    "We are here if you need more help.",
    "That should fix it for good.",
    "Tell us the error text if one appears.",
]


def support_answers(count: int, seed: int = 7) -> list[dict]:
    """``count`` support answers of similar length (about 75 tokens), each different in its steps:
    a small, uniform first dataset."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        topic = rng.choice(_TOPICS)
        steps = [
            step.format(place=rng.choice(_PLACES), item=rng.choice(_ITEMS), n=rng.randint(2, 30))
            for step in rng.sample(_STEPS, 3)
        ]
        answer = (
            f"{rng.choice(_OPENERS)} {topic} (case {i}). First, {steps[0]}. Then {steps[1]}. "
            f"If that does not work, {steps[2]}. {rng.choice(_CLOSERS)}"
        )
        rows.append(
            {
                "id": f"support-{i}",
                "prompt": f"Case {i}: I have a problem with {topic}, what should I do?",
                "response": answer,
            }
        )
    return rows


def test_a_stopped_then_killed_run_is_recovered_and_its_training_resumed(tmp_path):
    """One small uniform corpus, three commands: SIGTERM stops the first cleanly mid-training; the
    second resumes its training and is killed outright (the whole process tree, as the OOM killer or
    a lost machine would); the third finds the dead run, frees its slot, resumes and registers
    a champion."""
    _corpus(tmp_path)
    store = CheckpointStore(str(tmp_path / "checkpoints"), "gold-v0")

    stopped_log = tmp_path / "stopped.log"
    stopped = _start_run(tmp_path, stopped_log)
    _wait_for(lambda: store.complete_steps(), stopped, stopped_log)
    tree = _tree(stopped.pid)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=_NEVER) != 0
    output = stopped_log.read_text()
    assert "stopped by a signal" in output and "Run the same command again" in output, output[
        -3000:
    ]
    assert _alive(tree) == [], "torchrun and its ranks are gone with the command"
    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    assert not [
        r
        for r in instance.get_runs()
        if r.status in (DagsterRunStatus.STARTED, DagsterRunStatus.STARTING)
    ]
    stopped_at = store.complete_steps()[0]

    killed_log = tmp_path / "killed.log"
    killed = _start_run(tmp_path, killed_log)
    _wait_for(
        lambda: store.complete_steps() and store.complete_steps()[0] > stopped_at,
        killed,
        killed_log,
    )
    assert f"resumed from step {stopped_at} of run" in killed_log.read_text()
    for process in _tree(killed.pid):
        os.kill(process.pid, signal.SIGKILL)
    killed.wait()
    killed_at = store.complete_steps()[0]
    assert stopped_at < killed_at < 40

    last = _cli(tmp_path, "run")
    output = last.stdout + last.stderr
    assert last.returncode == 0, output[-3000:]
    assert (
        f"(pid {killed.pid} on host" in output
        and "is gone: marked failed, freed its training slot" in output
    )
    assert f"resumed from step {killed_at} of run" in output
    summary = json.loads(_cli(tmp_path, "summary").stdout)
    assert summary["model"]["champion_version"] == "1", (
        "the resumed training is registered as champion"
    )
    assert summary["data_snapshot"]["packing_efficiency"] < 0.98, (
        "a small uniform dataset reaches a champion"
    )
