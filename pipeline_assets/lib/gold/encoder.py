"""The one seam between records and token ids: a ``ChatEncoder`` built from what gold/tokenizer
stores, of one of two kinds.

- built-in: the pipeline's own chat format (``chat_format``) and a tokenizer trained on silver or
  provided (``lib.gold.tokenizer``);
- chat template: a base model's tokenizer and Jinja chat template (``lib.gold.chat_template``).

Gold's shards (sft records and conversations), preference pairs, evaluation items and the RL
trainer's prompts all encode through it, so a record means the same ids wherever it is read.
``EncoderSpec`` is what travels (to a Ray worker, to torchrun as two files); ``chat_encoder``
builds an encoder once per process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import polars as pl

from pipeline_assets.lib.gold.chat_format import END, EOS, PAD
from pipeline_assets.lib.gold.chat_template import ChatTemplateEncoder
from pipeline_assets.lib.gold.conversations import DEFAULT_LOSS
from pipeline_assets.lib.gold.tokenizer import (
    encode_conversations,
    encode_prompts,
    encode_records,
    tokenizer_from_json,
)


class ChatEncoder(Protocol):
    kind: str
    pad_id: int  # what fills a packed row past its documents
    stop_ids: frozenset[int]  # where a generated answer ends

    def encode_records(self, frame: pl.DataFrame) -> pl.DataFrame:
        """record_id, system (nullable), prompt, response -> ``tokenizer.ENCODED_SCHEMA``: each
        record as the conversation [system], user, assistant."""
        ...

    def encode_conversations(self, frame: pl.DataFrame, loss: str = DEFAULT_LOSS) -> pl.DataFrame:
        """record_id, messages (``formats.TURNS``) -> ``tokenizer.ENCODED_SCHEMA``, the loss mask
        on the assistant turns ``loss`` names (``conversations.LOSS_MODES``) and the end-of-turn
        token of each, never on a system or user token."""
        ...

    def encode_prompts(self, prompts: Sequence[str], system: str | None = None) -> list[list[int]]:
        """Each prompt's ids up to where the assistant's answer starts."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids, special tokens left out."""
        ...


@dataclass(frozen=True)
class EncoderSpec:
    """What builds a ``ChatEncoder``: gold/tokenizer's row (hashable: the per-process cache key)."""

    tokenizer_json: str
    chat_template: str | None = None  # None: the built-in chat format
    special_tokens_json: str | None = (
        None  # {"bos_token": ..., "eos_token": ...} the template reads
    )

    @classmethod
    def from_row(cls, row: Mapping) -> EncoderSpec:
        """From a gold/tokenizer row (a table written before base models has no template
        columns)."""
        return cls(row["tokenizer_json"], row.get("chat_template"), row.get("special_tokens"))

    @property
    def sha256(self) -> str:
        """The tokenizer's hash; with a chat template, of the tokenizer, the template and its
        special tokens together (a changed template is a new version of the encoding)."""
        if self.chat_template is None:
            return hashlib.sha256(self.tokenizer_json.encode()).hexdigest()
        parts = (self.tokenizer_json, self.chat_template, self.special_tokens_json or "")
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    @property
    def special_tokens(self) -> dict[str, str]:
        return json.loads(self.special_tokens_json) if self.special_tokens_json else {}

    def template_file_text(self) -> str | None:
        """The template and its special tokens as one JSON file (what torchrun is given beside
        tokenizer.json), or None for the built-in chat format."""
        if self.chat_template is None:
            return None
        return json.dumps(
            {"chat_template": self.chat_template, "special_tokens": self.special_tokens}
        )

    @classmethod
    def from_files(cls, tokenizer_path: str | Path, template_path: str | Path = "") -> EncoderSpec:
        """tokenizer.json, and the file ``template_file_text`` wrote (empty: the built-in chat
        format)."""
        tokenizer_json = Path(tokenizer_path).read_text()
        if not str(template_path):
            return cls(tokenizer_json)
        template = json.loads(Path(template_path).read_text())
        return cls(
            tokenizer_json, template["chat_template"], json.dumps(template["special_tokens"])
        )


class BuiltinChatEncoder:
    """The built-in chat format: ``<|bos|> [<|system|>..<|end|>] <|user|>..<|end|><|assistant|>``
    then the response, ``<|end|>``; more turns repeat ``<|user|>..<|end|><|assistant|>..<|end|>``,
    and ``<|eos|>`` closes the conversation."""

    kind = "builtin"

    def __init__(self, tokenizer_json: str):
        self.tokenizer = tokenizer_from_json(tokenizer_json)
        self.pad_id = self.tokenizer.token_to_id(PAD)
        self.stop_ids = frozenset(self.tokenizer.token_to_id(token) for token in (END, EOS))

    def encode_records(self, frame: pl.DataFrame) -> pl.DataFrame:
        return encode_records(self.tokenizer, frame)

    def encode_conversations(self, frame: pl.DataFrame, loss: str = DEFAULT_LOSS) -> pl.DataFrame:
        return encode_conversations(self.tokenizer, frame, loss)

    def encode_prompts(self, prompts: Sequence[str], system: str | None = None) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, system)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@lru_cache(maxsize=4)
def chat_encoder(spec: EncoderSpec) -> ChatEncoder:
    """The spec's encoder, built once per process (a Ray worker keeps it for every block it
    runs). ValueError when a chat template cannot be used (``ChatTemplateEncoder``)."""
    if spec.chat_template is None:
        return BuiltinChatEncoder(spec.tokenizer_json)
    return ChatTemplateEncoder(spec.tokenizer_json, spec.chat_template, spec.special_tokens)
