"""The user's pretrained Hugging Face causal LM (the base model): what it is, and whether the
pipeline can post-train it, decided before any training starts.

A base model is a folder as ``save_pretrained`` writes it: ``config.json``, safetensors weights
(one file, or shards with ``model.safetensors.index.json``), the tokenizer's files and a chat
template (in ``tokenizer_config.json`` or ``chat_template.jinja``). ``inspect_base_model`` reads
the folder without loading any weight and refuses, naming the problem, what the trainer could not
use: a missing file, no chat template, a template whose special tokens the tokenizer lacks (user
text would be split into pieces where the model expects one token), a vocabulary smaller than the
tokenizer, an architecture transformers cannot build as a causal LM. Nothing runs the folder's own
code (``trust_remote_code`` stays off).

Its version is the sha256 of its files (names and contents), so a changed model is a new version.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.lib.gold.encoder import EncoderSpec

SHOWN_AS = "base model"  # the caller names the setting the folder came from
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What a chat template's markers look like: <|im_start|>, <|eot_id|>, <start_of_turn>, </s>.
_MARKER = re.compile(r"<\|[^<>|\s]{1,40}\|>|</?[a-z][a-z0-9_]{0,30}>")
_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]
_HASH_CHUNK = 1 << 22


class BaseModelError(ValueError):
    """The base model's folder cannot be post-trained; the message says why."""


@dataclass(frozen=True)
class BaseModel:
    path: str
    architecture: str  # e.g. Qwen2ForCausalLM
    model_type: str  # e.g. qwen2
    vocab_size: int  # rows of the embedding (config.json)
    tokenizer_size: int  # len(tokenizer), added tokens included
    parameters: int  # from the safetensors headers, no weight read
    tied_embeddings: bool
    chat_template: str
    eos_token: str | None
    version: str  # sha256 of the folder's files


def inspect_base_model(folder: str | Path, version: str | None = None) -> BaseModel:
    """The base model in ``folder``, or BaseModelError naming what makes it unusable. ``version``:
    its files' sha256 when the caller already knows it (hashing reads every weight)."""
    path = Path(folder)
    if not path.is_dir():
        raise BaseModelError(f"{SHOWN_AS} {folder}: no such folder")
    config = _config(path)
    weights = _weight_files(path)
    tokenizer = _tokenizer(path)
    if len(tokenizer) > config.vocab_size:
        raise BaseModelError(
            f"{SHOWN_AS} {folder}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocabulary (config.json vocab_size) only {config.vocab_size}: tokens past it would "
            "index no embedding"
        )
    template = _chat_template(path, tokenizer)
    return BaseModel(
        path=str(path),
        architecture=config.architectures[0],
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        tokenizer_size=len(tokenizer),
        parameters=sum(_tensor_elements(path / name) for name in weights),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        chat_template=template,
        eos_token=tokenizer.eos_token,
        version=version or folder_sha256(path),
    )


def folder_encoder_spec(folder: str | Path) -> EncoderSpec:
    """What encodes records for a Hugging Face model folder that holds its tokenizer and chat
    template (a base model, or a model post-trained from one and exported with them), as
    gold/tokenizer stores it for a base model: tokenizer.json, the template and the special tokens
    the template reads. BaseModelError when the tokenizer or its template cannot be used; no weight
    is read."""
    path = Path(folder)
    tokenizer = _tokenizer(path)
    return EncoderSpec(
        (path / "tokenizer.json").read_text(),
        _chat_template(path, tokenizer),
        json.dumps(dict(tokenizer.special_tokens_map), sort_keys=True),
    )


def folder_sha256(path: Path) -> str:
    """sha256 over every file's relative name and contents, in name order (hidden files, such as a
    cached copy's own bookkeeping, left out)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)


def _config(path: Path):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not (path / "config.json").is_file():
        raise BaseModelError(f"{SHOWN_AS} {path}: no config.json")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        raise BaseModelError(
            f"{SHOWN_AS} {path}: transformers cannot read config.json: {error}"
        ) from error
    architecture = (getattr(config, "architectures", None) or [None])[0]
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture is None or known != architecture:
        raise BaseModelError(
            f"{SHOWN_AS} {path}: architecture {architecture!r} (model_type {config.model_type!r}) "
            "is not a causal LM transformers can build here"
            + (f"; transformers builds {known} for this model_type" if known else "")
        )
    return config


def _weight_files(path: Path) -> list[str]:
    index = path / WEIGHTS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise BaseModelError(
                f"{SHOWN_AS} {path}: {WEIGHTS_INDEX} names shards that are not there: "
                + ", ".join(missing[:3])
            )
        return names
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise BaseModelError(
        f"{SHOWN_AS} {path}: no safetensors weights (model.safetensors, or shards with "
        f"{WEIGHTS_INDEX}); save the model with save_pretrained(safe_serialization=True)"
    )


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    missing = [name for name in TOKENIZER_FILES if not (path / name).is_file()]
    if missing:
        raise BaseModelError(f"{SHOWN_AS} {path}: no {' or '.join(missing)} (the tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        raise BaseModelError(
            f"{SHOWN_AS} {path}: transformers cannot load the tokenizer: {error}"
        ) from error


def _chat_template(path: Path, tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one trains
        template = template.get("default")
    if not template:
        raise BaseModelError(
            f"{SHOWN_AS} {path}: the tokenizer has no chat template (tokenizer_config.json "
            "chat_template or chat_template.jinja): records could not be rendered as the model "
            "expects its conversations"
        )
    rendered = _rendered(path, tokenizer)
    vocabulary = tokenizer.get_vocab()
    lacking = sorted({m for m in _MARKER.findall(rendered) if m not in vocabulary})
    if lacking:
        raise BaseModelError(
            f"{SHOWN_AS} {path}: the chat template writes {', '.join(lacking[:5])}, which the "
            "tokenizer does not hold as tokens"
        )
    return template


def _rendered(path: Path, tokenizer) -> str:
    """The template on a probe conversation (without its system turn, for templates that refuse
    one)."""
    errors = []
    for conversation in (_PROBE, _PROBE[1:]):
        try:
            return tokenizer.apply_chat_template(conversation, tokenize=False)
        except Exception as error:  # a template raises whatever its author wrote
            errors.append(str(error))
    raise BaseModelError(f"{SHOWN_AS} {path}: the chat template fails to render: {errors[-1]}")


def _tensor_elements(file: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header alone."""
    with file.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry["shape"]:
            count *= dim
        total += count
    return total


# What a model folder's users load its tokenizer and chat template from (those present are copied).
SERVED_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"


def copy_tokenizer_files(base: Path, out: Path, stop_ids: frozenset[int]) -> list[str]:
    """The base model's tokenizer and chat template into a trained model's folder, and its
    ``generation_config.json`` with ``eos_token_id`` holding every id a chat answer stops at (the
    template's end of turn: a base model's own config often names only its end of text). Returns
    the files written."""
    written = []
    for name in SERVED_TOKENIZER_FILES:
        if (base / name).is_file():
            (out / name).write_bytes((base / name).read_bytes())
            written.append(name)
    generation = base / GENERATION_CONFIG
    config = json.loads(generation.read_text()) if generation.is_file() else {}
    eos = config.get("eos_token_id")
    known = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    config["eos_token_id"] = sorted(known | set(stop_ids))
    (out / GENERATION_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [*written, GENERATION_CONFIG]
