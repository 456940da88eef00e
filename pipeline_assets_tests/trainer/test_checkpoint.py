"""Checkpoint publication and pruning in one process (a one-rank gloo group): the last K and the best."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline_assets.trainer.checkpoint import Checkpointer
from pipeline_assets.trainer.storage import BEST, CheckpointStore


def test_pruning_keeps_the_newest_checkpoints_and_the_best_apart(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        store = CheckpointStore(str(tmp_path / "checkpoints"), "gold-v0", str(tmp_path / "scratch"))
        checkpointer = Checkpointer(store, dist.group.WORLD, keep=2)
        for step, validation_loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5)]:
            checkpointer.save(step, {"w": torch.full((4,), float(step))}, {"validation_loss": validation_loss},
                              asynchronous=True)
        checkpointer.finish()
        assert store.complete_steps() == [4, 3, 2], "the newest two, and step 2 kept apart as the best"
        assert store.read_json(BEST)["step"] == 2
        state = {"w": torch.zeros(4)}
        assert checkpointer.load_newest(state) == 4 and torch.equal(state["w"], torch.full((4,), 4.0))
    finally:
        dist.destroy_process_group()
