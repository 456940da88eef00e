"""The Hugging Face backend in one process: packed documents stay apart in every attention the
trainer uses on CPU, the chunked loss is the logits' loss, FLOPs are counted from the model's own
parameters, and a one-rank training run exports a folder transformers loads with the trainer's
logits."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline_assets.trainer.config import starting_flags
from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.hf_model import (
    BACKEND,
    SDPA,
    HuggingFaceLM,
    attention_implementation,
    build_local,
    flops_per_token,
    read_config,
)
from pipeline_assets.trainer.model import token_losses
from pipeline_assets.trainer.train import Trainer
from pipeline_assets_tests.hf_models import llama_folder, qwen2_folder
from pipeline_assets_tests.trainer.launch import tiny_config
from pipeline_assets_tests.trainer.synthetic import write_synthetic_gold
from pipeline_assets_tests.trainer.test_dpo_training import one_rank

LENGTHS = (7, 5, 9)  # three documents packed in one row


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    return {
        "qwen2": qwen2_folder(root / "qwen2"),  # grouped-query attention, untied embeddings
        "llama": llama_folder(root / "llama"),  # tied embeddings
    }


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """transformers' FlexAttention path (its block mask from the packed positions, its call of
    flex_attention) without torch.compile: compiling both for CPU takes about a minute."""
    from torch.nn.attention import flex_attention as flex_module
    from transformers import masking_utils
    from transformers.integrations import flex_attention as hf_flex

    def create_block_mask(*args, **kwargs):
        return flex_module.create_block_mask(*args, **{**kwargs, "_compile": False})

    monkeypatch.setattr(masking_utils, "create_block_mask", create_block_mask)
    monkeypatch.setattr(
        hf_flex.WrappedFlexAttention, "__call__", lambda self: flex_module.flex_attention
    )


ATTENTIONS = [SDPA, "flex_attention"]  # flex: its forward runs on CPU, its backward does not


def _model(folder, attention: str) -> HuggingFaceLM:
    model = build_local(folder)
    if attention != SDPA:
        model.lm.set_attn_implementation(attention)
    return model


def _packed(vocab: int):
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]
    input_ids = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return documents, input_ids, position_ids


def _starts() -> list[int]:
    return [sum(LENGTHS[:k]) for k in range(len(LENGTHS))]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_packed_document_has_the_logits_it_has_alone(folders, family, attention, request):
    if attention != SDPA:
        request.getfixturevalue("uncompiled_flex")
    model = _model(folders[family], attention)
    documents, input_ids, position_ids = _packed(model.hf_config.vocab_size)
    with torch.no_grad():
        packed = model(input_ids, position_ids)
        for start, document in zip(_starts(), documents, strict=True):
            alone = model(document[None], torch.arange(len(document))[None])
            torch.testing.assert_close(
                packed[:, start : start + len(document)], alone, rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_loss_of_one_document_has_no_gradient_on_another_documents_embeddings(folders, family):
    model = _model(folders[family], SDPA)
    _, input_ids, position_ids = _packed(model.hf_config.vocab_size)
    embeddings = {}

    def keep(module, inputs, output):
        output.retain_grad()
        embeddings["output"] = output

    model.lm.get_input_embeddings().register_forward_hook(keep)
    losses = model(input_ids, position_ids, next_token_losses=True)
    middle = slice(_starts()[1], _starts()[2] - 1)  # the second document's own targets
    losses[:, middle].sum().backward()
    gradient = embeddings["output"].grad[0].abs().sum(-1)

    first, second = slice(0, _starts()[1]), slice(_starts()[1], _starts()[2])
    assert torch.all(gradient[first] == 0) and torch.all(gradient[_starts()[2] :] == 0)
    assert torch.all(gradient[second][:-1] > 0)


def test_leaving_the_cache_on_lets_packed_documents_see_each_other(folders):
    """What the isolation tests would catch: called with transformers' default use_cache, the
    packing goes unnoticed and the second document attends to the first."""
    model = _model(folders["qwen2"], SDPA)
    documents, input_ids, position_ids = _packed(model.hf_config.vocab_size)
    with torch.no_grad():
        leaky = model.lm(input_ids=input_ids, position_ids=position_ids).logits
        alone = model(documents[1][None], torch.arange(LENGTHS[1])[None])
    start = _starts()[1]
    assert (leaky[:, start : start + LENGTHS[1]] - alone).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_chunked_next_token_losses_and_gradients_equal_the_logits_loss(folders, family):
    model = _model(folders[family], SDPA)
    _, input_ids, position_ids = _packed(model.hf_config.vocab_size)
    parameters = list(model.parameters())

    chunked = model(input_ids, position_ids, next_token_losses=True)
    chunked_gradients = torch.autograd.grad(chunked.sum(), parameters)
    whole = token_losses(model(input_ids, position_ids), input_ids)
    whole_gradients = torch.autograd.grad(whole.sum(), parameters)

    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(chunked_gradients, whole_gradients, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_flops_count_every_multiplying_weight_once_and_the_tied_output_layer(folders):
    for family, tied in (("qwen2", False), ("llama", True)):
        model = _model(folders[family], SDPA)
        config = model.hf_config
        embedding = config.vocab_size * config.hidden_size
        unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        weights = unique - embedding + (embedding if tied else 0)
        attention = 12 * config.num_hidden_layers * config.hidden_size * 64
        assert flops_per_token(model, 64) == 6 * weights + attention


def test_attention_is_sdpa_on_cpu_and_flex_is_refused_there(folders):
    config = read_config(folders["qwen2"])
    assert attention_implementation("auto", torch.device("cpu"), config) == SDPA
    assert attention_implementation("dense", torch.device("cpu"), config) == SDPA
    with pytest.raises(ValueError, match="--attention flex needs a CUDA device"):
        attention_implementation("flex", torch.device("cpu"), config)


# --- a one-rank training run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gold(tmp_path_factory):
    lake = tmp_path_factory.mktemp("gold") / "lake"
    return str(lake), write_synthetic_gold(str(lake), n_records=120, seq_len=32)


def _config(gold, folder, checkpoints, **overrides):
    lake, snapshot = gold
    values = dict(steps=3, eval_every=3, checkpoint_every_steps=3, warmup_steps=1, lr=1e-2)
    return tiny_config(
        lake, snapshot, str(checkpoints), base_model=str(folder), **values | overrides
    )


def test_a_run_exports_its_family_and_transformers_computes_the_trainers_logits(
    folders, gold, tmp_path
):
    from transformers import AutoModelForCausalLM

    with one_rank(tmp_path) as env:
        trainer = Trainer(_config(gold, folders["llama"], tmp_path / "checkpoints"), env, None)
        code, metadata = trainer.run()
        batch = trainer.snapshot.validation.batch(np.arange(2), env.device)
        with torch.no_grad():
            trained = trainer.model(batch["input_ids"], batch["position_ids"])
    export = tmp_path / "checkpoints" / trainer.config.partition / "final"

    assert code == 0 and metadata["attention_kernel"] == SDPA
    loaded = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        theirs = loaded(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
    torch.testing.assert_close(theirs, trained, rtol=1e-5, atol=1e-5)
    weights = load_file(str(export / "model.safetensors"))
    assert "lm_head.weight" not in weights, "the tied output layer is stored once"
    assert not torch.equal(
        weights["model.embed_tokens.weight"],
        load_file(str(folders["llama"] / "model.safetensors"))["model.embed_tokens.weight"],
    ), "three steps moved the weights"
    about = json.loads((export / "pipeline.json").read_text())
    assert about["backend"] == BACKEND and about["base_model"] == str(folders["llama"])
    assert about["base_config"]["model_type"] == "llama" and about["steps"] == 3
    again, _ = load_exported(export)
    assert isinstance(again, HuggingFaceLM)
    assert starting_flags(export) == {}, "DPO starting from it needs no preset flags"


def test_the_export_of_a_large_model_is_sharded_with_an_index(folders, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline_assets.trainer.export import save_hf_exported

    model = build_local(folders["qwen2"])
    state = {name.removeprefix("lm."): t for name, t in model.state_dict().items()}
    files = save_hf_exported(
        state, model.hf_config, tmp_path, {"backend": BACKEND}, max_shard_size=20_000
    )

    assert "model.safetensors.index.json" in files and len(files) > 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, model.hf_config.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids, use_cache=False).logits, model(ids, torch.arange(12)[None])
        )


def test_init_from_a_hugging_face_folder_builds_that_model_with_its_weights(
    folders, gold, tmp_path
):
    """What DPO does with an export of this backend (the SFT champion): --init-from alone."""
    config = dataclasses.replace(
        _config(gold, folders["qwen2"], tmp_path / "checkpoints"),
        base_model="",
        init_from=str(folders["qwen2"]),
    )
    with one_rank(tmp_path) as env:
        trainer = Trainer(config, env, None)
        state = {
            name.removeprefix("lm."): parameter.full_tensor()
            for name, parameter in trainer.model.named_parameters()
        }
    assert isinstance(trainer.model, HuggingFaceLM)
    assert state.keys() == load_file(str(folders["qwen2"] / "model.safetensors")).keys()
    for name, tensor in load_file(str(folders["qwen2"] / "model.safetensors")).items():
        assert torch.equal(state[name], tensor), name


def test_a_snapshot_with_token_ids_past_the_embedding_is_refused(gold, tmp_path):
    small = qwen2_folder(tmp_path / "small", vocab_size=40)  # the snapshot's ids reach 63
    with (
        one_rank(tmp_path) as env,
        pytest.raises(ValueError, match="token id 63.* 40 embedding rows"),
    ):
        Trainer(_config(gold, small, tmp_path / "checkpoints"), env, None)
