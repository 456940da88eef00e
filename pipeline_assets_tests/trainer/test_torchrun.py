"""The trainer under real torchrun, 2 CPU ranks with gloo: FSDP2 gradients, kills, SIGTERM, corrupt
checkpoints, checkpoints on S3."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import boto3
import pytest
import torch

from pipeline_assets.lib.torchrun import torchrun_env, torchrun_executable
from pipeline_assets.trainer.config import PRESETS
from pipeline_assets.trainer.data import read_snapshot, stream_indexes
from pipeline_assets.trainer.model import Transformer, loss_sum_and_count
from pipeline_assets.trainer.train import EXIT_PREEMPTED
from pipeline_assets_tests.conftest import BUCKET
from pipeline_assets_tests.trainer.launch import Job, final_weights, run_job, tiny_config, with_checkpoints_at
from pipeline_assets_tests.trainer.synthetic import VOCAB, write_synthetic_gold

SEQ_LEN = 64


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def gold_snapshot(workspace) -> int:
    return write_synthetic_gold(str(workspace / "lake"), n_records=600, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def config(workspace, gold_snapshot):
    return tiny_config(str(workspace / "lake"), gold_snapshot, str(workspace / "uninterrupted"), steps=60)


@pytest.fixture(scope="module")
def uninterrupted(config, workspace) -> dict:
    """The reference: the same job, never stopped."""
    output = run_job(config, workspace / "uninterrupted.log")
    losses = [float(x) for x in re.findall(r"step \d+/\d+: loss ([0-9.]+)", output)]
    assert losses[-1] < losses[0] * 0.7, "the tiny model should learn the counting documents"
    assert "attention: dense" in output, "a CPU run trains with the dense mask, and says so"
    return final_weights(config)


def _assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=f"{name} differs")


def test_fsdp2_gradients_equal_a_single_process_on_the_same_global_batch(config, workspace):
    out = workspace / "gradients.pt"
    probe = Path(__file__).with_name("gradient_probe.py")
    command = [*torchrun_executable(), "--standalone", "--nproc-per-node=2", str(probe), str(out), *config.to_args()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env={**_environ(), **torchrun_env(1)})
    assert done.returncode == 0, done.stdout + done.stderr
    sharded = torch.load(out, weights_only=True)

    global_batch = config.global_batch(world_size=2)
    snapshot = read_snapshot(config.lake_uri, config.snapshot)
    batch = snapshot.train.batch(stream_indexes(len(snapshot.train), config.seed, 0, global_batch), torch.device("cpu"))
    torch.manual_seed(config.seed)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, max_seq_len=SEQ_LEN))
    loss_sum, count = loss_sum_and_count(model(batch["input_ids"], batch["position_ids"]), **_loss_inputs(batch))
    (loss_sum / count).backward()

    assert sharded["loss"] == pytest.approx((loss_sum / count).item(), rel=1e-5)
    reference = dict(model.named_parameters())
    assert sharded["gradients"].keys() == reference.keys()
    for name, gradient in sharded["gradients"].items():
        torch.testing.assert_close(gradient, reference[name].grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


def test_sigkill_mid_run_then_restart_ends_with_the_uninterrupted_parameters(config, workspace, uninterrupted):
    killed = with_checkpoints_at(config, str(workspace / "killed"))
    job = Job(killed, workspace / "killed-1.log")
    job.wait_for(workspace / "killed" / killed.partition / "step-30" / "COMPLETE.json")
    job.kill_all()
    job.wait()
    assert not (workspace / "killed" / killed.partition / "final").exists(), "the kill came after the end: nothing tested"

    output = run_job(killed, workspace / "killed-2.log")
    resumed_at = int(re.search(r"resumed from .*step-(\d+): step", output).group(1))
    assert 30 <= resumed_at < config.steps
    _assert_same_weights(final_weights(killed), uninterrupted)


def test_sigterm_saves_the_step_it_stopped_at_and_the_rerun_finishes_identically(config, workspace, uninterrupted):
    stopped = with_checkpoints_at(config, str(workspace / "stopped"))
    job = Job(stopped, workspace / "stopped-1.log")
    job.wait_for(workspace / "stopped" / stopped.partition / "step-20" / "COMPLETE.json")
    job.terminate()
    job.wait()
    output = job.output()
    assert f"exitcode  : {EXIT_PREEMPTED}" in output or "stopped by a signal" in output, output
    stop_step = int(re.search(r"stopped by a signal at step (\d+)", output).group(1))
    last_trained = max(int(step) for step in re.findall(r"step (\d+)/\d+: loss", output))
    assert stop_step == last_trained < config.steps, "no trained step may be lost"
    folder = workspace / "stopped" / stopped.partition / f"step-{stop_step}"
    assert json.loads((folder / "COMPLETE.json").read_text())["step"] == stop_step

    rerun = run_job(stopped, workspace / "stopped-2.log")
    assert f"step {stop_step}, " in re.search(r"resumed from .*", rerun).group(0)
    _assert_same_weights(final_weights(stopped), uninterrupted)


def test_a_corrupt_newest_and_a_partial_checkpoint_are_skipped_for_the_previous_one(config, workspace, uninterrupted):
    root = workspace / "corrupt"
    shutil.copytree(workspace / "uninterrupted", root)
    partition = root / config.partition
    newest, previous = sorted((int(p.name[5:]) for p in partition.glob("step-*")), reverse=True)[:2]
    shard = partition / f"step-{newest}" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    partial = partition / f"step-{newest + 5}"  # a step this run does not checkpoint
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a file")  # written, never published

    output = run_job(with_checkpoints_at(config, str(root), steps=config.steps + 20), workspace / "corrupt.log")
    assert re.search(rf"WARNING skipping checkpoint .*step-{newest}: __0_0.distcp does not match its checksum", output)
    assert f"resumed from {partition}/step-{previous}: step {previous}," in output
    assert not partial.exists(), "the unpublished folder is cleared"
    assert (partition / f"step-{config.steps + 20}" / "COMPLETE.json").exists()


def test_checkpoints_on_s3_by_the_clock_publish_last_and_resume(config, workspace, s3_endpoint):
    # checkpoint_every_minutes alone triggers the saves here: the clock is due (nearly) every step
    on_s3 = with_checkpoints_at(config, f"s3://{BUCKET}/checkpoints", steps=12, checkpoint_every_steps=1000,
                                checkpoint_every_minutes=1e-6, scratch_dir=str(workspace / "s3-scratch"))
    output = run_job(on_s3, workspace / "s3-1.log")
    assert len(re.findall(r"asynchronous checkpoint save blocked", output)) >= 5  # by the clock, not by steps (1000)
    keys = {item["Key"] for item in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")["Contents"]}
    prefix = f"checkpoints/{config.partition}"
    steps = sorted(int(key.split("/")[2][5:]) for key in keys if key.endswith("/COMPLETE.json") and "/step-" in key)
    assert steps[-1] == 12 and len(steps) <= 3, "the newest two, and the best when it is older"
    assert f"{prefix}/final/model.safetensors" in keys
    assert f"{prefix}/step-12/.metadata" in keys and f"{prefix}/step-12/__1_0.distcp" in keys

    output = run_job(dataclasses.replace(on_s3, steps=16), workspace / "s3-2.log")
    assert f"resumed from s3://{BUCKET}/{prefix}/step-12: step 12," in output


def _loss_inputs(batch: dict) -> dict:
    return {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], "position_ids": batch["position_ids"]}


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
