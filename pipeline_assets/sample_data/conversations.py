"""A deterministic conversation source for the sample corpus: ``chats``, format ``conversation``.

Every line is a conversation of 2 to 4 exchanges (a user turn, then an assistant turn), a quarter
of them opened by a system turn, ending on an assistant turn: ``{"id", "messages": [{"role",
"content"}, ...], "created_at", "meta"}``. The questions are asked in the sample corpus's source
voices (``corpus._prompt``), the answers are its docstring prose, the docs the eval sets were made
of left out; a follow-up asks for more about the same docstring ("tell me more about ...") or about
the next one of its module. The conversations land in two files, ``<source>/<source>-000.jsonl``
and ``<source>/<source>-001.jsonl.zst``; in the second, about half the lines
(``SHAREGPT_SHARE``) are in the ShareGPT shape (``conversations``: ``{"from": "system" | "human" |
"gpt", "value"}``), which bronze stores as ``messages`` too.

On top of the clean conversations the generator injects, at the rates of the sft corpus's
``INJECTION_RATES`` (shares of all lines):

- ``exact_duplicate``: an earlier clean conversation again, with a new id;
- ``near_duplicate``: an earlier clean conversation with its assistant turns edited as
  ``near_duplicate_response`` edits a response, the system and user turns the same; word
  5-shingle Jaccard >= 0.85 on the assistant turns and on the whole conversation (the texts near
  dedup compares: ``CONVERSATION.views``);
- ``eval_copy``: an eval item's question as a user turn, or its answer as an assistant turn (after
  a question naming its subject), in one of ``eval_copy_text``'s disguises; each item once at most;
- ``low_quality``: a real question in every user turn, a useless answer of one kind
  (``low_quality_response``) in every assistant turn: the quality rules judge the assistant turns
  together, so a single bad turn among good ones would pass them;
- ``malformed``: a line bronze quarantines whatever its format (``MALFORMED_REASONS``);

and, at ``INVALID_CONVERSATION_RATE``, ``invalid_conversation``: a line that is a conversation in
name only, quarantined with the reason code of ``CONVERSATION_DEFECTS``: ``messages`` not a list,
an unknown role, a turn with empty content, no assistant turn, a user turn last. A conversation
with no assistant turn ends on a user turn too: its reason is ``no_assistant_turn``, the more
specific one.

Each clean conversation is copied at most once. The sample manifest gets a ``conversation``
section (``add_conversation_source``) that says where each injection is, with the ids and turns
involved. Same ``conversations``, ``seed`` and eval items give byte-identical files.
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_assets.lib.silver.quality import QualityThresholds
from pipeline_assets.sample_data.corpus import INJECTION_RATES as SFT_INJECTION_RATES
from pipeline_assets.sample_data.corpus import (
    LOW_QUALITY_KINDS,
    NEAR_DUPLICATE_MIN_JACCARD,
    NEAR_DUPLICATE_MIN_WORDS,
    SOURCES,
    SYNTH_SYSTEM_PROMPTS,
    TIME_SPREAD_S,
    Doc,
    EarlierOriginals,
    _dumps,
    _prompt,
    _shuffled_by_module,
    _Slot,
    _split_at_sentence,
    _TextStream,
    _timestamp,
    _word_count,
    add_manifest_section,
    built_with_enough_words,
    docs_without_eval_text,
    eval_copy_text,
    low_quality_response,
    near_duplicate_response,
    shingle_jaccard,
    spread_slots,
    two_landing_files,
    written_file_entry,
)

SOURCE = "chats"
RECORD_FORMAT = "conversation"
MIN_CONVERSATIONS = 2  # a line in each file

INVALID_CONVERSATION_RATE = 0.01
INJECTION_RATES = {**SFT_INJECTION_RATES, "invalid_conversation": INVALID_CONVERSATION_RATE}
COPY_KINDS = ("exact_duplicate", "near_duplicate")  # need an earlier clean conversation
QUARANTINED_KINDS = ("malformed", "invalid_conversation")
MALFORMED_REASONS = ("invalid_json", "not_an_object", "missing_field:messages")
# Bronze's reason codes for a conversation that breaks the format's rules
# (lib/landing/contract.py).
CONVERSATION_DEFECTS = (
    "wrong_type:messages",
    "unknown_role",
    "empty_turn",
    "no_assistant_turn",
    "ends_on_user_turn",
)
EVAL_COPY_PLACES = ("user_turn", "assistant_turn")
_SLOT_DETAILS = {
    "malformed": MALFORMED_REASONS,
    "invalid_conversation": CONVERSATION_DEFECTS,
    "low_quality": LOW_QUALITY_KINDS,
    "eval_copy": EVAL_COPY_PLACES,
}

EXCHANGES = (2, 4)  # user and assistant turn pairs a conversation has, fewest and most
SYSTEM_SHARE = 0.25
SHAREGPT_SHARE = 0.5  # of the second file's lines
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}
_TURN_KEYS = {
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
}
# Roles neither shape has: a chat tool's own names, and those of ShareGPT scrapes.
_UNKNOWN_ROLES = {"messages": ("bot", "ai", "chatbot"), "sharegpt": ("bing", "chatgpt", "bard")}
_BLANK_CONTENTS = ("", "   ", "\n\t ")
CHANNELS = ("web", "app", "api")

# An assistant turn: log-normal like the corpus's responses, shorter, so that most conversations
# fit a 512-token row and a few must be cut after a turn.
TURN_MEDIAN_WORDS = 35
TURN_LENGTH_SIGMA = 0.6
TURN_MIN_WORDS = 12
TURN_MAX_WORDS = 150
# Unique text a conversation uses: about 3 answers of about 40 words, and text that did not fit.
WORDS_PER_CONVERSATION = 150
# A low-quality conversation of short replies stays under the quality rules' word minimum in all.
_TOO_SHORT_WORDS = int(QualityThresholds().min_words) - 1

_EVAL_SUBJECT = re.compile(r"`([^`]+)`")
_EVAL_LEAD_INS = (
    "And what does `{name}` do?",
    "What about `{name}`?",
    "how does {name} fit in",
    "Can you explain `{name}` too?",
)


# --- Text of a conversation -----------------------------------------------------------------------

Turn = tuple[str, str]  # (role, content)


def conversation_text(turns: list[Turn]) -> str:
    """Every turn after its role and a colon, a blank line apart: ``CONVERSATION.views``'s
    ``conversation``, the text exact and near dedup compare."""
    return "\n\n".join(f"{role}: {content}" for role, content in turns)


def assistant_text(turns: list[Turn]) -> str:
    """The assistant turns, a blank line apart: the ``assistant_turns`` view, what the quality
    rules judge and near dedup signs apart."""
    return "\n\n".join(content for role, content in turns if role == "assistant")


def _assistant_indices(turns: list[Turn]) -> list[int]:
    return [index for index, (role, _) in enumerate(turns) if role == "assistant"]


def edited_assistant_turns(turns: list[Turn], rng: random.Random) -> list[Turn] | None:
    """``turns`` with their assistant turns edited as ``near_duplicate_response`` edits one text
    (the assistant turns joined), the other turns as they were; None when no edit keeps both
    texts near dedup compares at NEAR_DUPLICATE_MIN_JACCARD or more."""
    indices = _assistant_indices(turns)
    paragraphs = [len(turns[i][1].split("\n\n")) for i in indices]
    for _ in range(8):
        edit = near_duplicate_response(assistant_text(turns), rng)
        if edit is None:
            continue
        parts = edit[0].split("\n\n")  # an edit keeps every paragraph, so each turn's are its own
        if len(parts) != sum(paragraphs):
            continue
        edited = list(turns)
        for index, count in zip(indices, paragraphs, strict=True):
            edited[index] = ("assistant", "\n\n".join(parts[:count]))
            parts = parts[count:]
        whole = shingle_jaccard(conversation_text(turns), conversation_text(edited))
        if whole >= NEAR_DUPLICATE_MIN_JACCARD:
            return edited
    return None


# --- Conversations --------------------------------------------------------------------------------


@dataclass
class _Conversation:
    id: str
    turns: list[Turn]
    created_s: int  # seconds after corpus.BASE_TIME
    meta: dict = field(default_factory=dict)

    @property
    def assistant_words(self) -> int:
        return _word_count(assistant_text(self.turns))

    def as_object(self, shape: str) -> dict:
        """The landing object in ``shape``: ``messages`` or ``sharegpt``."""
        key, role_key, content_key = _TURN_KEYS[shape]
        rename = SHAREGPT_ROLES if shape == "sharegpt" else {}
        return {
            "id": self.id,
            key: [
                {role_key: rename.get(role, role), content_key: content}
                for role, content in self.turns
            ],
            "created_at": _timestamp(self.created_s),
            "meta": self.meta,
        }


def _turn_target(rng: random.Random) -> int:
    """An answer's length in words, below the most: joining paragraphs can add a few past it."""
    words = rng.lognormvariate(math.log(TURN_MEDIAN_WORDS), TURN_LENGTH_SIGMA)
    return max(TURN_MIN_WORDS, min(TURN_MAX_WORDS - 20, round(words)))


