"""A user's own pretrained model through `pipeline-assets run`: gold in its tokens, FSDP2 training
from its weights, an export of its family that transformers serves, and a fine-tune that scores
better on held-out records than the model it started from; the RL overlay then starts from that
champion in its family's format and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from dagster import DagsterInstance

from pipeline_assets.defs.keys import (
    REGISTRY_MODEL_VERSION,
    RL_POLICY,
    TRAINING_CHECKPOINT,
    TRAINING_HPARAM_SEARCH,
)
from pipeline_assets.defs.training.policy import HparamSearchPolicy
from pipeline_assets.lib.gold.base_model import folder_sha256
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets_tests.conftest import run_cli, write_landing_file
from pipeline_assets_tests.hf_models import llama_folder, qwen2_folder
from pipeline_assets_tests.user_data import land_support_export, support_preference_pairs

NOISE = ("PreviewWarning", "BetaWarning", "Traceback")


def _clean(done) -> None:
    assert done.returncode == 0, done.stderr[-4000:]
    assert "FAILED" not in done.stderr, done.stderr[-4000:]
    for noise in NOISE:
        assert noise not in done.stdout + done.stderr, noise


def _held_out_loss(folder, rows: pl.DataFrame) -> float:
    """Mean next-token loss on the loss-masked tokens of gold's validation rows, as transformers
    computes it (packed: position ids restart per document, no mask, no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows.iter_rows(named=True):
            ids = torch.tensor([row["input_ids"]])
            positions = torch.tensor([row["position_ids"]])
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            counted = torch.tensor(row["loss_mask"][1:]) & (positions[0, 1:] != 0)
            losses = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
            total += float(losses[counted].sum())
            count += int(counted.sum())
    return total / count


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(home, base model folder, environment) after `pipeline-assets run` made an sft champion of
    a user's Qwen2."""
    tmp_path = tmp_path_factory.mktemp("home")
    base = qwen2_folder(tmp_path / "models" / "support-qwen2")
    land_support_export(tmp_path, 300)
    env = {"PIPELINE_BASE_MODEL": str(base)}  # the default fine-tuning rate, 2e-5
    _clean(run_cli(tmp_path, "run", **env))
    return tmp_path, base, env


def test_a_users_qwen2_is_fine_tuned_served_and_beats_the_model_it_started_from(fine_tuned):
    tmp_path, base, env = fine_tuned

    lake = LakeResource(uri=str(tmp_path / "lake"))
    tokenizer = lake.read("gold", "tokenizer").row(0, named=True)
    assert tokenizer["origin"] == f"base model {base}"
    assert tokenizer["base_model_version"] == folder_sha256(base)
    assert tokenizer["vocab_size"] == json.loads((base / "config.json").read_text())["vocab_size"]

    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    [trained] = instance.fetch_materializations(TRAINING_CHECKPOINT, limit=1).records
    command = trained.asset_materialization.metadata["command"].value
    assert "--lr 2e-05" in command and f"--base-model {base}" in command, "the defaults"
    # the search, run by hand as a user does, samples a fine-tune's space (one trial here)
    search = ("run", "--select", "key:training/hparam_search")
    _clean(run_cli(tmp_path, *search, **env, PIPELINE_SEARCH_TRIALS="1"))
    [searched] = instance.fetch_materializations(TRAINING_HPARAM_SEARCH, limit=1).records
    best = searched.asset_materialization.metadata["best_config"].value
    fine_tune_space = HparamSearchPolicy.model_fields["base_model_space"].default_factory()
    assert best.keys() == fine_tune_space.keys(), "no width: the architecture is the model's"
    assert all(best[name] in values for name, values in fine_tune_space.items())

    lineage = run_cli(tmp_path, "lineage", "sft-model@champion", **env)
    assert lineage.returncode == 0, lineage.stderr
    assert json.loads(lineage.stdout)["base_model"] == {
        "uri": str(base),
        "sha256": folder_sha256(base),
    }

    served = tmp_path / "served"
    exported = run_cli(
        tmp_path, "export", "sft-model@champion", "--out", str(served), "--generate", "Hi", **env
    )
    assert exported.returncode == 0, exported.stderr
    assert isinstance(json.loads(exported.stdout)["generation"], str)
    assert json.loads((served / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (served / "chat_template.jinja").read_text() == (
        base / "chat_template.jinja"
    ).read_text()
    stops = json.loads((served / "generation_config.json").read_text())["eos_token_id"]
    end_of_turn = json.loads((base / "tokenizer.json").read_text())["added_tokens"]
    assert {t["id"] for t in end_of_turn if t["content"] == "<|im_end|>"} <= set(stops)

    validation = lake.read("gold", "sequences").filter(pl.col("split") == "validation")
    assert validation.height > 0
    assert _held_out_loss(served, validation) < _held_out_loss(base, validation)

    # The first candidate was judged against the base model, scored on the same rows.
    report = lake.read("evaluation", "report")
    assert set(report["model"]) == {"candidate", "base_model"}
    overall = dict(report.filter(pl.col("slice") == "overall").select("model", "loss").iter_rows())
    assert overall["candidate"] < overall["base_model"]
    [registered] = instance.fetch_materializations(REGISTRY_MODEL_VERSION, limit=1).records
    gate = registered.asset_materialization.metadata["gate"].value
    assert "on the base model's" in gate, gate


def test_the_rl_overlay_runs_from_the_qwen2_champion_in_its_own_format_and_template(fine_tuned):
    tmp_path, base, env = fine_tuned
    rl_env = {**env, "PIPELINE_RL_BANK_TASKS": "200"}

    _clean(run_cli(tmp_path, "run", "--select", "key:rl/*", **rl_env))

    instance = DagsterInstance.from_config(str(tmp_path / "dagster"))
    [run] = instance.fetch_materializations(RL_POLICY, limit=1).records
    policy = run.asset_materialization.metadata
    assert policy["started_from"].value == "sft-model/1"
    newest = Path(policy["policy_uri"].value)
    assert json.loads((newest / "pipeline.json").read_text())["backend"] == "huggingface"
    assert json.loads((newest / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    rows = pl.read_delta(str(tmp_path / "lake" / "rl" / "replay_buffer"))
    specials = json.loads((base / "tokenizer.json").read_text())["added_tokens"]
    [im_start] = [t["id"] for t in specials if t["content"] == "<|im_start|>"]
    assert rows.height and all(ids[0] == im_start for ids in rows["prompt_token_ids"]), (
        "the policy's prompts are encoded in the champion's ChatML template, as gold encoded "
        "its training data"
    )


def test_preference_pairs_alone_train_dpo_from_the_base_model(tmp_path):
    """DPO on an instruct model: no sft data, so no sft champion; the reference pass and DPO start
    from the base model, and dpo-model's lineage says so."""
    base = llama_folder(tmp_path / "models" / "instruct-llama")
    pairs = support_preference_pairs(120)
    write_landing_file(tmp_path / "landing", "prefs", "pairs.jsonl", pairs)
    env = {
        "PIPELINE_BASE_MODEL": str(base),
        "PIPELINE_SOURCE_FORMATS": '{"prefs": "preference"}',
    }
    _clean(run_cli(tmp_path, "run", **env))

    lake = LakeResource(uri=str(tmp_path / "lake"))
    reference = lake.read("gold", "reference_logps")["reference_model"].unique().to_list()
    assert reference == [f"base_model/{folder_sha256(base)[:12]}"]
    lineage = run_cli(tmp_path, "lineage", "dpo-model/1", **env)
    assert lineage.returncode == 0, lineage.stderr
    started = json.loads(lineage.stdout)["started_from"]
    assert started == {"base_model": {"uri": str(base), "sha256": folder_sha256(base)}}
    served = tmp_path / "served"
    exported = run_cli(tmp_path, "export", "dpo-model/1", "--out", str(served), **env)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((served / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
