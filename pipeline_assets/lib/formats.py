"""Record formats: the one place that knows a record's shape.

A format names its landing fields and which text each stage reads: what normalization rewrites,
what exact and near dedup hash, which answers are signed apart and judged by the quality rules,
what decontamination checks against the eval sets, and the loss a model trains on it with. A source
declares its format in ``PIPELINE_SOURCE_FORMATS`` (``{"prefs": "preference"}``; ``sft`` unless
named). A format also names its bronze and silver tables: their assets, checks and sensors are made
for every format listed in ``FORMATS``. Adding a format is one description here, its contracts
(``contracts.FORMAT_CONTRACTS``), its rendering to tokens and its sample data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import polars as pl

SHARED_OPTIONAL = ("id", "created_at", "meta")  # every format's optional fields besides its text
ROLES = ("system", "user", "assistant")
TURN = pl.Struct({"role": pl.String, "content": pl.String})
TURNS = pl.List(TURN)  # a conversation as bronze and silver store it: its turns in order


@dataclass(frozen=True)
class RecordFormat:
    name: str
    required: tuple[str, ...]  # non-empty strings every record has
    optional_text: tuple[str, ...]  # strings a record may leave out (or null)
    optional_numbers: tuple[str, ...]  # numbers a record may leave out (or null)
    dedup: tuple[str, ...]  # joined, the text exact and near dedup compare
    answers: tuple[
        str, ...
    ]  # joined, signed apart: a near-duplicate's answers are near-duplicates too
    judged: str  # the answer the quality rules judge
    # checked against the eval sets, in this order (a column of turns: each turn's content)
    decontaminate: tuple[str, ...]
    split_key: str  # the column whose hash decides a record's train/validation side
    # the loss a model trains on it with: trainer/objective.py's "sft" (next token on the answer
    # after the prompt; such formats are packed into gold/sequences with sft records) or "dpo"
    objective: str
    bronze_table: str  # bronze/<bronze_table>: its records with provenance
    silver_table: str  # silver/<silver_table>: its curated records
    about: str  # what its records are, for the descriptions of its tables
    # a required list of turns (``TURNS``) the format's text lives in; the stages read it through
    # ``views``
    turns: str | None = None
    # a nullable list of turns (``TURNS``): the turns before ``prompt`` when a record's prompt
    # comes as a list of messages (TRL's conversational shape; ``prompt`` keeps its final user
    # turn, ``system`` a leading system turn); null when it has none
    context: str | None = None

    def __reduce__(self):
        # A registered format crosses a process boundary (a Ray task's stage list) by name and is
        # the same object there, so the stages' ``fmt is PREFERENCE`` holds in any process.
        if FORMATS.get(self.name) is self:
            return (format_named, (self.name,))
        return super().__reduce__()

    @property
    def text(self) -> tuple[str, ...]:
        """Every string field: what normalization rewrites and what a data stage's work is counted
        in (with the contents of ``turns``)."""
        return self.required + self.optional_text

    @property
    def known(self) -> frozenset[str]:
        """Every field the format names; any other lands verbatim in ``extra``."""
        turns = (self.turns,) if self.turns else ()
        return frozenset(
            self.required + turns + self.optional_text + self.optional_numbers + SHARED_OPTIONAL
        )

    def looks_like(self, fields: set[str]) -> bool:
        """A record with these fields has every field this format requires (a conversation's turns
        under either of their names)."""
        if self.turns and not fields & {self.turns, SHAREGPT_TURNS}:
            return False
        return set(self.required) <= fields

    @property
    def views(self) -> dict[str, pl.Expr]:
        """The text a format with ``turns`` has no field for, as columns the stages read by name
        (``dedup``, ``answers``, ``judged``): every turn labelled with its role, the assistant
        turns, and the first user turn (what ``prompt_hash`` is taken of); a format with
        ``context``: ``prompt_in_context``, the prompt after its earlier turns (each labelled with
        its role), the prompt alone when it has none."""
        if self.context is not None:
            return {"prompt_in_context": _prompt_in_context(self.context)}
        if self.turns is None:
            return {}
        return {
            "conversation": _joined_turns(self.turns, ROLES, labelled=True),
            "assistant_turns": _joined_turns(self.turns, ("assistant",)),
            "first_user_turn": _turn_contents(self.turns, ("user",)).list.first(),
        }

    def with_views(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` plus ``views`` (unchanged for a format without turns)."""
        return frame.with_columns(**self.views) if self.views else frame


SHAREGPT_TURNS = "conversations"  # the ShareGPT shape's name for a conversation's turns


def turns_json(column: str) -> pl.Expr:
    """Each row's turns as one string, each turn's role and content as JSON (which escapes the
    separator), in order: what content and exact hashes of a conversation are taken over, so no
    content can pass for a turn boundary."""
    return pl.col(column).list.eval(pl.element().struct.json_encode()).list.join("\x1f")