def _shapes(slots: list[_Slot], rng: random.Random) -> list[str]:
    """Each line's shape: ShareGPT for SHAREGPT_SHARE of the second file's lines."""
    second = slots[-1].file.path if slots else None
    return [
        "sharegpt" if slot.file.path == second and rng.random() < SHAREGPT_SHARE else "messages"
        for slot in slots
    ]


class _ConversationBuilder:
    """Fills every line of both files, in order, and notes what went where."""

    def __init__(
        self, conversations: int, seed: int, eval_items: list[dict], source: str, words: int
    ):
        rng = self._rng = random.Random(f"{seed}/{source}/{RECORD_FORMAT}")
        self.source = source
        self.files = two_landing_files(source, conversations)
        self.slots = spread_slots(self.files, INJECTION_RATES, _SLOT_DETAILS, rng)
        self.shapes = _shapes(self.slots, rng)
        self._stream = _TextStream(
            _shuffled_by_module(docs_without_eval_text(words, eval_items), rng)
        )
        self._eval_queue = list(eval_items)
        rng.shuffle(self._eval_queue)
        self._originals: EarlierOriginals[_Conversation] = EarlierOriginals(
            lambda conversation: conversation.assistant_words
        )
        self._deferred: deque[str] = deque()  # copies that had no earlier original to copy yet
        self._next_id = 0
        self._injections = {
            "exact_duplicate": self._exact_duplicate,
            "near_duplicate": self._near_duplicate,
            "eval_copy": self._eval_copy,
            "low_quality": self._low_quality,
        }
        self.lines: dict[str, list[bytes]] = {file.path: [] for file in self.files}
        self.injected: dict[str, list[dict]] = {kind: [] for kind in INJECTION_RATES}
        self.clean_ids: list[str] = []

    def build(self) -> _ConversationBuilder:
        for slot, shape in zip(self.slots, self.shapes, strict=True):
            self._fill(slot, shape)
        return self

    def _fill(self, slot: _Slot, shape: str) -> None:
        kind = slot.kind
        if kind == "clean" and self._deferred:
            kind = self._deferred.popleft()
        where = {"file": slot.file.path, "line": slot.line}
        if kind in QUARANTINED_KINDS:
            line, facts = self._quarantined_line(kind, slot.detail, shape)
            self.lines[slot.file.path].append(line)
            self.injected[kind].append({**where, "reason": slot.detail, **facts})
            return
        made = self._injections[kind](slot.detail) if kind in self._injections else None
        if made is None:  # a clean slot, or a copy with nothing to copy yet
            if kind in COPY_KINDS:
                self._deferred.append(kind)
            conversation = self._conversation(self._clean_turns())
            self.clean_ids.append(conversation.id)
            self._originals.add(conversation)
        else:
            conversation, facts = made
            self.injected[kind].append({"id": conversation.id, **where, **facts})
        self.lines[slot.file.path].append(_dumps(conversation.as_object(shape)).encode())

    def _conversation(
        self, turns: list[Turn], created_s: int | None = None, meta: dict | None = None
    ) -> _Conversation:
        conversation_id = f"{self.source}-{self._next_id:06d}"
        self._next_id += 1
        created = self._rng.randrange(TIME_SPREAD_S) if created_s is None else created_s
        meta = {"channel": self._rng.choice(CHANNELS)} if meta is None else meta
        return _Conversation(conversation_id, turns, created, meta)

    # --- clean turns ------------------------------------------------------------------------------

    def _clean_turns(self, answer_words: int | None = None) -> list[Turn]:
        """A system turn (at SYSTEM_SHARE) and 2-4 exchanges: a question in one source's voice,
        answered by unused text (of about ``answer_words``, or a drawn length), then follow-ups."""
        rng = self._rng
        exchanges = rng.randint(*EXCHANGES)
        voice = rng.choice(SOURCES)
        turns = (
            [("system", rng.choice(SYNTH_SYSTEM_PROMPTS))] if rng.random() < SYSTEM_SHARE else []
        )
        asked: Doc | None = None
        for _ in range(exchanges):
            doc, continued, answer = self._answer(answer_words or _turn_target(rng))
            turns.append(("user", _prompt(voice, doc, continued or doc == asked, rng)))
            turns.append(("assistant", answer))
            asked = doc
        return turns

    def _answer(self, target_words: int) -> tuple[Doc, bool, str]:
        """(doc, continued, text): unused text of at most TURN_MAX_WORDS words, near the target."""
        while True:
            doc, continued, text = self._stream.take(target_words)
            if _word_count(text) > TURN_MAX_WORDS:
                text, _ = _split_at_sentence(text, TURN_MIN_WORDS, target_words, TURN_MAX_WORDS)
            if text:
                return doc, continued, text

    def _questions(self, exchanges: int) -> list[Turn]:
        """User turns about the next unused docstring, its text left for a later answer."""
        rng = self._rng
        voice = rng.choice(SOURCES)
        doc, continued = self._stream.next_subject()
        return [("user", _prompt(voice, doc, continued or n > 0, rng)) for n in range(exchanges)]

    def _later(self, original: _Conversation) -> int:
        return original.created_s + self._rng.randint(600, 3 * 86_400)

    # --- injections -------------------------------------------------------------------------------

    def _exact_duplicate(self, _: str | None) -> tuple[_Conversation, dict] | None:
        original = self._originals.pick(self._rng)
        if original is None:
            return None
        copy = self._conversation(list(original.turns), self._later(original), original.meta)
        return copy, {"duplicate_of": original.id}

    def _near_duplicate(self, _: str | None) -> tuple[_Conversation, dict] | None:
        original = self._originals.pick(self._rng, min_words=NEAR_DUPLICATE_MIN_WORDS)
        edited = edited_assistant_turns(original.turns, self._rng) if original else None
        if edited is None:
            return None
        facts = {
            "duplicate_of": original.id,
            "edited_turns": [i for i, turn in enumerate(edited) if turn != original.turns[i]],
            "jaccard": round(
                shingle_jaccard(assistant_text(original.turns), assistant_text(edited)), 4
            ),
            "conversation_jaccard": round(
                shingle_jaccard(conversation_text(original.turns), conversation_text(edited)), 4
            ),
        }
        return self._conversation(edited, self._later(original)), facts

    def _eval_copy(self, place: str) -> tuple[_Conversation, dict] | None:
        if not self._eval_queue:
            return None
        item = self._eval_queue.pop()
        question, answer = eval_copy_text(item["prompt"], item["response"], self._rng)
        turns = self._clean_turns()
        exchange = self._rng.randrange(len(_assistant_indices(turns)))
        turn = _assistant_indices(turns)[exchange] - 1  # the exchange's user turn
        if place == "user_turn":
            turns[turn] = ("user", question)
        else:
            subject = _EVAL_SUBJECT.search(item["prompt"])
            name = subject.group(1) if subject else "that"
            turns[turn] = ("user", self._rng.choice(_EVAL_LEAD_INS).format(name=name))
            turn += 1
            turns[turn] = ("assistant", answer)
        facts = {"eval_set": item["eval_set"], "item_id": item["item_id"], "place": place}
        return self._conversation(turns), {**facts, "turn": turn}

    def _low_quality(self, kind: str) -> tuple[_Conversation, dict]:
        rng = self._rng
        exchanges = 2 if kind == "too_short" else rng.randint(*EXCHANGES)
        answers = [low_quality_response(kind, rng) for _ in range(exchanges)]
        while kind == "too_short" and _word_count(" ".join(answers)) > _TOO_SHORT_WORDS:
            answers = [low_quality_response(kind, rng) for _ in range(exchanges)]
        turns = [
            turn
            for question, answer in zip(self._questions(exchanges), answers, strict=True)
            for turn in (question, ("assistant", answer))
        ]
        return self._conversation(turns), {"kind": kind, "turns": _assistant_indices(turns)}

    # --- quarantined lines ------------------------------------------------------------------------

    def _quarantined_line(self, kind: str, reason: str, shape: str) -> tuple[bytes, dict]:
        """One line bronze quarantines with exactly ``reason``, and what the manifest says of it
        beyond its reason (the turn at fault)."""
        turns = self._clean_turns(answer_words=TURN_MIN_WORDS)  # quarantined: any text
        facts: dict = {}
        if reason == "no_assistant_turn":
            questions = [turn for turn in turns if turn[0] == "user"][: self._rng.randint(1, 2)]
            turns = [turn for turn in turns if turn[0] == "system"] + questions
        elif reason == "ends_on_user_turn":
            turns.append(self._questions(1)[0])
            facts["turn"] = len(turns) - 1
        elif reason == "unknown_role":  # an answer before the last: the rest is a conversation
            facts["turn"] = self._rng.choice(_assistant_indices(turns)[:-1])
        elif reason == "empty_turn":  # a question or an answer, before the last answer
            turn = self._rng.choice([i for i, t in enumerate(turns[:-1]) if t[0] != "system"])
            turns[turn] = (turns[turn][0], self._rng.choice(_BLANK_CONTENTS))
            facts["turn"] = turn
        obj = self._conversation(turns).as_object(shape)
        key, role_key, _ = _TURN_KEYS[shape]
        if reason == "unknown_role":
            obj[key][facts["turn"]][role_key] = self._rng.choice(_UNKNOWN_ROLES[shape])
        elif reason == "wrong_type:messages":
            obj[key] = self._flattened(turns)
        elif reason == "missing_field:messages":  # the turns under a name no shape has
            obj = {("dialog" if name == key else name): value for name, value in obj.items()}
        elif reason == "not_an_object":  # the turns alone
            return _dumps(obj[key]).encode(), facts
        elif reason == "invalid_json":
            text = _dumps(obj)
            return text[: self._rng.randint(len(text) // 4, len(text) * 3 // 4)].encode(), facts
        elif reason not in CONVERSATION_DEFECTS:
            raise ValueError(f"unknown {kind} reason {reason!r}")
        return _dumps(obj).encode(), facts

    def _flattened(self, turns: list[Turn]) -> str | dict:
        """The turns as one transcript string, or as an object of role -> its first content."""
        if self._rng.random() < 0.5:
            return "\n".join(f"{role.title()}: {content}" for role, content in turns)
        first: dict[str, str] = {}
        for role, content in turns:
            first.setdefault(role, content)
        return first


def _built(
    conversations: int, seed: int, eval_items: list[dict], source: str
) -> _ConversationBuilder:
    return built_with_enough_words(
        lambda words: _ConversationBuilder(conversations, seed, eval_items, source, words).build(),
        conversations * WORDS_PER_CONVERSATION,
    )


# --- Writing --------------------------------------------------------------------------------------


def check_conversation_count(conversations: int) -> None:
    if conversations < MIN_CONVERSATIONS:
        raise ValueError(
            f"conversations must be at least {MIN_CONVERSATIONS} (a line in each of two files), "
            f"got {conversations}"
        )


def write_conversation_source(
    out_dir: Path, conversations: int, eval_items: list[dict], seed: int, source: str = SOURCE
) -> dict:
    """Writes ``conversations`` lines under out_dir/<source>/ and returns the manifest's
    ``conversation`` section. ``eval_items`` are the eval sets' items (eval_set, item_id, prompt,
    response), the ones decontamination is to find copies of."""
    check_conversation_count(conversations)
    builder = _built(conversations, seed, eval_items, source)
    files = []
    for file in builder.files:
        quarantined = sum(
            entry["file"] == file.path
            for kind in QUARANTINED_KINDS
            for entry in builder.injected[kind]
        )
        sharegpt = [
            slot.line
            for slot, shape in zip(builder.slots, builder.shapes, strict=True)
            if slot.file == file and shape == "sharegpt"
        ]
        written = written_file_entry(out_dir, file, builder.lines[file.path], source)
        files.append(
            {**written, "conversations": file.lines - quarantined, "sharegpt_lines": sharegpt}
        )
    return _manifest_section(builder, files, conversations, seed)


def _manifest_section(
    builder: _ConversationBuilder, files: list[dict], conversations: int, seed: int
) -> dict:
    quarantined = sum(len(builder.injected[kind]) for kind in QUARANTINED_KINDS)
    return {
        "source": builder.source,
        "format": RECORD_FORMAT,
        "setting": {"PIPELINE_SOURCE_FORMATS": {builder.source: RECORD_FORMAT}},
        "seed": seed,
        "conversations": conversations,
        "rates": dict(INJECTION_RATES),
        "files": files,
        "injected_counts": {kind: len(entries) for kind, entries in builder.injected.items()},
        "injected": builder.injected,
        "clean_ids": builder.clean_ids,
        "expected": {
            "lines": conversations,
            "quarantined": quarantined,
            "bronze_rows": conversations - quarantined,
        },
    }


def add_conversation_source(
    out_dir: Path, conversations: int, eval_sets_dir: Path | None = None, source: str = SOURCE
) -> dict:
    """Adds a conversation source to the sample corpus written in out_dir
    (``write_sample_corpus``), with its seed and against its eval sets (in eval_sets_dir, default
    out_dir/'_eval_sets'), and its ``conversation`` section to the corpus's manifest. Returns the
    whole manifest."""
    return add_manifest_section(
        out_dir,
        eval_sets_dir,
        "conversation",
        lambda eval_items, seed: write_conversation_source(
            out_dir, conversations, eval_items, seed, source
        ),
    )
