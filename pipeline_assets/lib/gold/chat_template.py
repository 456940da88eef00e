"""Conversations in a base model's own chat template, encoded with its own tokenizer.

A conversation (``{"role", "content"}`` messages, the OpenAI / Hugging Face shape) is rendered with
the model's Jinja template in the environment transformers renders chat templates in (sandboxed,
``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``,
``strftime_now``, the special tokens as variables), so that for ordinary text the ids are those of
``apply_chat_template``: what the model was pretrained and instruction-tuned on.

The loss mask is found without ``{% generation %}`` markers, which real templates (Qwen2.5,
Llama 3) lack: the conversation's prefixes are rendered, ``messages[:k]`` with the generation
prompt before assistant turn k and ``messages[:k+1]`` after it, and the turn is the difference, up
to and including the last special token in it (its end of turn: ``<|im_end|>``, ``<|eot_id|>``).
Template text after that token (ChatML's newline) is not trained. Every prefix rendering must be a
prefix of the next and of the whole rendering; a template where they are not is refused.

User text stays plain text: a special-token string inside a message is wrapped in private-use
markers before rendering and encoded as ordinary text after (``apply_chat_template`` makes it the
special token unless told ``sanitize_control_tokens=True``). The rendering is cut at the turns'
boundaries and around those strings; each piece is encoded on its own, and the encoder checks once
that this gives the ids of the whole text. No Dagster, no torch, no transformers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from itertools import chain

import jinja2
import jinja2.ext
import numpy as np
import polars as pl
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer

from pipeline_assets.lib.gold.conversations import (
    DEFAULT_LOSS,
    check_loss_mode,
    records_as_conversations,
    trained_turns,
)
from pipeline_assets.lib.gold.tokenizer import (
    ENCODED_SCHEMA,
    check_required_text,
    list_series,
    plain_text_encoder,
)

ASSISTANT = "assistant"
# Wrapped around a special-token string found in a message, so that it is told apart from the
# template's own tokens after rendering (Supplementary Private Use Area-B: no text holds them).
_MARK_START, _MARK_END = "\U0010fff0", "\U0010fff1"
_PROBE = (
    {"role": "user", "content": "How do I reset my password?"},
    {"role": ASSISTANT, "content": "Open settings, then choose security."},
)
_EXCERPT = 60  # characters shown either side of where two renderings part


def record_messages(system: str | None, prompt: str, response: str | None) -> list[dict]:
    """A prompt/response record as messages: [system], user, assistant (none when response is
    None)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    if response is not None:
        messages.append({"role": ASSISTANT, "content": response})
    return messages


