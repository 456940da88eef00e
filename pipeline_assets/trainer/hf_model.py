"""The user's pretrained Hugging Face causal LM as the trainer's model (``--base-model DIR``).

``DIR`` is a folder as ``save_pretrained`` writes it (config.json, safetensors in one file or in
shards with an index). The model is built from its config on the meta device (nothing runs the
folder's own code), sharded with FSDP2 (each decoder layer a unit, then the root), materialized
empty on the device, and its weights are read with DCP's ``HuggingFaceStorageReader`` straight into
each rank's shards: no rank ever holds a full copy. Rotary tables are buffers that no file holds;
they are computed again after materializing.

Packed rows are isolated only when the model gets ``position_ids`` restarting at 0 at each
document, no attention mask and ``use_cache=False`` (with a cache or an all-ones mask transformers
does not detect the packing and documents attend to each other): ``HuggingFaceLM.forward`` is the
one place that calls the model, and always calls it that way.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy

from pipeline_assets.trainer.config import EXPORT_ABOUT
from pipeline_assets.trainer.losses import next_token_losses as chunked_next_token_losses
from pipeline_assets.trainer.parallel import attention_kernel, shard_model

BACKEND = "huggingface"  # pipeline.json's "backend" for an export of this backend
SDPA, FLEX, FLASH = "sdpa", "flex_attention", "flash_attention_2"
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer
# What a HF-family forward may do to the logits after the output layer, which the chunked loss
# (hidden states times the output weight) would leave out.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def is_hf_folder(folder: str | Path) -> bool:
    """A Hugging Face model folder: this backend's export, or any folder ``save_pretrained``
    wrote; not the built-in backend's export (whose pipeline.json names a preset's ``model``)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        return False
    about = path / EXPORT_ABOUT
    return not about.is_file() or json.loads(about.read_text()).get("backend") == BACKEND


def hf_starting_folder(base_model: str, init_from: str) -> str:
    """The Hugging Face folder a run builds its model from: ``init_from`` when it is one (a
    Hugging Face backend's export, e.g. the SFT champion DPO starts from), else ``base_model``;
    empty for the built-in backend."""
    if init_from and is_hf_folder(init_from):
        return init_from
    if base_model and init_from:
        raise ValueError(
            f"--init-from {init_from} is the built-in model's export; a --base-model run starts "
            "from the base model or from a Hugging Face folder"
        )
    return base_model


def base_model_facts(folder: str | Path, config) -> dict:
    """What an export's pipeline.json says about its base model: the one the folder's own
    pipeline.json names (a run starting from an earlier export), else the folder itself."""
    about = Path(folder) / EXPORT_ABOUT
    if about.is_file():
        earlier = json.loads(about.read_text())
        if "base_model" in earlier:
            return {"base_model": earlier["base_model"], "base_config": earlier["base_config"]}
    return {"base_model": str(folder), "base_config": config.to_dict()}


def read_config(folder: str | Path):
    """The folder's transformers config (never its own code: ``trust_remote_code`` stays off)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def attention_implementation(setting: str, device: torch.device, config) -> str:
    """transformers' attention for ``--attention``: ``auto`` is flash-attn 2 on a CUDA device that
    runs it when the package is installed, else FlexAttention where it trains (CUDA, heads of at
    least 16 channels), else SDPA; ``flex`` and ``dense`` pick FlexAttention and SDPA."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kernel = attention_kernel(setting, device, head_dim)
    if setting == "auto" and _flash_attention_runs(device):
        return FLASH
    return FLEX if kernel == "flex" else SDPA


def _flash_attention_runs(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and importlib.util.find_spec("flash_attn") is not None
        and torch.cuda.get_device_capability(device) >= FLASH_MIN_CAPABILITY
    )


