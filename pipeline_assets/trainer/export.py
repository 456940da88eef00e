"""The trained model as one consolidated safetensors file plus its config: what the registry
stores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.model import Transformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TIED = "output.weight"  # the output layer shares the embedding's weights; stored once


def save_exported(
    full_state: dict[str, torch.Tensor], model_config: ModelConfig, folder: Path, about: dict
) -> list[str]:
    """Write weights (safetensors: no pickle, safe to load) and config; returns the file names."""
    tensors = {name: tensor.contiguous() for name, tensor in full_state.items() if name != TIED}
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    config = {"model": dataclasses.asdict(model_config), "tied_embeddings": True, **about}
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return [WEIGHTS, CONFIG]


def load_exported(folder: Path, device: str = "cpu") -> tuple[Transformer, dict]:
    """The model and its config from an exported folder."""
    config = exported_config(folder)
    model = Transformer(ModelConfig(**config["model"]))
    load_weights(model, folder, device)
    return model.to(device), config


def exported_config(folder: Path) -> dict:
    return json.loads((Path(folder) / CONFIG).read_text())


def load_weights(model: Transformer, folder: Path, device: str = "cpu") -> None:
    """Copy an exported folder's weights into ``model`` (of the same architecture)."""
    missing, unexpected = model.load_state_dict(
        load_file(str(Path(folder) / WEIGHTS), device=device), strict=False
    )
    if unexpected or set(missing) - {TIED}:
        raise ValueError(
            f"{folder} does not match its config: missing {missing}, unexpected {unexpected}"
        )
