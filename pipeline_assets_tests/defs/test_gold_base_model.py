"""gold with a base model (PIPELINE_BASE_MODEL): nothing is trained, the model's own tokenizer and
chat template are stored and every shard speaks them; a model gold cannot use is refused."""

from __future__ import annotations

import json

import polars as pl
import pytest

from pipeline_assets.lib.gold.base_model import inspect_base_model
from pipeline_assets.lib.gold.encoder import EncoderSpec
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.gold_helpers import build_shards, build_tokenizer
from pipeline_assets_tests.defs.test_gold import UPSTREAM, _ingest, _metadata
from pipeline_assets_tests.hf_models import qwen2_folder

LONG = (
    "This response explains the idea in plenty of ordinary words so that it passes every rule "
    "we have here today."
)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
)


@pytest.fixture
def qwen2(tmp_path):
    return qwen2_folder(tmp_path / "qwen2")


def _with(resources: dict, folder) -> dict:
    return {**resources, "base_model": BaseModelResource(uri=str(folder))}


def test_gold_stores_the_base_models_tokenizer_and_template_and_encodes_with_them(
    instance, resources, landing_dir, qwen2
):
    from transformers import AutoTokenizer

    rows = [record(j, response=f"{LONG} Case {j}.") for j in range(20)]
    write_landing_file(landing_dir, "logs", "a.jsonl", rows)
    batch = _ingest(instance, resources)
    run = build_tokenizer(instance, _with(resources, qwen2), UPSTREAM)
    assert run.success
    lake, model = resources["lake"], inspect_base_model(qwen2)
    row = lake.read("gold", "tokenizer").row(0, named=True)
    assert row["tokenizer_json"] == (qwen2 / "tokenizer.json").read_text()
    assert row["chat_template"] == model.chat_template
    assert json.loads(row["special_tokens"])["eos_token"] == "<|im_end|>"
    assert (row["origin"], row["base_model_version"], row["silver_version"]) == (
        f"base model {qwen2}",
        model.version,
        None,
    ), "nothing trained on silver"
    assert row["vocab_size"] == model.vocab_size > model.tokenizer_size, "the embedding's rows"
    assert row["sha256"] == EncoderSpec.from_row(row).sha256
    metadata = _metadata(run, "gold/tokenizer")
    assert (metadata["base_model_version"], metadata["base_model_uri"]) == (
        model.version,
        str(qwen2),
    )

    assert build_shards(instance, _with(resources, qwen2), UPSTREAM, [batch])[batch].success
    shard = lake.read("gold", "sequences")
    ids = shard["input_ids"].explode()
    assert 0 <= ids.min() and ids.max() < model.vocab_size
    hf = AutoTokenizer.from_pretrained(qwen2)
    packed = shard.select("input_ids", "loss_mask", "document_lengths")
    for input_ids, mask, lengths in packed.rows():
        trained = hf.decode([t for t, m in zip(input_ids, mask, strict=True) if m])
        assert trained.count("<|im_end|>") == len(lengths) and "<|im_start|>" not in trained
        assert hf.decode(input_ids[: lengths[0]]).startswith("<|im_start|>user\nQuestion number")

    template = qwen2 / "chat_template.jinja"
    template.write_text(DEFAULT_SYSTEM + template.read_text())
    assert build_tokenizer(instance, _with(resources, qwen2), UPSTREAM).success
    changed = lake.read("gold", "tokenizer").row(0, named=True)
    assert changed["tokenizer_json"] == row["tokenizer_json"]
    assert changed["sha256"] != row["sha256"], "a new template is a new encoding"


def test_a_base_model_gold_cannot_use_is_refused_with_the_reason(instance, resources, qwen2):
    template = qwen2 / "chat_template.jinja"
    # The last assistant turn opens differently from the generation prompt: no mask can be cut.
    template.write_text(
        template.read_text().replace(
            "'<|im_start|>' + message['role']",
            "'<|im_start|>' + ('final' if loop.last else message['role'])",
        )
    )
    run = build_tokenizer(instance, _with(resources, qwen2), [])
    assert not run.success
    message = run.get_step_failure_events()[0].event_specific_data.error.message
    assert f"PIPELINE_BASE_MODEL={qwen2}" in message and "does not concatenate" in message
    assert resources["lake"].read("gold", "tokenizer") is None
    (qwen2 / "config.json").unlink()
    run = build_tokenizer(instance, _with(resources, qwen2), [])
    assert "no config.json" in run.get_step_failure_events()[0].event_specific_data.error.message


def test_a_table_from_before_base_models_gains_the_columns(instance, resources, qwen2, lake):
    old = pl.DataFrame({"tokenizer_json": ["{}"], "sha256": ["0" * 64], "vocab_size": [1]})
    lake.overwrite("gold", "tokenizer", old)
    assert build_tokenizer(instance, _with(resources, qwen2), []).success
    assert lake.read("gold", "tokenizer")["chat_template"][0] is not None