class ChatTemplateEncoder:
    """Conversations -> token ids and loss mask in a base model's template and tokenizer.

    ``special_tokens`` are the names the template reads (``bos_token``, ``eos_token``...: the
    tokenizer's ``special_tokens_map``). Building one renders a probe conversation: a template
    whose prefixes do not concatenate, that closes an assistant turn with no special token, or a
    tokenizer that encodes the pieces differently from the whole text is refused (ValueError).
    """

    kind = "chat_template"

    def __init__(self, tokenizer_json: str, template: str, special_tokens: Mapping[str, str]):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        # A tokenizer.json may carry a truncation or padding of its own; gold packs sequences.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._plain = plain_text_encoder(self.tokenizer)
        self._template = compile_chat_template(template)
        self._variables = dict(special_tokens)
        specials = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special),
            key=len,
            reverse=True,
        )
        alternatives = "|".join(map(re.escape, specials)) or "(?!)"
        self._special = re.compile(alternatives)
        self._marked = re.compile(f"{_MARK_START}({alternatives}){_MARK_END}")
        eos = self._variables.get("eos_token")
        pad = self._variables.get("pad_token") or eos
        self.pad_id = self._token_id(pad, "pad_token (or eos_token)")
        end_of_turn = self._check_probe()
        self.stop_ids = frozenset(
            {end_of_turn, *([self._token_id(eos, "eos_token")] if eos else [])}
        )

    # --- the seam's interface (lib.gold.encoder.ChatEncoder) -----------------------------------
    def encode_records(self, frame: pl.DataFrame) -> pl.DataFrame:
        """frame: record_id, system (nullable), prompt, response -> ``ENCODED_SCHEMA``, same row
        order, each record rendered as [system], user, assistant."""
        check_required_text(frame)
        return self.encode_conversations(records_as_conversations(frame))

    def encode_prompts(self, prompts: Sequence[str], system: str | None = None) -> list[list[int]]:
        """Each prompt's ids up to the assistant's turn (the generation prompt included): what a
        model generates its answer after, as ``encode_records`` encodes the same prompt."""
        segments = [self.prompt_segments(record_messages(system, p, None)) for p in prompts]
        ids, _, n_tokens, _ = self._encode(segments)
        ends = np.cumsum(n_tokens)
        return [ids[end - n : end].tolist() for end, n in zip(ends, n_tokens, strict=True)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # --- conversations ------------------------------------------------------------------------
    def encode_conversations(self, frame: pl.DataFrame, loss: str = DEFAULT_LOSS) -> pl.DataFrame:
        """frame: record_id, messages (``formats.TURNS``) -> ``ENCODED_SCHEMA``, same row order:
        the loss mask is 1 on the assistant turns ``loss`` names (every one, or the last) and the
        end-of-turn token that closes each, 0 everywhere else."""
        check_loss_mode(loss)
        if frame.is_empty():
            return pl.DataFrame(schema=ENCODED_SCHEMA)
        flat_ids, flat_mask, n_tokens, n_response = self._encode(
            [self.segments(messages, loss) for messages in frame["messages"].to_list()]
        )
        offsets = np.zeros(len(n_tokens) + 1, np.int64)
        np.cumsum(n_tokens, out=offsets[1:])
        return pl.DataFrame(
            {
                "record_id": frame["record_id"],
                "input_ids": list_series(offsets, flat_ids),
                "loss_mask": list_series(offsets, flat_mask),
                "n_tokens": n_tokens.astype(np.int32),
                "n_response_tokens": n_response.astype(np.int32),
            },
            schema=ENCODED_SCHEMA,
        )

    def segments(
        self, messages: Sequence[Mapping], loss: str = DEFAULT_LOSS
    ) -> list[tuple[str, bool]]:
        """The whole rendering cut into (text, in the loss) pieces, special-token strings of the
        messages still marked; ValueError when the template's prefixes do not concatenate."""
        turns = trained_turns([message["role"] for message in messages], loss)
        if not turns:
            raise ValueError("a conversation to train on needs an assistant turn")
        marked = self._marked_messages(messages)
        whole = self._render(marked, False)
        pieces, done = [], 0
        for k in turns:
            before = self._render(marked[:k], True)
            after = whole if k == len(marked) - 1 else self._render(marked[: k + 1], False)
            _check_prefix(
                before, f"messages[:{k}] with the generation prompt", after, f"messages[:{k + 1}]"
            )
            _check_prefix(after, f"messages[:{k + 1}]", whole, "the whole conversation")
            if len(before) < done:
                raise ValueError(
                    f"the chat template does not concatenate: messages[:{k}] with the generation "
                    f"prompt renders shorter than the turns before it ({len(before)} < {done} "
                    "characters): it drops or rewrites earlier turns"
                )
            end = len(before) + self._end_of_turn(after[len(before) :], k)
            pieces += [(whole[done : len(before)], False), (whole[len(before) : end], True)]
            done = end
        pieces.append((whole[done:], False))
        if marked is not messages:
            self._check_marks_change_nothing(messages, whole)
        return [(text, in_loss) for text, in_loss in pieces if text]

    def prompt_segments(self, messages: Sequence[Mapping]) -> list[tuple[str, bool]]:
        """The rendering of ``messages`` with the generation prompt, as one piece out of the loss
        (the prefix of the next assistant turn's segments)."""
        marked = self._marked_messages(messages)
        text = self._render(marked, True)
        if marked is not messages:
            self._check_marks_change_nothing(messages, text, add_generation_prompt=True)
        return [(text, False)]

    def _render(self, messages: Sequence[Mapping], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template fails to render: {error}") from error

    def _marked_messages(self, messages: Sequence[Mapping]) -> Sequence[Mapping]:
        """The messages with every special-token string in their content wrapped in markers; the
        same object when none holds one (the common case, rendered as it is)."""
        if not any(self._special.search(_content(m)) for m in messages):
            return messages
        return [
            {**m, "content": self._special.sub(_wrapped, m["content"])}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]

    def _end_of_turn(self, turn: str, k: int) -> int:
        """Where assistant turn k's text ends: after the last special token the template wrote."""
        ends = [
            match.end()
            for match in self._special.finditer(turn)
            if not turn[: match.start()].endswith(_MARK_START)
        ]
        if not ends:
            raise ValueError(
                f"the chat template closes assistant turn {k} with no special token ({turn!r}): "
                "nothing would teach the model to end its turn"
            )
        return ends[-1]

    def _check_marks_change_nothing(
        self, messages: Sequence[Mapping], rendered: str, add_generation_prompt: bool = False
    ) -> None:
        unmarked = self._marked.sub(r"\1", rendered)
        if self._render(messages, add_generation_prompt) != unmarked:
            raise ValueError(
                "the chat template renders a message holding a special-token string differently "
                "once that string is marked as text: its content cannot be kept plain text"
            )

    def _encode(
        self, conversations: Sequence[Sequence[tuple[str, bool]]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(flat ids, flat loss mask, tokens per conversation, loss tokens per conversation).
        Marked special-token strings are encoded as plain text, the rest with the template's
        special tokens recognised."""
        texts, plain, in_loss, owner = [], [], [], []
        for number, segments in enumerate(conversations):
            for text, trained in segments:
                for i, part in enumerate(self._marked.split(text)):
                    if part:
                        texts.append(part)
                        plain.append(i % 2 == 1)
                        in_loss.append(trained)
                        owner.append(number)
        encoded: list[list[int]] = [[] for _ in texts]
        for encoder, as_text in ((self.tokenizer, False), (self._plain, True)):
            chosen = [i for i, is_plain in enumerate(plain) if is_plain == as_text]
            batch = encoder.encode_batch([texts[i] for i in chosen], add_special_tokens=False)
            for i, encoding in zip(chosen, batch, strict=True):
                encoded[i] = encoding.ids
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        flat = np.fromiter(chain.from_iterable(encoded), np.int32, int(lengths.sum()))
        trained = np.array(in_loss, np.uint8)
        owners, count = np.array(owner, np.int64), len(conversations)
        n_tokens = np.bincount(owners, weights=lengths, minlength=count)
        n_loss = np.bincount(owners, weights=lengths * trained, minlength=count)
        return (
            flat,
            np.repeat(trained, lengths),
            n_tokens.astype(np.int64),
            n_loss.astype(np.int64),
        )

    def _check_probe(self) -> int:
        """The end-of-turn token's id, from a probe conversation, once the template renders it as
        it must and its pieces encode as the whole text does."""
        segments = self.segments(_PROBE)
        turn = next(text for text, in_loss in segments if in_loss)
        end_of_turn = self._special.findall(turn)[-1]
        ids, _, _, _ = self._encode([segments])
        whole = self.tokenizer.encode("".join(t for t, _ in segments), add_special_tokens=False)
        if ids.tolist() != whole.ids:
            raise ValueError(
                "the tokenizer encodes the chat template's pieces differently from the whole text "
                "(it may add a prefix space to every input): pieces give "
                f"{ids.tolist()[:40]}, the whole text {whole.ids[:40]}"
            )
        return self._token_id(end_of_turn, "the end-of-turn token")

    def _token_id(self, token: str | None, role: str) -> int:
        token_id = None if token is None else self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} is not a token of the tokenizer")
        return token_id


def _content(message: Mapping) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _wrapped(match: re.Match) -> str:
    return f"{_MARK_START}{match.group()}{_MARK_END}"


def _check_prefix(prefix: str, prefix_name: str, text: str, text_name: str) -> None:
    if text.startswith(prefix):
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b),
        min(len(prefix), len(text)),
    )
    start = max(0, at - _EXCERPT)
    raise ValueError(
        f"the chat template does not concatenate: {prefix_name} renders as a prefix of "
        f"{text_name} only up to character {at} (...{prefix[start : at + _EXCERPT]!r} against "
        f"...{text[start : at + _EXCERPT]!r}): the loss mask could not be cut at the turns"
    )


# --- the Jinja environment transformers renders chat templates in --------------------------------
@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled once per process (a Ray worker keeps it for every block)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return environment.from_string(source)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged: transformers tracks
    it for ``return_assistant_tokens_mask``; here the mask comes from the prefixes."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself (whose
    attributes would reach past the sandbox)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(Namespace):
    """Jinja's namespace, refusing names that start with an underscore."""

    def __init__(*args, **kwargs):
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _Namespace._check(name)
        Namespace.__init__(self, values)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set {name!r} on a namespace (names starting with _)"
            )
