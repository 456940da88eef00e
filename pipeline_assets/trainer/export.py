"""The trained model as a Hugging Face folder: what the registry stores and users serve.

The built-in architecture is Llama's (RMSNorm before each sublayer, rotary positions on the two
halves of each head, SwiGLU, tied embeddings, no biases), so it exports as ``LlamaForCausalLM``:
``config.json`` and ``model.safetensors`` under transformers' names, which ``AutoModelForCausalLM``
and vLLM load as they are. ``pipeline.json`` beside them holds what the pipeline knows about the
run (the preset's config, the snapshot, its losses). The tokenizer's files are written by whoever
holds the tokenizer (``lib.gold.tokenizer.save_hf_tokenizer``).

A model trained from a Hugging Face base model (``--base-model``) exports as its own family
(``save_hf_exported``): the base model's config.json, the weights in the base model's dtype under
their transformers names (sharded with an index past ``MAX_SHARD_SIZE``), and pipeline.json with
``"backend": "huggingface"``. Rank 0 writes it from the full state dict gathered to its CPU one
parameter at a time: any checkpoint store works (S3, a node's own scratch disk), where DCP's
``HuggingFaceStorageWriter`` would consolidate every rank's files from a disk they all share.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline_assets.trainer.config import EXPORT_ABOUT, ModelConfig, exported_config
from pipeline_assets.trainer.hf_model import HuggingFaceLM, build_local, is_hf_folder
from pipeline_assets.trainer.model import Transformer

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"  # transformers' own default for save_pretrained
CONFIG = "config.json"
TIED = "output.weight"  # the output layer shares the embedding's weights; stored once
_LAYER_NAMES = {  # ours (in blocks.<i>.) -> transformers' (in model.layers.<i>.)
    "attention_norm.weight": "input_layernorm.weight",
    "attention.out.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight",
    "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")


def save_exported(
    full_state: dict[str, torch.Tensor], model_config: ModelConfig, folder: Path, about: dict
) -> list[str]:
    """Write the weights (safetensors: no pickle, safe to load), transformers' config and the
    pipeline's; returns the file names."""
    tensors = {name: t.contiguous() for name, t in to_transformers(full_state).items()}
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    config = json.dumps(llama_config(model_config), indent=2, sort_keys=True)
    (folder / CONFIG).write_text(config + "\n")
    pipeline = {"model": dataclasses.asdict(model_config), "tied_embeddings": True, **about}
    (folder / EXPORT_ABOUT).write_text(json.dumps(pipeline, indent=2, sort_keys=True))
    return [WEIGHTS, CONFIG, EXPORT_ABOUT]


def save_hf_exported(
    full_state: dict[str, torch.Tensor],
    config,
    folder: Path,
    about: dict,
    skip: set[str] = frozenset(),
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> list[str]:
    """A Hugging Face backend's model as its family's folder: ``full_state`` under transformers'
    names (``skip``: the tied output layer, stored once as the embedding), cast to the config's
    dtype, sharded past ``max_shard_size``; ``config`` (the base model's, ``architectures``
    included) and pipeline.json. Returns the file names."""
    from huggingface_hub import save_torch_state_dict

    dtype = _config_dtype(config)
    tensors = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in full_state.items()
        if name not in skip
    }
    save_torch_state_dict(tensors, folder, max_shard_size=max_shard_size)
    config.save_pretrained(folder)
    (folder / EXPORT_ABOUT).write_text(json.dumps(about, indent=2, sort_keys=True))
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    index = [WEIGHTS_INDEX] if (folder / WEIGHTS_INDEX).is_file() else []
    return [*weights, *index, CONFIG, EXPORT_ABOUT]


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def llama_config(model_config: ModelConfig) -> dict:
    """What transformers' ``LlamaConfig`` of the built-in model writes to config.json, built here:
    importing transformers for it cost every export about a CPU second (a test checks the two
    agree)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": model_config.ffn_dim,
        "num_hidden_layers": model_config.n_layers,
        "num_attention_heads": model_config.n_heads,
        "num_key_value_heads": model_config.n_heads,
        "head_dim": model_config.dim // model_config.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": model_config.max_seq_len,
        "rms_norm_eps": model_config.norm_eps,
        "rope_parameters": {"rope_theta": model_config.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "transformers_version": version("transformers"),
    }


def to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under LlamaForCausalLM's names: the fused qkv split into q, k and v (its
    rows are q's, then k's, then v's), the tied output left out."""
    out = {"model.embed_tokens.weight": state["embedding.weight"]}
    out["model.norm.weight"] = state["norm.weight"]
    for name, tensor in state.items():
        if not name.startswith("blocks."):
            continue
        _, index, rest = name.split(".", 2)
        prefix = f"model.layers.{index}."
        if rest == "attention.qkv.weight":
            for projection, part in zip(_QKV, tensor.chunk(3, dim=0), strict=True):
                out[f"{prefix}self_attn.{projection}.weight"] = part
        else:
            out[prefix + _LAYER_NAMES[rest]] = tensor
    return out


def from_transformers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``to_transformers``."""
    ours = {theirs: mine for mine, theirs in _LAYER_NAMES.items()}
    state = {"embedding.weight": tensors["model.embed_tokens.weight"]}
    state["norm.weight"] = tensors["model.norm.weight"]
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not name.startswith("model.layers."):
            continue
        _, _, index, rest = name.split(".", 3)
        projection = rest.split(".")[1] if rest.startswith("self_attn.") else None
        if projection in _QKV:
            qkv.setdefault(index, {})[projection] = tensor
        else:
            state[f"blocks.{index}.{ours[rest]}"] = tensor
    for index, parts in qkv.items():
        state[f"blocks.{index}.attention.qkv.weight"] = torch.cat([parts[p] for p in _QKV])
    return state


def load_exported(folder: Path, device: str = "cpu") -> tuple[Transformer | HuggingFaceLM, dict]:
    """The model and the pipeline's config from an exported folder: the built-in model, or a Hugging
    Face model (this trainer's export of a base model, or any HF folder, whose config is then
    empty) behind the same interface."""
    if is_hf_folder(folder):
        about = Path(folder) / EXPORT_ABOUT
        return build_local(folder, device), exported_config(folder) if about.is_file() else {}
    config = exported_config(folder)
    model = Transformer(ModelConfig(**config["model"]))
    load_weights(model, folder, device)
    return model.to(device), config


def load_weights(model: Transformer, folder: Path, device: str = "cpu") -> None:
    """Copy an exported folder's weights into ``model`` (of the same architecture)."""
    tensors = load_file(str(Path(folder) / WEIGHTS), device=device)
    missing, unexpected = model.load_state_dict(from_transformers(tensors), strict=False)
    if unexpected or set(missing) - {TIED}:
        raise ValueError(
            f"{folder} does not match its config: missing {missing}, unexpected {unexpected}"
        )


def generate_answer(folder: Path, prompt: str, max_new_tokens: int = 32) -> str:
    """The exported model's greedy answer to ``prompt``, loaded and rendered as a user of
    transformers would: ``AutoModelForCausalLM``, ``AutoTokenizer`` and the folder's chat
    template; generation stops at its ``generation_config.json``'s end of turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    answer = generated[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(answer, skip_special_tokens=True)
