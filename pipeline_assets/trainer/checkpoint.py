"""Distributed checkpoints: save (optionally asynchronously), publish when complete, keep the
last K and the best, and load the newest checkpoint that verifies.

Every rank writes its own shard files; once all are written, rank 0 publishes the manifest.
Only tensors go through ``torch.distributed.checkpoint`` (which would pickle anything else); the
rest of the state (positions, schedules, optimizer settings) is JSON, one file a rank. A checkpoint
is loaded only once every file matches the manifest's checksums.
An asynchronous save returns once the state is copied off the training tensors; the write and
the publication finish in the background and are awaited before the next save or the exit.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipeline_assets.trainer.storage import BEST, CheckpointStore, describe_files

log = logging.getLogger("pipeline_assets.trainer")


def step_folder(step: int) -> str:
    return f"step-{step}"


def plain_state_file(rank: int) -> str:
    return f"__{rank}_state.json"


def split_state(state: dict) -> tuple[dict, dict]:
    """``state`` as (its tensors, everything else), each keeping the nesting of dicts."""
    tensors, plain = {}, {}
    for key, value in state.items():
        if isinstance(value, dict) and value:
            inner_tensors, inner_plain = split_state(value)
            if inner_tensors:
                tensors[key] = inner_tensors
            if inner_plain:
                plain[key] = inner_plain
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def merge_plain(state: dict, plain: dict) -> None:
    """Put the JSON part of a checkpoint back into ``state`` (whose tensors DCP has filled)."""
    for key, value in plain.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict) and value:
            merge_plain(state[key], value)
        else:
            state[key] = value


@dataclass
class _Pending:
    step: int
    future: Future | None
    extra: dict


class Checkpointer:
    def __init__(self, store: CheckpointStore, group: dist.ProcessGroup, *, keep: int):
        self.store = store
        self.group = group
        self.keep = keep
        self.saved_step: int | None = (
            None  # the newest step saved or loaded (its save may still be in flight)
        )
        self.rank = dist.get_rank()
        self._pending: _Pending | None = None
        self.published: list[str] = []

    def save(self, step: int, state: dict, extra: dict, *, asynchronous: bool) -> float:
        """Checkpoint ``state`` as step ``step``; returns the seconds training was blocked."""
        started = time.perf_counter()
        self.finish()
        folder = step_folder(step)
        if self.rank == 0:
            self.store.prepare(folder)
        dist.barrier(group=self.group)
        path = self.store.local_folder(folder)
        self.saved_step = step
        tensors, plain = split_state(state)
        (path / plain_state_file(self.rank)).write_text(json.dumps(plain, sort_keys=True))
        if asynchronous:
            future = dcp.async_save(tensors, checkpoint_id=str(path), process_group=self.group)
            self._pending = _Pending(step, future, extra)
        else:
            dcp.save(tensors, checkpoint_id=str(path), process_group=self.group)
            self._pending = _Pending(step, None, extra)
            self.finish()
        return time.perf_counter() - started

    def finish(self) -> None:
        """Wait for the pending save, upload it (S3), publish its manifest, prune old
        checkpoints."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        if pending.future is not None:
            pending.future.result()
        folder = step_folder(pending.step)
        local = self.store.local_folder(folder)
        mine = sorted(p.name for p in local.glob(f"__{self.rank}_*.distcp")) + [
            plain_state_file(self.rank)
        ]
        if self.rank == 0:
            dist.barrier(
                group=self.group
            )  # every other rank has checksummed and uploaded its files
            mine.append(".metadata")
        files = describe_files(local, mine)
        self.store.upload(folder, mine)
        gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        if self.rank != 0:
            dist.barrier(group=self.group)
        dist.gather_object(files, gathered, dst=0, group=self.group)
        if self.rank == 0:
            manifest = {
                "step": pending.step,
                "files": {name: entry for part in gathered for name, entry in part.items()},
                "created_at": datetime.now(timezone.utc).isoformat(),
                **pending.extra,
            }
            self.store.publish(folder, manifest)
            self.published.append(self.store.folder_uri(folder))
            self._prune(best=self._update_best(pending.step, pending.extra.get("validation_loss")))
            log.info(f"checkpoint {self.store.folder_uri(folder)} published")
        dist.barrier(group=self.group)

    def load_newest(self, state: dict) -> int | None:
        """Load the newest checkpoint that verifies into ``state``; a partial or corrupt one is
        skipped with a warning before anything of it is read (DCP's ``.metadata`` is a pickle).
        Returns its step, or None when there is none to resume from."""
        steps = [self.store.complete_steps() if self.rank == 0 else None]
        dist.broadcast_object_list(steps, src=0, group=self.group)
        for step in steps[0]:
            folder, reason = self.store.fetch_verified(step_folder(step), reader=f"rank{self.rank}")
            reasons = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(reasons, reason, group=self.group)
            problems = [r for r in reasons if r]
            if problems:
                if self.rank == 0:
                    log.warning(
                        f"skipping checkpoint {self.store.folder_uri(step_folder(step))}: "
                        f"{problems[0]}"
                    )
                continue
            tensors, _ = split_state(state)
            dcp.load(tensors, checkpoint_id=str(folder), process_group=self.group)
            merge_plain(state, json.loads((folder / plain_state_file(self.rank)).read_text()))
            self.saved_step = step
            return step
        return None

    def best(self) -> dict | None:
        return self.store.read_json(BEST)

    def _update_best(self, step: int, validation_loss: float | None) -> dict | None:
        """The best checkpoint after this one (``best.json``, rewritten only when this one is
        better)."""
        best = self.store.read_json(BEST)
        if validation_loss is not None and (
            best is None or validation_loss < best["validation_loss"]
        ):
            best = {
                "step": step,
                "validation_loss": validation_loss,
                "uri": self.store.folder_uri(step_folder(step)),
            }
            self.store.write_json(BEST, best)
        return best

    def _prune(self, best: dict | None) -> None:
        """Keep the newest ``keep`` complete checkpoints and the best; clear partial writes left
        behind."""
        complete = self.store.complete_steps()
        keep = set(complete[: self.keep]) | ({best["step"]} if best else set())
        for step in complete[self.keep :]:
            if step not in keep:
                self.store.delete(step_folder(step))
        for name in self.store.partial_folders():
            self.store.delete(name)
