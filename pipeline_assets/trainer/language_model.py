"""What decoding, the RL learner and its policy store use of a model, whichever backend holds it:
the built-in ``model.Transformer`` or the user's Hugging Face model, ``hf_model.HuggingFaceLM``.

Both are ``nn.Module``s that take packed rows (``position_ids`` restarting at 0 at each document)
and answer the same calls; ``export.load_exported`` builds either from its folder, and ``save``
writes the folder it reads back. Code that holds a ``LanguageModel`` never asks which backend it
is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch


class LanguageModel(Protocol):
    training: bool

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt and answer together) the model takes."""
        ...

    @property
    def device(self) -> torch.device:
        """Where its weights are, hence where its inputs go."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, next_token_losses: bool = False
    ) -> torch.Tensor:
        """Logits (B, T, V); with ``next_token_losses``, each target's cross-entropy (B, T-1),
        computed a chunk of tokens at a time (``trainer.losses``)."""
        ...

    def save(self, folder: Path, about: dict) -> list[str]:
        """This process's whole model written to ``folder`` as its backend exports it, ``about``
        in pipeline.json; the names of the files written."""
        ...

    def parameters(self, recurse: bool = True): ...

    def train(self, mode: bool = True) -> LanguageModel: ...

    def eval(self) -> LanguageModel: ...