def has_turns(column: str) -> pl.Expr:
    """Whether each row's nullable column of turns holds any."""
    return pl.col(column).list.len().fill_null(0) > 0


def _prompt_in_context(context: str) -> pl.Expr:
    earlier = _joined_turns(context, ROLES, labelled=True)
    in_context = pl.concat_str(earlier, pl.lit("\n\nuser: "), pl.col("prompt"))
    return pl.when(has_turns(context)).then(in_context).otherwise(pl.col("prompt"))


def _turn_contents(column: str, roles: tuple[str, ...]) -> pl.Expr:
    turn = pl.element()
    return pl.col(column).list.eval(
        turn.filter(turn.struct.field("role").is_in(roles)).struct.field("content")
    )


def _joined_turns(column: str, roles: tuple[str, ...], labelled: bool = False) -> pl.Expr:
    """The contents of the turns of ``roles``, in order, a blank line apart (each after its role
    and a colon when ``labelled``)."""
    if not labelled:
        return _turn_contents(column, roles).list.join("\n\n")
    turn = pl.element()
    return (
        pl.col(column)
        .list.eval(
            pl.concat_str(turn.struct.field("role"), pl.lit(": "), turn.struct.field("content"))
        )
        .list.join("\n\n")
    )


SFT = RecordFormat(
    name="sft",
    required=("prompt", "response"),
    optional_text=("system",),
    optional_numbers=(),
    dedup=("prompt", "response"),
    answers=("response",),
    judged="response",
    decontaminate=("prompt", "response"),
    split_key="exact_hash",
    objective="sft",
    bronze_table="records",
    silver_table="records",
    about="sft records (prompt, response: the default format)",
)
# Several pairs for one prompt are legitimate, so all of one prompt's pairs share a side of the
# split.
PREFERENCE = RecordFormat(
    name="preference",
    required=("prompt", "chosen", "rejected"),
    optional_text=("system",),
    optional_numbers=("score_chosen", "score_rejected"),
    # a flat pair's prompt_in_context is its prompt: its hashes are what they were before context
    dedup=("prompt_in_context", "chosen", "rejected"),
    answers=("chosen", "rejected"),
    judged="chosen",
    # the context every turn on its own (``prompt_messages[i]`` in the evidence)
    decontaminate=("system", "prompt_messages", "prompt", "chosen", "rejected"),
    split_key="prompt_hash",
    objective="dpo",
    bronze_table="preference_records",
    silver_table="preference_pairs",
    about="preference pairs (prompt, chosen, rejected)",
    context="prompt_messages",
)
# Two conversations are near duplicates only when their assistant turns are too, as sft records
# whose prompts are alike; every turn is checked against the eval sets; variants of a conversation
# (the same first question) share a side of the split.
CONVERSATION = RecordFormat(
    name="conversation",
    required=(),
    optional_text=(),
    optional_numbers=(),
    turns="messages",
    dedup=("conversation",),
    answers=("assistant_turns",),
    judged="assistant_turns",
    # every turn on its own (``messages[i]`` in the evidence): no n-gram spans two turns, and a
    # short eval answer matches a turn that is exactly it
    decontaminate=("messages",),
    split_key="prompt_hash",  # of the first user turn
    objective="sft",
    bronze_table="conversations",
    silver_table="conversations",
    about="conversations (messages: system, user and assistant turns)",
)
FORMATS = {f.name: f for f in (SFT, PREFERENCE, CONVERSATION)}


def all_text_fields() -> tuple[str, ...]:
    """Every format's text fields (read when called: a format added to ``FORMATS`` counts at
    once)."""
    return tuple(dict.fromkeys(name for f in FORMATS.values() for name in f.text))


def format_named(name: str) -> RecordFormat:
    """The format called ``name``; an unknown name fails, listing the formats there are."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown record format {name!r}; one of {', '.join(FORMATS)}") from None


def record_chars(columns: Iterable[str] = SFT.text) -> pl.Expr:
    """Characters of each record's text (prompt, response and system): the work a data stage
    does."""
    return pl.sum_horizontal(pl.col(c).str.len_chars().fill_null(0) for c in columns)


def text_chars(frame: pl.DataFrame) -> int:
    """Characters of every record's text in ``frame`` (the text fields of whichever format it
    holds), as ``record_chars`` counts them."""
    columns = [c for c in all_text_fields() if c in frame.columns]
    turns = [c for c, dtype in frame.schema.items() if dtype == TURNS]
    if frame.is_empty() or not (columns or turns):
        return 0
    contents = [
        pl.col(c).list.eval(pl.element().struct.field("content").str.len_chars()).list.sum()
        for c in turns
    ]
    chars = pl.sum_horizontal(record_chars(columns), *contents) if columns else sum(contents)
    return int(frame.select(chars).to_series().sum())
