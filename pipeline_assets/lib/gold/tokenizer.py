"""Byte-level BPE for the chat format: train, (de)serialize, validate, and tokenize records.

``encode_conversations`` turns conversations into one sequence each in the format of
``chat_format``, with a loss mask that is 1 exactly on the trained assistant turns;
``encode_records`` encodes sft records as conversations of one exchange (``prefix + response``, the
mask on the response ids).
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

from pipeline_assets.lib.formats import ROLES
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
from pipeline_assets.lib.gold.conversations import (
    ASSISTANT_ROLE,
    DEFAULT_LOSS,
    LAST,
    check_loss_mode,
    conversations_without_an_assistant_turn,
    records_as_conversations,
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

# Texts (turns) per encode_batch call: large enough to keep every core busy, small enough that
# reading the ids of one chunk in Python overlaps with encoding the next.
ENCODE_CHUNK_TEXTS = 6144


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
    """frame: record_id, system (nullable), prompt, response -> ENCODED_SCHEMA, same row order:
    each record as the conversation ``[system], user, assistant`` (``encode_conversations``), so
    input_ids are those of prefix_text(system, prompt) followed by those of
    response_text(response), and loss_mask is 1 exactly on the response ids (+ END EOS)."""
    check_required_text(frame)
    return encode_conversations(tokenizer, records_as_conversations(frame))


def encode_conversations(
    tokenizer: Tokenizer, frame: pl.DataFrame, loss: str = DEFAULT_LOSS
) -> pl.DataFrame:
    """frame: record_id, messages (``formats.TURNS``) -> ENCODED_SCHEMA, same row order.

    A conversation is laid out as ``CHAT_TEMPLATE`` renders it: BOS, then ``<|role|> content END``
    for every turn, then EOS when the last turn is the assistant's. The loss mask is 1 on the
    content and END of the assistant turns ``loss`` names (every one, or the last) and on the final
    EOS, 0 on BOS, every role marker and every system and user turn. The markers are inserted as
    ids and the turns' text is encoded by a copy of the tokenizer that reads special-token strings
    as plain text: a message that says "<|end|>" cannot end its own turn. For ordinary text the ids
    equal those of encoding the formatted string (special tokens split the text).
    """
    check_loss_mode(loss)
    if frame.is_empty():
        return pl.DataFrame(schema=ENCODED_SCHEMA)
    turns = _flat_turns(frame, loss)
    contents = turns["content"].to_list()
    chunks = [
        _flat_ids(encodings)
        for encodings in _encode_chunks(plain_text_encoder(tokenizer), contents)
    ]
    content_ids = np.concatenate([ids for ids, _ in chunks])
    n_content = np.concatenate([lengths for _, lengths in chunks])
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    flat_ids, flat_mask, n_tokens, n_response = _lay_out(turns, content_ids, n_content, ids)
    offsets = np.zeros(len(n_tokens) + 1, np.int64)
    np.cumsum(n_tokens, out=offsets[1:])
    return pl.DataFrame(
        {
            "record_id": frame["record_id"],
            "input_ids": list_series(offsets, flat_ids),
            "loss_mask": list_series(offsets, flat_mask),
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


def _encode_chunks(tokenizer: Tokenizer, texts: Sequence[str]) -> Iterator[list[Encoding]]:
    """The encodings of ``texts``, ``ENCODE_CHUNK_TEXTS`` at a time.

    encode_batch releases the GIL, so the next chunk is encoded on all cores in a worker thread
    while the caller reads the ids of this one in Python.
    """
    with ThreadPoolExecutor(max_workers=1) as encoder:
        pending = None
        for start in range(0, len(texts), ENCODE_CHUNK_TEXTS):
            chunk = texts[start : start + ENCODE_CHUNK_TEXTS]
            submitted = encoder.submit(tokenizer.encode_batch, chunk, add_special_tokens=False)
            if pending is not None:
                yield pending.result()
            pending = submitted
        if pending is not None:
            yield pending.result()


def _flat_turns(frame: pl.DataFrame, loss: str) -> pl.DataFrame:
    """One row per turn, conversation after conversation: row (the conversation's position),
    role (its index in ROLES), content, trained (in the loss), closes (the conversation's last turn,
    an assistant's: EOS follows it)."""
    missing = conversations_without_an_assistant_turn(frame)
    if missing:
        raise ValueError(
            f"a conversation to train on needs an assistant turn; {len(missing)} have none "
            f"(record ids {missing[:5]})"
        )
    turns = (
        frame.select(pl.col("messages"))
        .with_row_index("row")
        .explode("messages")
        .unnest("messages")
    )
    if turns["content"].null_count():
        raise ValueError("a turn's content must not be null")
    unknown = turns.filter(~pl.col("role").is_in(ROLES))["role"].unique().sort().to_list()
    if unknown:
        raise ValueError(
            f"the chat format has no role {', '.join(map(repr, unknown))}: roles are "
            f"{', '.join(ROLES)}"
        )
    assistant = pl.col("role") == ASSISTANT_ROLE
    last_turn = pl.int_range(pl.len()).over("row") == pl.len().over("row") - 1
    trained = (
        assistant & (pl.int_range(pl.len()).over("row") == _last_assistant_position())
        if loss == LAST
        else assistant
    )
    return turns.select(
        "row",
        pl.col("role").replace_strict(ROLES, list(range(len(ROLES))), return_dtype=pl.Int8),
        "content",
        trained=trained,
        closes=last_turn & assistant,
    )


def _last_assistant_position() -> pl.Expr:
    position = pl.int_range(pl.len())
    return position.filter(pl.col("role") == ASSISTANT_ROLE).max().over("row")


def _lay_out(
    turns: pl.DataFrame, content_ids: np.ndarray, n_content: np.ndarray, ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(flat ids, flat loss mask, tokens per conversation, loss tokens per conversation), laid out
    with numpy scatters rather than a Python list per conversation."""
    row = turns["row"].to_numpy().astype(np.int64)
    n_rows = int(row[-1]) + 1
    trained, closes = turns["trained"].to_numpy(), turns["closes"].to_numpy()
    n_turn = n_content + 2  # role marker, content, END
    eos = np.zeros(n_rows, np.int64)
    eos[row[closes]] = 1
    n_tokens = 1 + np.bincount(row, weights=n_turn, minlength=n_rows).astype(np.int64) + eos
    start = np.zeros(n_rows, np.int64)
    np.cumsum(n_tokens[:-1], out=start[1:])
    before = np.cumsum(n_turn) - n_turn  # tokens of the turns before, over every conversation
    first_turn = np.searchsorted(row, np.arange(n_rows))
    turn_start = start[row] + 1 + before - before[first_turn][row]
    out = np.empty(int(n_tokens.sum()), np.int32)
    out[start] = ids[BOS]
    role_ids = np.array([ids[SYSTEM], ids[USER], ids[ASSISTANT]], np.int32)
    out[turn_start] = role_ids[turns["role"].to_numpy()]
    out[_segment_positions(turn_start + 1, n_content)] = content_ids
    out[turn_start + 1 + n_content] = ids[END]
    eos_at = (start + n_tokens - 1)[eos == 1]
    out[eos_at] = ids[EOS]
    mask = np.zeros(len(out), np.uint8)
    mask[_segment_positions(turn_start[trained] + 1, n_content[trained] + 1)] = 1
    mask[eos_at] = 1  # the last turn is an assistant's, trained in either mode
    n_response = np.bincount(row[trained], weights=n_content[trained] + 1, minlength=n_rows) + eos
    return out, mask, n_tokens.astype(np.int32), n_response.astype(np.int32)


def _flat_ids(encodings: list[Encoding]) -> tuple[np.ndarray, np.ndarray]:
    lists = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    return np.fromiter(chain.from_iterable(lists), np.int32, int(lengths.sum())), lengths


def _segment_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start+1, ..., start+length-1 for every segment, concatenated."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def list_series(offsets: np.ndarray, flat_values: np.ndarray) -> pl.Series:
    """A list column from row offsets into flat values, without a Python list per row."""
    return pl.Series(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat_values)))
