"""Tiny pretrained-model folders as a user brings them: a transformers causal LM built from a config
(random weights: no package ships causal-LM weights), a BPE tokenizer trained here, and a real
family's chat template without generation markers."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
CHATML_SPECIALS = {"eos": "<|im_end|>", "pad": "<|endoftext|>", "extra": ["<|im_start|>"]}
LLAMA3_SPECIALS = {
    "bos": "<|begin_of_text|>",
    "eos": "<|eot_id|>",
    "pad": "<|end_of_text|>",
    "extra": ["<|start_header_id|>", "<|end_header_id|>"],
}
_TEXT = [
    "How do I reset my password? Open settings, choose security, then reset the password.",
    "The order ships in two days; you can track it from the account page.",
    "Refunds go back to the card you paid with within five working days.",
] * 20


def trained_tokenizer(specials: dict, template: str, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few sentences, its special tokens added whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = [specials[k] for k in ("bos", "eos", "pad") if k in specials]
    tokens = [*named, *specials["extra"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_TEXT, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=specials.get("bos"),
        eos_token=specials["eos"],
        pad_token=specials["pad"],
        chat_template=template,
    )


# every tiny model's shape: two layers of width 32, four heads, 256 positions
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def qwen2_folder(folder: Path, **config) -> Path:
    """A Qwen2 with grouped-query attention and untied embeddings, ChatML template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = trained_tokenizer(CHATML_SPECIALS, CHATML)
    settings = dict(
        vocab_size=len(tokenizer) + 4,
        **TINY,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    return _saved(folder, Qwen2ForCausalLM(Qwen2Config(**{**settings, **config})), tokenizer)


def llama_folder(folder: Path, **config) -> Path:
    """A Llama with tied embeddings, Llama-3-style template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = trained_tokenizer(LLAMA3_SPECIALS, LLAMA3)
    settings = dict(
        vocab_size=len(tokenizer),
        **TINY,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return _saved(folder, LlamaForCausalLM(LlamaConfig(**{**settings, **config})), tokenizer)


def _saved(folder: Path, model, tokenizer) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def assert_servable(folder: Path) -> None:
    """transformers loads the folder as it is, renders the chat template and generates from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How do I reset my password?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def classifier_folder(folder, **config):
    """A tiny Qwen2 sequence classifier with a ChatML tokenizer trained here, saved in ``folder``
    (``num_labels=1``: a reward model's shape)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    tokenizer = trained_tokenizer(CHATML_SPECIALS, CHATML)
    settings = dict(
        vocab_size=len(tokenizer),
        **TINY,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForSequenceClassification(Qwen2Config(**{**settings, **config}))
    return _saved(folder, model, tokenizer)


def classifier_scores(folder: Path, texts: list[str], label_index: int | None = None) -> list:
    """A sequence classifier on one text at a time, no padding and no mask, as a user scores a
    record by hand: its one logit, or ``label_index``'s softmax probability."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pipeline_assets.lib.silver.scorers import encode_texts

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    with torch.no_grad():
        for ids in encode_texts(tokenizer, texts):
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
            scores.append(
                float(logits[0] if label_index is None else logits.softmax(-1)[label_index])
            )
    return scores
