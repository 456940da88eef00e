"""The user's own scorers (the quality-models setting): model scores as silver columns.

A scorer is a Hugging Face sequence-classification folder (a regression head such as
FineWeb-Edu's, a multi-class classifier, a reward model with one logit) or a fastText file
(``.bin`` / ``.ftz``). It writes ``score_<name>`` on every record it judges; with ``min``, a record
below it is rejected with the stage ``quality_model`` and the scorer's name, score and threshold.

The classes here are Ray Data callable classes (their constructor loads the model once per actor,
``__call__`` takes a batch and returns it with a column added), and run as plain objects in the
step's process just the same. A Hugging Face scorer is two stages, as in NeMo Curator: tokenizing
(``Tokenize``, CPU) and scoring (``SequenceClassifierScorer``), which sorts its batch by length
and scores it in fixed-size sub-batches, so that padding stays small and scores do not depend on
how records were batched.

Not wired yet: silver does not run these stages (see docs/silver.md).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

REJECT_REASON = "quality_model"
TEXTS = ("response", "prompt", "conversation")
FASTTEXT_SUFFIXES = (".bin", ".ftz")
FASTTEXT_LABEL_PREFIX = "__label__"
_FIELDS = {"name", "model", "text", "min", "label", "margin"}
_NAME = re.compile(r"[a-z0-9_]+")


class ScorerError(ValueError):
    """A scorer that cannot run: refused before any batch is scored."""


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    model: str  # a sequence-classification folder or a fastText file
    text: str = "response"  # which text it judges: one of TEXTS
    min: float | None = None  # records scoring below it are rejected
    label: str | None = None  # the class whose probability is the score
    # preference pairs: reject a pair whose rejected answer outscores its chosen by more than this
    margin: float | None = None

    @property
    def column(self) -> str:
        return f"score_{self.name}"

    @property
    def tokens_column(self) -> str:
        return f"tokens_{self.name}"


# --- The setting ---------------------------------------------------------------------------------


# The setting is PIPELINE_QUALITY_MODELS; ``setting`` names it in messages. It is not a literal
# here: settings.py is the one place that names a variable (test_settings checks it).
def parse_scorers(value: str | list, setting: str = "quality models") -> list[ScorerSpec]:
    """The scorers of the setting's JSON list (or of the list itself)."""
    entries = _json_list(value, setting) if isinstance(value, str) else value
    if not isinstance(entries, list):
        raise ValueError(f"{setting} must be a JSON list, got {type(entries).__name__}")
    specs = [_spec(f"{setting} entry {index}", entry) for index, entry in enumerate(entries)]
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{setting}: scorer names must be unique, {repeated} repeat")
    return specs


def _json_list(value: str, setting: str) -> Any:
    try:
        return json.loads(value or "[]")
    except json.JSONDecodeError as error:
        raise ValueError(f"{setting} is not valid JSON: {error}") from None


