"""The built-in model exports as a Hugging Face LlamaForCausalLM folder: transformers loads it as it
is and computes the trainer's logits, and its tokenizer renders the chat format gold trains on."""

import json

import polars as pl
import pytest
import torch

from pipeline_assets.lib.gold.chat_format import END, EOS, prefix_text, response_text
from pipeline_assets.lib.gold.tokenizer import (
    encode_prompts,
    encode_records,
    save_hf_tokenizer,
    tokenizer_to_json,
    train_bpe,
)
from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.export import generate_answer, load_exported, save_exported
from pipeline_assets.trainer.model import Transformer

CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=320, max_seq_len=64)
TEXT = ["how do I reset my password", "open settings then security", "thanks that worked"] * 30


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained-looking model (random weights) and its folder, tokenizer included."""
    torch.manual_seed(3)
    model = Transformer(CONFIG).eval()
    folder = tmp_path_factory.mktemp("export")
    save_exported(model.state_dict(), CONFIG, folder, {"steps": 7})
    tokenizer = train_bpe(TEXT, vocab_size=CONFIG.vocab_size, min_frequency=1)
    save_hf_tokenizer(tokenizer_to_json(tokenizer), folder)
    return model, folder, tokenizer


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_transformers_computes_the_trainers_logits_one_document_or_packed(exported):
    from transformers import AutoModelForCausalLM

    model, folder, _ = exported
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, CONFIG.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for positions in (torch.arange(24)[None], _packed_positions([10, 9, 5])):
            ours = model(ids, positions)
            theirs = loaded(input_ids=ids, position_ids=positions, use_cache=False).logits
            torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_config_json_is_what_transformers_writes_for_the_same_llama(exported):
    """The export writes config.json without transformers: the file is what LlamaConfig of the
    same values saves, and transformers reads it back as that config."""
    from transformers import LlamaConfig

    _, folder, _ = exported
    theirs = LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        intermediate_size=CONFIG.ffn_dim,
        num_hidden_layers=CONFIG.n_layers,
        num_attention_heads=CONFIG.n_heads,
        num_key_value_heads=CONFIG.n_heads,
        max_position_embeddings=CONFIG.max_seq_len,
        rms_norm_eps=CONFIG.norm_eps,
        rope_theta=CONFIG.rope_theta,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    assert json.loads((folder / "config.json").read_text()) == theirs.to_diff_dict()
    assert LlamaConfig.from_pretrained(folder).to_dict() == theirs.to_dict()


def test_the_folder_loads_back_into_the_trainers_model(exported):
    model, folder, _ = exported
    again, about = load_exported(folder)
    assert about["steps"] == 7 and about["model"]["dim"] == CONFIG.dim
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_the_tokenizer_renders_and_encodes_what_gold_trains_on(exported):
    from transformers import AutoTokenizer

    _, folder, tokenizer = exported
    loaded = AutoTokenizer.from_pretrained(folder)
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "how do I reset my password"},
        {"role": "assistant", "content": "open settings then security"},
    ]
    rendered = loaded.apply_chat_template(turns, tokenize=False)
    assert rendered == prefix_text("be brief", turns[1]["content"]) + response_text(
        turns[2]["content"]
    )
    prompt = loaded.apply_chat_template(turns[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == prefix_text("be brief", turns[1]["content"])
    record = pl.DataFrame(
        {"record_id": ["r"], "system": ["be brief"], "prompt": [turns[1]["content"]]}
        | {"response": [turns[2]["content"]]}
    )
    gold = encode_records(tokenizer, record)["input_ids"][0].to_list()
    assert loaded(rendered, add_special_tokens=False)["input_ids"] == gold


def test_generate_stops_at_the_end_of_the_turn(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, folder, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stops = GenerationConfig.from_pretrained(folder).eos_token_id
    assert stops == tokenizer.convert_tokens_to_ids([END, EOS])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "thanks that worked"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_the_answer_export_prints_is_the_trainers_models_greedy_answer(exported):
    model, folder, tokenizer = exported
    prompt = "thanks that worked"
    ids, stops, answer = encode_prompts(tokenizer, [prompt])[0], {END, EOS}, []
    with torch.no_grad():
        for _ in range(6):
            row = torch.tensor([ids + answer])
            token = int(model(row, torch.arange(row.shape[1])[None])[0, -1].argmax())
            if tokenizer.id_to_token(token) in stops:
                break
            answer.append(token)
    expected = tokenizer.decode(answer, skip_special_tokens=True)
    assert generate_answer(folder, prompt, max_new_tokens=6) == expected
