"""The trainer under real torchrun, 2 CPU ranks with gloo: FSDP2 gradients, kills, SIGTERM, corrupt
checkpoints, checkpoints on S3."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import boto3
import pytest
import torch

from pipeline_assets.trainer.config import PRESETS
from pipeline_assets.trainer.data import read_snapshot, stream_indexes
from pipeline_assets.trainer.hf_model import build_local
from pipeline_assets.trainer.model import Transformer, counted_loss_sum, loss_sum_and_count
from pipeline_assets_tests.conftest import BUCKET
from pipeline_assets_tests.hf_models import llama_folder, qwen2_folder
from pipeline_assets_tests.trainer.launch import (
    assert_close_gradients,
    assert_rerun_resumes_and_matches,
    assert_sigkill_then_restart_matches,
    final_weights,
    partition_dir,
    probe_gradients,
    run_job,
    stop_by_sigterm,
    tiny_config,
    with_checkpoints_at,
)
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
    return tiny_config(
        str(workspace / "lake"), gold_snapshot, str(workspace / "uninterrupted"), steps=60
    )


@pytest.fixture(scope="module")
def uninterrupted(config, workspace) -> dict:
    """The reference: the same job, never stopped."""
    output = run_job(config, workspace / "uninterrupted.log")
    losses = [float(x) for x in re.findall(r"step \d+/\d+: loss ([0-9.]+)", output)]
    assert losses[-1] < losses[0] * 0.7, "the tiny model should learn the counting documents"
    assert "attention: dense" in output, "a CPU run trains with the dense mask, and says so"
    return final_weights(config)


def test_fsdp2_gradients_equal_a_single_process_on_the_same_global_batch(config, workspace):
    sharded = probe_gradients(config, workspace / "gradients.pt")

    global_batch = config.global_batch(world_size=2)
    snapshot = read_snapshot(config.lake_uri, config.snapshot)
    batch = snapshot.train.batch(
        stream_indexes(len(snapshot.train), config.seed, 0, global_batch), torch.device("cpu")
    )
    torch.manual_seed(config.seed)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, max_seq_len=SEQ_LEN))
    loss_sum, count = loss_sum_and_count(
        model(batch["input_ids"], batch["position_ids"]), **_loss_inputs(batch)
    )
    (loss_sum / count).backward()

    assert sharded["loss"] == pytest.approx((loss_sum / count).item(), rel=1e-5)
    assert_close_gradients(sharded["gradients"], model, atol=1e-6)


def test_sigkill_mid_run_then_restart_ends_with_the_uninterrupted_parameters(
    config, workspace, uninterrupted
):
    assert_sigkill_then_restart_matches(config, workspace, 30, uninterrupted)


def test_sigterm_saves_the_step_it_stopped_at_and_the_rerun_finishes_identically(
    config, workspace, uninterrupted
):
    stopped = with_checkpoints_at(config, str(workspace / "stopped"))
    stop_step = stop_by_sigterm(stopped, 20, workspace / "stopped-1.log")
    saved = partition_dir(stopped) / f"step-{stop_step}" / "COMPLETE.json"
    assert json.loads(saved.read_text())["step"] == stop_step
    assert_rerun_resumes_and_matches(stopped, stop_step, workspace / "stopped-2.log", uninterrupted)


def test_a_corrupt_newest_and_a_partial_checkpoint_are_skipped_for_the_previous_one(
    config, workspace, uninterrupted
):
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

    output = run_job(
        with_checkpoints_at(config, str(root), steps=config.steps + 20), workspace / "corrupt.log"
    )
    assert re.search(
        rf"WARNING skipping checkpoint .*step-{newest}: __0_0.distcp does not match its checksum",
        output,
    )
    assert f"resumed from {partition}/step-{previous}: step {previous}," in output
    assert not partial.exists(), "the unpublished folder is cleared"
    assert (partition / f"step-{config.steps + 20}" / "COMPLETE.json").exists()


def test_checkpoints_on_s3_by_the_clock_publish_last_and_resume(config, workspace, s3_endpoint):
    # checkpoint_every_minutes alone triggers the saves here: the clock is due (nearly) every step
    on_s3 = with_checkpoints_at(
        config,
        f"s3://{BUCKET}/checkpoints",
        steps=12,
        checkpoint_every_steps=1000,
        checkpoint_every_minutes=1e-6,
        scratch_dir=str(workspace / "s3-scratch"),
    )
    output = run_job(on_s3, workspace / "s3-1.log")
    assert (
        len(re.findall(r"asynchronous checkpoint save blocked", output)) >= 5
    )  # by the clock, not by steps (1000)
    listing = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")
    keys = {item["Key"] for item in listing["Contents"]}
    prefix = f"checkpoints/{config.partition}"
    steps = sorted(
        int(key.split("/")[2][5:])
        for key in keys
        if key.endswith("/COMPLETE.json") and "/step-" in key
    )
    assert steps[-1] == 12 and len(steps) <= 3, "the newest two, and the best when it is older"
    assert f"{prefix}/final/model.safetensors" in keys
    assert f"{prefix}/step-12/.metadata" in keys and f"{prefix}/step-12/__1_0.distcp" in keys

    output = run_job(dataclasses.replace(on_s3, steps=16), workspace / "s3-2.log")
    assert f"resumed from s3://{BUCKET}/{prefix}/step-12: step 12," in output


# --- a Hugging Face base model (--base-model) ---------------------------------------------------


@pytest.fixture(scope="module")
def base_models(workspace) -> dict[str, Path]:
    torch.manual_seed(0)
    return {
        "qwen2": qwen2_folder(workspace / "qwen2"),  # grouped-query attention, untied embeddings
        "llama": llama_folder(workspace / "llama"),  # tied embeddings
    }


@pytest.fixture(scope="module")
def base_model_config(config, workspace, base_models):
    return with_checkpoints_at(
        config,
        str(workspace / "hf" / "uninterrupted"),
        base_model=str(base_models["qwen2"]),
        steps=16,
        eval_every=8,
        checkpoint_every_steps=4,
    )


# One family each, a torchrun job costing some 25 s here: Llama's tied embeddings (one parameter
# under two names, sharded once) for the gradients, Qwen2's grouped-query attention and untied
# output layer for the resume.
@pytest.mark.parametrize("family", ["llama"])
def test_fsdp2_gradients_of_a_base_model_equal_a_single_process(
    config, workspace, base_models, family
):
    sharded = probe_gradients(
        dataclasses.replace(config, base_model=str(base_models[family])),
        workspace / f"{family}-gradients.pt",
    )

    snapshot = read_snapshot(config.lake_uri, config.snapshot)
    batch = snapshot.train.batch(
        stream_indexes(len(snapshot.train), config.seed, 0, config.global_batch(world_size=2)),
        torch.device("cpu"),
    )
    model = build_local(base_models[family]).train()
    losses = model(batch["input_ids"], batch["position_ids"], next_token_losses=True)
    loss_sum, count = counted_loss_sum(losses, batch["loss_mask"], batch["position_ids"])
    (loss_sum / count).backward()

    assert sharded["loss"] == pytest.approx((loss_sum / count).item(), rel=1e-5)
    assert_close_gradients(sharded["gradients"], model, atol=1e-6)


def test_a_base_model_run_killed_mid_run_restarts_to_the_uninterrupted_weights(
    base_model_config, workspace
):
    output = run_job(base_model_config, workspace / "hf-uninterrupted.log")
    assert "attention: sdpa, transformers'" in output
    assert re.search(r"Qwen2ForCausalLM \(.*qwen2\): 0\.\d+M parameters", output)
    (workspace / "hf").mkdir(exist_ok=True)
    assert_sigkill_then_restart_matches(
        base_model_config, workspace / "hf", 4, final_weights(base_model_config)
    )


def _loss_inputs(batch: dict) -> dict:
    return {
        "input_ids": batch["input_ids"],
        "loss_mask": batch["loss_mask"],
        "position_ids": batch["position_ids"],
    }