def _spec(where: str, entry: Any) -> ScorerSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object, got {entry!r}")
    where = f"{where} ({entry.get('name')!r})"
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(_FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: 'name' must be lower-case letters, digits or '_', got {name!r}")
    if name == "chosen" or name.endswith("rejected"):
        raise ValueError(
            f"{where}: 'name' {name!r} would name a column preference pairs already have "
            "(score_chosen, score_rejected, score_<name>_rejected)"
        )
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}: 'model' must be a model folder or fastText file, got {model!r}")
    text = entry.get("text", "response")
    if text not in TEXTS:
        raise ValueError(f"{where}: 'text' must be one of {list(TEXTS)}, got {text!r}")
    threshold = entry.get("min")
    if threshold is not None and not _is_number(threshold):
        raise ValueError(f"{where}: 'min' must be a number, got {threshold!r}")
    label = entry.get("label")
    if label is not None and (not isinstance(label, str) or not label):
        raise ValueError(f"{where}: 'label' must be a class name, got {label!r}")
    margin = entry.get("margin")
    if margin is not None and (not _is_number(margin) or margin < 0):
        raise ValueError(f"{where}: 'margin' must be a number, zero or more, got {margin!r}")
    return ScorerSpec(
        name,
        model,
        text,
        None if threshold is None else float(threshold),
        label,
        None if margin is None else float(margin),
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# --- Batches: Ray Data's dict of arrays, or a pandas or polars frame ----------------------------


def _column(batch: Any, name: str) -> list:
    if name not in batch:
        raise KeyError(f"the batch has no column {name!r}")
    values = batch[name]
    return values.to_list() if hasattr(values, "to_list") else list(values)


def _with_column(batch: Any, name: str, values: np.ndarray | list) -> Any:
    if isinstance(batch, dict):
        return {**batch, name: values}
    if isinstance(batch, pl.DataFrame):
        return batch.with_columns(pl.Series(name, values))
    return batch.assign(**{name: values})  # pandas


def _without_column(batch: Any, name: str) -> Any:
    if isinstance(batch, dict):
        return {key: value for key, value in batch.items() if key != name}
    if isinstance(batch, pl.DataFrame):
        return batch.drop(name)
    return batch.drop(columns=[name])


# --- Hugging Face sequence classifiers -----------------------------------------------------------


@dataclass(frozen=True)
class ClassifierHead:
    """How a classifier's logits become one score: the single logit, or ``label``'s softmax
    probability (``label_index``)."""

    num_labels: int
    label_index: int | None

    def score(self, logits):
        import torch

        logits = logits.float()
        if self.label_index is None:
            return logits[:, 0]
        return torch.softmax(logits, dim=-1)[:, self.label_index]


def classifier_head(folder: str | Path, label: str | None) -> ClassifierHead:
    """Reads the folder's config: refuses a folder that is not a sequence classifier, a ``label``
    it does not have, and a multi-class model without a ``label``."""
    from transformers import AutoConfig

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ScorerError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ScorerError(
            f"{folder} is not a sequence classifier: its architectures are {architectures}; "
            "a scorer needs a *ForSequenceClassification model"
        )
    labels = [config.id2label[index] for index in sorted(config.id2label)]
    if label is not None and label not in labels:
        raise ScorerError(f"{folder} has no label {label!r}; its labels are {labels}")
    if len(labels) == 1:
        return ClassifierHead(1, None)
    if label is None:
        raise ScorerError(
            f"{folder} has {len(labels)} labels {labels}: set 'label' to the class to score"
        )
    return ClassifierHead(len(labels), labels.index(label))


def encode_texts(tokenizer, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text, the model's own special tokens (CLS, SEP, BOS) added around it.
    A special token's spelling inside the text stays plain text."""
    if not texts:
        return []  # a fast tokenizer fails on an empty batch
    limit = max_length or _model_max_length(tokenizer)
    encoded = tokenizer(
        list(texts),
        add_special_tokens=True,
        truncation=limit is not None,
        max_length=limit,
        split_special_tokens=True,
    )
    return [list(ids) for ids in encoded["input_ids"]]


def _model_max_length(tokenizer) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 1_000_000 else None


class Tokenize:
    """The CPU stage before a Hugging Face scorer: ``tokens_<name>`` from the judged text."""

    def __init__(self, spec: ScorerSpec, text_column: str | None = None, max_length=None):
        from transformers import AutoTokenizer

        self.spec = spec
        self.text_column = text_column or spec.text
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)

    def __call__(self, batch):
        ids = encode_texts(self.tokenizer, _column(batch, self.text_column), self.max_length)
        return _with_column(batch, self.spec.tokens_column, _ragged(ids))


def _ragged(rows: list[list[int]]) -> np.ndarray:
    """A column of variable-length id lists (an object array, as Ray Data's numpy batches hold)."""
    column = np.empty(len(rows), dtype=object)
    column[:] = [np.asarray(row, dtype=np.int64) for row in rows]
    return column


class SequenceClassifierScorer:
    """Scores ``tokens_<name>`` into ``score_<name>`` (and drops the tokens).

    The batch is sorted by length and scored ``batch_size`` records at a time, each sub-batch
    padded to its longest record only, then put back in the batch's order. fp32 unless ``dtype``
    asks for bf16/fp16, which only a CUDA device may.
    """

    def __init__(self, spec: ScorerSpec, batch_size: int = 32, device: str = "cpu", dtype=None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = dtype or torch.float32
        if dtype != torch.float32 and not str(device).startswith("cuda"):
            raise ScorerError(f"scorer {spec.name!r}: {dtype} runs on CUDA only; use fp32 on CPU")
        self.spec, self.batch_size, self.device = spec, batch_size, torch.device(device)
        self.head = classifier_head(spec.model, spec.label)
        model = AutoModelForSequenceClassification.from_pretrained(spec.model, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.pad_id = _pad_id(self.model, AutoTokenizer.from_pretrained(spec.model))

    def __call__(self, batch):
        scores = self.score_ids(_column(batch, self.spec.tokens_column))
        return _without_column(
            _with_column(batch, self.spec.column, scores), self.spec.tokens_column
        )

    def score_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        import torch

        lengths = np.array([len(row) for row in ids], dtype=np.int64)
        order = np.argsort(lengths, kind="stable")
        scores = np.empty(len(ids), dtype=np.float64)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                input_ids, mask = self._padded([ids[row] for row in rows], lengths[rows].max())
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits
                scores[rows] = self.head.score(logits).cpu().numpy()
        return scores

    def _padded(self, rows: list, width: int):
        import torch

        input_ids = torch.full((len(rows), int(width)), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), int(width)), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = torch.tensor(np.asarray(row), dtype=torch.long)
            mask[index, : len(row)] = 1
        return input_ids.to(self.device), mask.to(self.device)


def _pad_id(model, tokenizer) -> int:
    """The id that pads a sub-batch. A decoder classifier reads its last non-pad token, so the
    model's config must know it: a tokenizer's pad token is given to a config without one."""
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


# --- fastText ------------------------------------------------------------------------------------


class FastTextScorer:
    """Scores the judged text with a fastText classifier: ``label``'s probability, as its
    ``predict`` gives it. fastText reads one line: newlines in the text become spaces."""

    def __init__(self, spec: ScorerSpec, text_column: str | None = None):
        import fasttext

        path = Path(spec.model)
        labels = fasttext_labels(path)
        if spec.label is None:
            raise ScorerError(f"scorer {spec.name!r}: set 'label' to one of {labels}")
        self.label = _prefixed(spec.label)
        if self.label not in labels:
            raise ScorerError(f"{path} has no label {spec.label!r}; its labels are {labels}")
        try:
            self.model = fasttext.load_model(str(path))
        except ValueError as error:
            raise ScorerError(f"{path} does not load as a fastText model: {error}") from None
        self.spec, self.text_column = spec, text_column or spec.text

    def __call__(self, batch):
        return _with_column(
            batch, self.spec.column, self.score_texts(_column(batch, self.text_column))
        )

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        # One line at a time: fasttext-predict's list form returns labels without probabilities.
        return np.array([self._score(text.replace("\n", " ")) for text in texts], dtype=np.float64)

    def _score(self, line: str) -> float:
        labels, probabilities = self.model.predict(line, k=-1, threshold=0.0)
        return float(dict(zip(labels, probabilities)).get(self.label, 0.0))


def _prefixed(label: str) -> str:
    return label if label.startswith(FASTTEXT_LABEL_PREFIX) else FASTTEXT_LABEL_PREFIX + label


def fasttext_labels(path: str | Path) -> list[str]:
    """The labels in a fastText model's dictionary, read from its header (the ``fasttext`` module
    installed, fasttext-predict, does not list them). Refuses a file that is not a fastText
    model."""
    path = Path(path)
    if path.suffix not in FASTTEXT_SUFFIXES or not path.is_file():
        raise ScorerError(f"{path} is not a fastText model file ({'/'.join(FASTTEXT_SUFFIXES)})")
    with path.open("rb") as stream:
        try:
            return _header_labels(stream)
        except (struct.error, UnicodeDecodeError, ValueError) as error:
            raise ScorerError(f"{path} does not load as a fastText model: {error}") from None


FASTTEXT_MAGIC = 793712314
FASTTEXT_VERSION = 12
_ARGS = struct.Struct("<12id")  # dim ws epoch minCount neg wordNgrams loss model bucket minn maxn
# lrUpdateRate, t
_DICTIONARY = struct.Struct("<3i2q")  # size nwords nlabels ntokens pruneidx_size
_ENTRY_TAIL = struct.Struct("<qb")  # count, type (0 word, 1 label)


def _header_labels(stream) -> list[str]:
    magic, version = struct.unpack("<2i", stream.read(8))
    if magic != FASTTEXT_MAGIC or version > FASTTEXT_VERSION:
        raise ValueError("wrong file format (magic number or version)")
    stream.read(_ARGS.size)
    size, _, nlabels, _, _ = _DICTIONARY.unpack(stream.read(_DICTIONARY.size))
    labels = []
    for _ in range(size):
        word = _null_terminated(stream)
        _, kind = _ENTRY_TAIL.unpack(stream.read(_ENTRY_TAIL.size))
        if kind == 1:
            labels.append(word)
    if len(labels) != nlabels:
        raise ValueError(f"the dictionary holds {len(labels)} labels, its header says {nlabels}")
    return labels


def _null_terminated(stream) -> str:
    chars = bytearray()
    while (byte := stream.read(1)) != b"\0":
        if not byte:
            raise ValueError("the dictionary ends inside a word")
        chars += byte
    return chars.decode("utf-8")


# --- Loading any scorer, and its threshold --------------------------------------------------------


def is_fasttext(spec: ScorerSpec) -> bool:
    return Path(spec.model).suffix in FASTTEXT_SUFFIXES


def check_scorer(spec: ScorerSpec) -> None:
    """Refuses, with a message, a scorer that cannot run, without loading its weights."""
    if is_fasttext(spec):
        labels = fasttext_labels(spec.model)
        if spec.label is None or _prefixed(spec.label) not in labels:
            raise ScorerError(
                f"scorer {spec.name!r}: 'label' must be one of {labels}, got {spec.label!r}"
            )
    elif Path(spec.model).is_dir():
        classifier_head(spec.model, spec.label)
    else:
        raise ScorerError(
            f"scorer {spec.name!r}: {spec.model} is neither a Hugging Face model folder nor a "
            f"fastText file ({'/'.join(FASTTEXT_SUFFIXES)})"
        )


def below_threshold(
    frame: pl.DataFrame, spec: ScorerSpec
) -> tuple[pl.DataFrame, pl.DataFrame | None, dict]:
    """A stage function (``lib.stages``): keeps records scoring at least ``spec.min`` (all of
    them without one), and removes the others with the scorer's name, score and threshold."""
    if spec.min is None:
        return frame, None, {}
    below = pl.col(spec.column) < spec.min
    removed = frame.filter(below).with_columns(
        stage=pl.lit(REJECT_REASON),
        evidence=pl.struct(
            scorer=pl.lit(spec.name), score=pl.col(spec.column), min=pl.lit(spec.min)
        ).struct.json_encode(),
    )
    return frame.filter(~below | below.is_null()), removed, {}
