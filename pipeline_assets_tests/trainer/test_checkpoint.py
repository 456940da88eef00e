"""Checkpoint publication, pruning and loading in one process (a one-rank gloo group): the last K
and the best, the JSON part of the state, and files that no longer match the manifest."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipeline_assets.trainer.checkpoint import Checkpointer
from pipeline_assets.trainer.storage import BEST, CheckpointStore


@pytest.fixture
def store(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        yield CheckpointStore(str(tmp_path / "checkpoints"), "gold-v0", str(tmp_path / "scratch"))
    finally:
        dist.destroy_process_group()


def test_pruning_keeps_the_newest_checkpoints_and_the_best_apart(store):
    checkpointer = Checkpointer(store, dist.group.WORLD, keep=2)
    for step, validation_loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5)]:
        checkpointer.save(
            step,
            {"w": torch.full((4,), float(step))},
            {"validation_loss": validation_loss},
            asynchronous=True,
        )
    checkpointer.finish()
    assert store.complete_steps() == [4, 3, 2], "the newest two, and step 2 kept apart as the best"
    assert store.read_json(BEST)["step"] == 2
    state = {"w": torch.zeros(4)}
    assert checkpointer.load_newest(state) == 4 and torch.equal(state["w"], torch.full((4,), 4.0))


def _training_state(generator_state: torch.Tensor, step: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {
            "state": {"w": {"step": torch.tensor(float(step))}},
            "param_groups": [
                {"lr": 0.01 * step, "betas": (0.9, 0.95), "params": ["w"], "foreach": None}
            ],
        },
        "progress": {
            "step": step,
            "position": 17 * step,
            "best_validation_loss": float("inf"),
            "history": [[1, 2.5]],
        },
        "rng/rank0": generator_state,
    }


def test_state_that_is_not_a_tensor_is_json_and_resumes_exactly(store):
    checkpointer = Checkpointer(store, dist.group.WORLD, keep=2)
    rng = torch.get_rng_state()
    checkpointer.save(5, _training_state(rng, 5), {}, asynchronous=False)
    folder = store.local_folder("step-5")

    plain = json.loads((folder / "__0_state.json").read_text())
    assert plain["progress"] == {
        "step": 5,
        "position": 85,
        "best_validation_loss": float("inf"),
        "history": [[1, 2.5]],
    }
    assert plain["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]
    stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert all(isinstance(entry, TensorStorageMetadata) for entry in stored.values()), (
        "nothing pickled into the shards"
    )
    assert set(stored) == {"model.w", "optimizer.state.w.step", "rng/rank0"}
    assert "__0_state.json" in store.read_json("step-5/COMPLETE.json")["files"]

    state = _training_state(torch.zeros_like(rng), 0)
    assert checkpointer.load_newest(state) == 5
    assert (
        state["progress"]["position"] == 85 and state["optimizer"]["param_groups"][0]["lr"] == 0.05
    )
    assert torch.equal(state["model"]["w"], torch.full((3,), 5.0)) and torch.equal(
        state["rng/rank0"], rng
    )


class _Payload:
    """What a hostile ``.metadata`` could hold: unpickling it runs code (here, writes a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("altered", [".metadata", "__0_0.distcp", "__0_state.json"])
def test_a_file_that_no_longer_matches_the_manifest_is_refused_before_anything_is_read(
    store, tmp_path, caplog, altered
):
    checkpointer = Checkpointer(store, dist.group.WORLD, keep=2)
    checkpointer.save(3, _training_state(torch.get_rng_state(), 3), {}, asynchronous=False)
    marker = tmp_path / "unpickled"
    (store.local_folder("step-3") / altered).write_bytes(pickle.dumps(_Payload(str(marker))))

    state = _training_state(torch.get_rng_state(), 0)
    with caplog.at_level(logging.WARNING, logger="pipeline_assets.trainer"):
        assert checkpointer.load_newest(state) is None, "no checkpoint left to resume from"
    assert (
        f"skipping checkpoint {store.folder_uri('step-3')}: {altered} does not match its checksum "
        "in COMPLETE.json: "
        "refused, nothing of it is loaded" in caplog.text
    )
    assert not marker.exists() and state["progress"]["step"] == 0