class HuggingFaceLM(nn.Module):
    """A transformers causal LM behind the built-in model's interface: ``model(input_ids,
    position_ids)`` gives logits, ``next_token_losses=True`` the per-token losses (chunked)."""

    def __init__(self, config, attn_implementation: str = SDPA):
        super().__init__()
        from transformers import AutoModelForCausalLM

        transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None)]
        if transforms:
            raise ValueError(
                f"{config.model_type} transforms its logits ({', '.join(transforms)}), which the "
                "trainer's chunked loss does not reproduce: this family cannot be trained here"
            )
        self.lm = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=attn_implementation, dtype=torch.float32
        )
        self.attn_implementation = attn_implementation

    @property
    def hf_config(self):
        return self.lm.config

    @property
    def max_seq_len(self) -> int:
        return self.hf_config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.lm.get_input_embeddings().weight.device

    def save(self, folder: Path, about: dict) -> list[str]:
        """This model (in this process, unsharded) as its family's folder
        (``export.save_hf_exported``), in the precision it holds its weights in: a policy version
        is exactly what the RL learner trains, and resumes from it."""
        from pipeline_assets.trainer.export import save_hf_exported  # export imports this module

        config = copy.deepcopy(self.hf_config)
        config.dtype = self.lm.get_input_embeddings().weight.dtype
        config.architectures = [type(self.lm).__name__]  # as save_pretrained writes it
        state = {name: tensor.detach().cpu() for name, tensor in self.lm.state_dict().items()}
        return save_hf_exported(
            state, config, folder, {**about, "backend": BACKEND}, skip=self.tied_keys()
        )

    @property
    def blocks(self) -> list[nn.Module]:
        """The decoder layers: FSDP2's units (``parallel.shard_model``)."""
        names = set(self.lm._no_split_modules or ())
        return [module for module in self.lm.modules() if type(module).__name__ in names]

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, next_token_losses: bool = False
    ) -> torch.Tensor:
        if not next_token_losses:
            return self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        hidden = self.lm.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = self.lm.get_output_embeddings()
        return chunked_next_token_losses(hidden, head.weight, input_ids, head.bias)

    def tied_keys(self) -> set[str]:
        """State-dict names that are another parameter (a tied output layer): never read or
        written on their own."""
        if not getattr(self.hf_config, "tie_word_embeddings", False):
            return set()
        return set(self.lm.all_tied_weights_keys)


def build_sharded(
    folder: str | Path,
    config,
    attn_implementation: str,
    device: torch.device,
    policy: MixedPrecisionPolicy,
) -> HuggingFaceLM:
    """The model of ``folder`` with its weights, FSDP2-sharded over the process group."""
    with torch.device("meta"):
        model = HuggingFaceLM(config, attn_implementation)
    model = shard_model(model, policy)
    model.to_empty(device=device)
    _refresh_buffers(model, device)
    load_weights(model, folder)
    return model


def build_local(folder: str | Path, device: torch.device | str = "cpu") -> HuggingFaceLM:
    """The model of ``folder`` in this process, unsharded (scoring, evaluation): SDPA attention."""
    from safetensors.torch import load_file

    model = HuggingFaceLM(read_config(folder), SDPA)
    state = {}
    for file in weight_files(Path(folder)):
        state.update(load_file(str(file)))
    missing, unexpected = model.lm.load_state_dict(state, strict=False)
    if set(missing) - model.tied_keys() or unexpected:
        raise ValueError(
            f"{folder} does not match its config: missing {sorted(missing)}, unexpected "
            f"{sorted(unexpected)}"
        )
    return model.to(device).eval()


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return [folder / "model.safetensors"]


def load_weights(model: HuggingFaceLM, folder: str | Path) -> None:
    """Read the folder's safetensors into the model's (sharded) parameters, in place: each rank
    reads only the slices it holds."""
    state = {
        name.removeprefix("lm."): tensor
        for name, tensor in get_model_state_dict(model).items()
        if name.removeprefix("lm.") not in model.tied_keys()
    }
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))


def _refresh_buffers(model: HuggingFaceLM, device: torch.device) -> None:
    """Compute again the buffers ``to_empty`` left uninitialised: the rotary tables, rebuilt by a
    fresh rotary module from the same config. Any other non-persistent buffer is refused: no file
    holds it and nothing here could rebuild it."""
    rebuilt = set()
    for name, module in model.named_modules():
        if "RotaryEmbedding" in type(module).__name__:
            fresh = type(module)(module.config)
            for buffer_name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, buffer_name, buffer.to(device))
                rebuilt.add(f"{name}.{buffer_name}")
    persistent = set(model.state_dict())
    for name, _ in model.named_buffers():
        if name not in persistent and name not in rebuilt:
            raise ValueError(
                f"the model keeps a computed buffer {name} that the trainer cannot rebuild after "
                "building on the meta device"
            )


def parameter_counts(model: HuggingFaceLM) -> tuple[int, int]:
    """(every parameter once, the input embedding's)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values()), model.lm.get_input_embeddings().weight.numel()


def flops_per_token(model: HuggingFaceLM, seq_len: int) -> float:
    """Training FLOPs per token as ``model.flops_per_token`` counts the built-in's: 6 per weight
    that multiplies (every parameter but the input embedding, a lookup; the output layer counted
    even when tied to it) plus attention's scores and values, 12 x layers x attention width x
    sequence length."""
    config = model.hf_config
    total, embedding = parameter_counts(model)
    head = model.lm.get_output_embeddings().weight.numel()
    tied = getattr(config, "tie_word_embeddings", False)
    weights = total - embedding + (head if tied else 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return 6 * weights + 12 * config.num_hidden_layers * width * seq_len
