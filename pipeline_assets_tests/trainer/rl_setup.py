"""A small RL run's inputs, made in seconds: a prompt bank of generated tasks in a lake, a
byte-level BPE tokenizer trained on its text, and an untrained tiny policy exported where
``--init-from`` reads it (the built-in model, or a Hugging Face model with its own tokenizer and
chat template)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import polars as pl
import torch

from pipeline_assets.lib.gold.base_model import folder_encoder_spec
from pipeline_assets.lib.gold.tokenizer import tokenizer_to_json, train_bpe
from pipeline_assets.lib.rl.prompt_bank import curate_bank, generated_tasks
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.decontam import EVAL_COLUMNS, DecontamConfig, EvalNgramIndex
from pipeline_assets.lib.training.torchrun import torchrun_env
from pipeline_assets.trainer.config import ModelConfig, RlConfig
from pipeline_assets.trainer.export import save_exported
from pipeline_assets.trainer.model import Transformer
from pipeline_assets_tests.hf_models import qwen2_folder
from pipeline_assets_tests.trainer.launch import environ_without_mlflow


def rl_inputs(
    root: Path, bank_tasks: int = 400, dim: int = 32, n_layers: int = 2, **overrides
) -> RlConfig:
    """The inputs, and a config of a short run (no warm start: the functional tests need
    no skill)."""
    bank = _write_bank(root / "lake", bank_tasks)
    tokenizer = train_bpe(
        (bank["prompt"] + " " + bank["ground_truth"]).to_list(), vocab_size=512, min_frequency=1
    )
    (root / "tokenizer.json").write_text(tokenizer_to_json(tokenizer))
    model_config = ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=4, vocab_size=tokenizer.get_vocab_size(), max_seq_len=64
    )
    (root / "init").mkdir(exist_ok=True)
    torch.manual_seed(0)
    save_exported(Transformer(model_config).state_dict(), model_config, root / "init", {})
    return _short_run(root, tokenizer_path=str(root / "tokenizer.json"), **overrides)


def hf_rl_inputs(root: Path, bank_tasks: int = 400, **overrides) -> RlConfig:
    """The same bank, and a tiny Qwen2 as the starting policy, as a Hugging Face backend's sft
    champion starts one: its folder, its own tokenizer and ChatML template (the file rl/policy
    writes from the champion's gold/tokenizer row)."""
    _write_bank(root / "lake", bank_tasks)
    folder = qwen2_folder(root / "init")
    (root / "chat_template.json").write_text(folder_encoder_spec(folder).template_file_text())
    return _short_run(
        root,
        tokenizer_path=str(folder / "tokenizer.json"),
        chat_template_path=str(root / "chat_template.json"),
        **overrides,
    )


def _write_bank(lake: Path, bank_tasks: int) -> pl.DataFrame:
    no_eval_items = EvalNgramIndex.build(
        pl.DataFrame(schema=dict.fromkeys(EVAL_COLUMNS, pl.String)), DecontamConfig()
    )
    bank = curate_bank(
        generated_tasks(bank_tasks, seed=1, held_out_fraction=0.2), no_eval_items, SilverConfig()
    )
    bank.write_delta(str(lake / "rl" / "prompt_bank"), mode="overwrite")
    return bank


def _short_run(root: Path, **overrides) -> RlConfig:
    config = RlConfig(
        lake_uri=str(root / "lake"),
        checkpoint_uri=str(root / "checkpoints"),
        partition="rl-v0",
        tokenizer_path="",
        init_from=str(root / "init"),
        updates=3,
        prompts_per_update=4,
        group_size=4,
        eval_every=2,
        held_out_prompts=8,
        landing_uri=str(root / "landing"),
        wait_seconds=60,
        warm_start_accuracy=0.0,
    )
    return replace(config, **overrides)


def start(config: RlConfig, log: Path, worker: int | None = None, lag: int = 0) -> subprocess.Popen:
    """The learner, or rollout worker ``worker``, as its own process (its output in ``log``)."""
    args = replace(config, worker=-1 if worker is None else worker, lag=lag).to_args()
    env = {
        **environ_without_mlflow(),
        **torchrun_env(threads_per_rank=1),
    }  # one core each, as the launcher gives
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets.trainer.rl", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def dropped_shares(rows: pl.DataFrame) -> dict[str, float]:
    """Each worker's share of its rollouts dropped as stale.

    A lagging worker must lose the most, not necessarily alone: at the start every worker samples
    v0, and on a loaded machine the learner can publish v1 and v2 from the lagging worker's v0
    rollouts before an on-time worker's first batch lands, which then lags by two."""
    shares = rows.group_by("worker").agg(pl.col("status").eq("dropped_stale").mean())
    return dict(shares.iter_rows())
