"""A user's base model folder: read without loading weights, versioned by its files, and refused
before any training, naming the problem, when the pipeline could not post-train it."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline_assets.lib.gold.base_model import BaseModelError, inspect_base_model
from pipeline_assets_tests.hf_models import llama_folder, qwen2_folder


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("base_models")
    return {"qwen2": qwen2_folder(root / "qwen2"), "llama": llama_folder(root / "llama")}


@pytest.mark.parametrize(
    "family, architecture, tied, eos",
    [
        ("qwen2", "Qwen2ForCausalLM", False, "<|im_end|>"),
        ("llama", "LlamaForCausalLM", True, "<|eot_id|>"),
    ],
)
def test_a_base_model_is_read_without_its_weights(families, family, architecture, tied, eos):
    from transformers import AutoModelForCausalLM

    model = inspect_base_model(families[family])
    loaded = AutoModelForCausalLM.from_pretrained(families[family])
    assert (model.architecture, model.tied_embeddings, model.eos_token) == (architecture, tied, eos)
    assert model.parameters == sum(p.numel() for p in loaded.parameters())
    assert model.vocab_size == loaded.config.vocab_size >= model.tokenizer_size
    assert "<|" in model.chat_template


def test_the_version_is_the_files_not_the_folder(families, tmp_path):
    original = inspect_base_model(families["qwen2"]).version
    copy = shutil.copytree(families["qwen2"], tmp_path / "elsewhere")
    assert inspect_base_model(copy).version == original
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.5}))
    assert inspect_base_model(copy).version != original


def _without(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _edit_json(name: str, **changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def _no_chat_template(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()
    _edit_json("tokenizer_config.json", chat_template=None)(folder)


def _sharded_with_a_shard_missing(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00002-of-00002.safetensors"}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _template_with_a_foreign_marker(folder: Path) -> None:
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_sep|>"))


@pytest.mark.parametrize(
    "breakage, named",
    [
        (_without("config.json"), "no config.json"),
        (_without("model.safetensors"), "no safetensors weights"),
        (_sharded_with_a_shard_missing, "names shards that are not there"),
        (_without("tokenizer.json"), "no tokenizer.json (the tokenizer)"),
        (_no_chat_template, "the tokenizer has no chat template"),
        (_template_with_a_foreign_marker, "<|im_sep|>, which the tokenizer does not hold"),
        (_edit_json("config.json", vocab_size=100), "the model's vocabulary"),
        (
            _edit_json("config.json", architectures=["Qwen2ForSequenceClassification"]),
            "not a causal LM transformers can build",
        ),
    ],
    ids=[
        "no-config",
        "no-weights",
        "missing-shard",
        "no-tokenizer",
        "no-template",
        "foreign-marker",
        "small-vocab",
        "not-causal",
    ],
)
def test_a_folder_the_trainer_could_not_use_is_refused_naming_why(
    families, tmp_path, breakage, named
):
    folder = shutil.copytree(families["qwen2"], tmp_path / "model")
    breakage(folder)
    with pytest.raises(BaseModelError) as refused:
        inspect_base_model(folder)
    assert refused.value.args[0].startswith(f"base model {folder}: ")
    assert named in refused.value.args[0]


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(BaseModelError, match="no such folder"):
        inspect_base_model(tmp_path / "absent")
