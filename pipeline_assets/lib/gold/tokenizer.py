"""Byte-level BPE for the chat format: train, (de)serialize, validate, and tokenize records.

``encode_records`` turns silver records into one sequence each, ``prefix + response`` in the
format of ``chat_format``, with a loss mask that is 1 exactly on the response ids.
``save_hf_tokenizer`` writes the tokenizer as an exported model's users load it. No Dagster, no
torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline_assets.lib.gold.chat_format import (
    ASSISTANT,
    BOS,
    CHAT_TEMPLATE,
    END,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
)

ENCODED_SCHEMA = pl.Schema(
    {
        "record_id": pl.String,
        "input_ids": pl.List(pl.Int32),
        "loss_mask": pl.List(pl.UInt8),
        "n_tokens": pl.Int32,
        "n_response_tokens": pl.Int32,
    }
)

SPECIAL_TOKEN_PATTERN = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))

# Rows per encode_batch call: large enough to keep every core busy, small enough that reading
# the ids of one chunk in Python overlaps with encoding the next.
ENCODE_CHUNK_ROWS = 2048


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE with the chat_format special tokens at ids 0..len(SPECIAL_TOKENS)-1.

    texts may be chat-formatted: the trainer sees only the text between special tokens, as the
    encoder does. Deterministic: the same texts give a byte-identical ``tokenizer_to_json``,
    whatever the number of threads (counts are summed, ties between merges broken by pair ids).
    """
    min_vocab_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_vocab_size:
        raise ValueError(
            f"vocab_size must be at least {min_vocab_size} (special tokens + 256 bytes), got "
            f"{vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    # No normalizer and no prefix space, so that decode(encode(text)) == text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_between_special_tokens(texts), trainer=trainer)
    return tokenizer


def _between_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    # The trainer does not split out special tokens; fed "...<|end|><|eos|>" it would spend
    # merges on pieces such as "|><|" that encoding never produces.
    for text in texts:
        yield from filter(None, SPECIAL_TOKEN_PATTERN.split(text))


def tokenizer_to_json(tokenizer: Tokenizer) -> str:
    return tokenizer.to_str()


def tokenizer_from_json(text: str) -> Tokenizer:
    return Tokenizer.from_str(text)


def save_hf_tokenizer(tokenizer_json: str, folder: Path) -> list[str]:
    """The tokenizer as transformers loads it (``AutoTokenizer``), with the chat format as its chat
    template, and a ``generation_config.json`` that stops at the end of the assistant's turn;
    returns the files written."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_from_json(tokenizer_json),
        bos_token=BOS,
        eos_token=END,  # the end of a turn, where a chat model stops
        pad_token=PAD,
        additional_special_tokens=[EOS, SYSTEM, USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
    )
    written = tokenizer.save_pretrained(folder)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (END, EOS)]
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=ids, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(folder)
    return sorted({Path(name).name for name in written} | {"generation_config.json"})


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """Raise ValueError naming everything that makes the tokenizer unusable for the chat format:
    a special token that is not one id in running text, or truncation/padding left enabled."""
    problems = [
        problem for token in SPECIAL_TOKENS if (problem := _special_token_problem(tokenizer, token))
    ]
    if tokenizer.truncation is not None:
        problems.append(
            f"truncation is enabled ({tokenizer.truncation}); gold packs sequences itself"
        )
    if tokenizer.padding is not None:
        problems.append(f"padding is enabled ({tokenizer.padding}); gold packs sequences itself")
    if problems:
        raise ValueError("tokenizer is not usable with the chat format: " + "; ".join(problems))


def _special_token_problem(tokenizer: Tokenizer, token: str) -> str | None:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        return f"special token {token} is not in the vocabulary"
    # In running text, not alone: a token that is only in the vocabulary (not an added token)
    # is split by the pre-tokenizer and never produced.
    ids = tokenizer.encode(f"x{token}x", add_special_tokens=False).ids
    if token_id not in ids:
        return (
            f"special token {token} is not encoded as its single id {token_id} in text (got {ids})"
        )
    return None


def encode_records(tokenizer: Tokenizer, frame: pl.DataFrame) -> pl.DataFrame:
    """frame: record_id, system (nullable), prompt, response -> ENCODED_SCHEMA, same row order.

    input_ids are the ids of prefix_text(system, prompt) followed by those of
    response_text(response); loss_mask is 0 on the prefix and 1 on the response (+ END EOS). The
    chat markers are inserted as ids and the user's text is encoded by a copy of the tokenizer that
    reads special-token strings as plain text: a prompt that says "<|end|>" cannot end its own turn.
    For ordinary text the ids equal those of encoding the formatted strings (special tokens split
    the text).
    """
    check_required_text(frame)
    if frame.is_empty():
        return pl.DataFrame(schema=ENCODED_SCHEMA)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    systems = frame["system"].fill_null("").to_list()
    parts = (systems, frame["prompt"].to_list(), frame["response"].to_list())
    chunks = [
        _read_chunk(encodings, ids)
        for encodings in _encode_chunks(plain_text_encoder(tokenizer), *parts)
    ]
    flat_ids, n_prefix, n_response = (
        np.concatenate(values) for values in zip(*chunks, strict=True)
    )
    n_tokens = n_prefix + n_response
    offsets = np.zeros(len(n_tokens) + 1, np.int64)
    np.cumsum(n_tokens, out=offsets[1:])
    return pl.DataFrame(
        {
            "record_id": frame["record_id"],
            "input_ids": list_series(offsets, flat_ids),
            "loss_mask": list_series(offsets, _flat_loss_mask(n_prefix, n_response)),
            "n_tokens": n_tokens,
            "n_response_tokens": n_response,
        },
        schema=ENCODED_SCHEMA,
    )


def encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[str], system: str | None = None
) -> list[list[int]]:
    """Each prompt's ids up to the assistant's turn (``prefix_text``), encoded as gold encodes
    records: what a model generates its answer after."""
    frame = pl.DataFrame(
        {
            "record_id": [str(i) for i in range(len(prompts))],
            "system": [system] * len(prompts),
            "prompt": list(prompts),
            "response": [""] * len(prompts),
        },
        schema_overrides={"system": pl.String},
    )
    encoded = encode_records(tokenizer, frame)
    prefix = encoded["n_tokens"] - encoded["n_response_tokens"]
    return [
        ids[:length]
        for ids, length in zip(encoded["input_ids"].to_list(), prefix.to_list(), strict=True)
    ]


def plain_text_encoder(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of the tokenizer that encodes special-token strings in its input as ordinary text."""
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def check_required_text(frame: pl.DataFrame) -> None:
    nulls = frame.select(pl.col("prompt", "response").null_count()).row(0, named=True)
    if any(nulls.values()):
        raise ValueError(f"prompt and response must not be null, got null counts {nulls}")


def _encode_chunks(tokenizer: Tokenizer, *columns: Sequence[str]) -> Iterator[list[Encoding]]:
    """Per chunk of rows, the encodings of each column's texts, column after column.

    encode_batch releases the GIL, so the next chunk is encoded on all cores in a worker thread
    while the caller reads the ids of this one in Python.
    """
    with ThreadPoolExecutor(max_workers=1) as encoder:
        pending = None
        for start in range(0, len(columns[0]), ENCODE_CHUNK_ROWS):
            texts = [
                text for column in columns for text in column[start : start + ENCODE_CHUNK_ROWS]
            ]
            submitted = encoder.submit(tokenizer.encode_batch, texts, add_special_tokens=False)
            if pending is not None:
                yield pending.result()
            pending = submitted
        if pending is not None:
            yield pending.result()


def _read_chunk(
    encodings: list[Encoding], ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat ids, row by row: prefix ids then response ids), prefix lengths, response lengths.

    Row layout: BOS [SYSTEM system END] USER prompt END ASSISTANT | response END EOS, laid out
    with numpy scatters rather than a Python list per row.
    """
    rows = len(encodings) // 3
    (system, n_system), (prompt, n_prompt), (response, n_response_text) = (
        _flat_ids(encodings[k * rows : (k + 1) * rows]) for k in range(3)
    )
    has_system = n_system > 0
    n_prefix = 1 + np.where(has_system, n_system + 2, 0) + n_prompt + 3
    n_response = n_response_text + 2
    start = np.zeros(rows, np.int64)
    np.cumsum((n_prefix + n_response)[:-1], out=start[1:])
    out = np.empty(int((n_prefix + n_response).sum()), np.int32)
    user = start + 1 + np.where(has_system, n_system + 2, 0)
    answer = start + n_prefix
    out[start] = ids[BOS]
    out[start[has_system] + 1] = ids[SYSTEM]
    out[(start + 2 + n_system)[has_system]] = ids[END]
    out[user] = ids[USER]
    out[user + 1 + n_prompt] = ids[END]
    out[user + 2 + n_prompt] = ids[ASSISTANT]
    out[answer + n_response_text] = ids[END]
    out[answer + n_response_text + 1] = ids[EOS]
    out[_segment_positions(start + 2, n_system)] = system
    out[_segment_positions(user + 1, n_prompt)] = prompt
    out[_segment_positions(answer, n_response_text)] = response
    return out, n_prefix.astype(np.int32), n_response.astype(np.int32)


def _flat_ids(encodings: list[Encoding]) -> tuple[np.ndarray, np.ndarray]:
    lists = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    return np.fromiter(chain.from_iterable(lists), np.int32, int(lengths.sum())), lengths


def _segment_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start+1, ..., start+length-1 for every segment, concatenated."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def _flat_loss_mask(n_prefix: np.ndarray, n_response: np.ndarray) -> np.ndarray:
    zeros_then_ones = np.tile(np.array([0, 1], np.uint8), len(n_prefix))
    return np.repeat(zeros_then_ones, np.column_stack([n_prefix, n_response]).ravel())


def list_series(offsets: np.ndarray, flat_values: np.ndarray) -> pl.Series:
    """A list column from row offsets into flat values, without a Python list per row."""
    return pl.Series(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat_values)))
