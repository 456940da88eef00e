"""What gold trains on, as conversations: an sft record is a conversation of one exchange, and a
conversation's loss covers its assistant turns (every one, or only the last).

Both encoders (``lib.gold.encoder``) take a frame of ``record_id`` and ``messages`` (a list of
``role``/``content`` structs, ``formats.TURNS``); sft records reach them through
``records_as_conversations``, so one code path renders and masks both formats. No Dagster, no torch.
"""

from __future__ import annotations

from typing import TypeVar

import polars as pl

from pipeline_assets.lib.formats import TURNS, RecordFormat

FrameT = TypeVar("FrameT", pl.DataFrame, pl.LazyFrame)
ALL, LAST = "all", "last"
LOSS_MODES = (ALL, LAST)  # PIPELINE_CONVERSATION_LOSS
DEFAULT_LOSS = ALL
ASSISTANT_ROLE = "assistant"


def check_loss_mode(mode: str) -> None:
    if mode not in LOSS_MODES:
        raise ValueError(
            f"PIPELINE_CONVERSATION_LOSS must be one of {', '.join(map(repr, LOSS_MODES))}, not "
            f"{mode!r}"
        )


def trained_turns(roles: list[str], loss: str) -> list[int]:
    """The positions of the turns the loss covers: every assistant turn (``all``) or the last one
    (``last``)."""
    turns = [k for k, role in enumerate(roles) if role == ASSISTANT_ROLE]
    return turns[-1:] if loss == LAST else turns


def records_as_conversations(frame: FrameT, context: str | None = None) -> FrameT:
    """sft records (record_id, system (nullable), prompt, response) -> record_id, messages:
    [system], user, assistant; no system turn when ``system`` is null or empty. ``context``: a
    nullable column of turns that come between the system turn and the user turn (a conversational
    preference pair's earlier turns)."""
    turn = pl.element()
    no_system = (turn.struct.field("role") == "system") & (
        turn.struct.field("content").fill_null("") == ""
    )
    earlier = [pl.col(context).fill_null(pl.lit([], dtype=TURNS))] if context else []
    messages = pl.concat_list(
        _turn("system", "system"),
        *earlier,
        _turn("user", "prompt"),
        _turn(ASSISTANT_ROLE, "response"),
    ).list.eval(turn.filter(~no_system))
    return frame.select("record_id", messages.cast(TURNS).alias("messages"))


def format_messages(rows: FrameT, fmt: RecordFormat) -> FrameT:
    """A format's rows (eager or lazy) as record_id and messages: a format with turns as its turns,
    an sft-shaped one as [system], user and its judged answer."""
    if fmt.turns:
        return rows.select("record_id", pl.col(fmt.turns).alias("messages"))
    return records_as_conversations(
        rows.select("record_id", "system", "prompt", pl.col(fmt.judged).alias("response"))
    )


def _turn(role: str, column: str) -> pl.Expr:
    return pl.struct(role=pl.lit(role), content=pl.col(column))


def conversations_without_an_assistant_turn(frame: pl.DataFrame) -> list[str]:
    """The record ids of conversations with no assistant turn: nothing of theirs can be trained."""
    has_answer = pl.col("messages").list.eval(
        (pl.element().struct.field("role") == ASSISTANT_ROLE).any()
    )
    return frame.filter(~has_answer.list.first().fill_null(False))["record_id"].to_list()
