"""The landing contract for one record: its fields, their types, and the reason code of each broken
rule.

Both readers use it: the exact per-line path calls ``validate_landing_object`` on every parsed
record; the fast path (``landing_fast``) proves a clean line meets the same rules without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone

import orjson
import polars as pl
import polars_hash as plh

from pipeline_assets.lib.formats import (
    ROLES,
    SFT,
    SHAREGPT_TURNS,
    TURNS,
    RecordFormat,
    has_turns,
    turns_json,
)

KNOWN_FIELDS = SFT.known
# The ShareGPT shape's turn fields and roles, as the chat shape names them.
SHAREGPT_TURN = ("from", "value")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
# The fields a conversational pair's turns land in (``RecordFormat.context``).
PROMPT, SYSTEM = "prompt", "system"


def parsed_schema(fmt: RecordFormat) -> pl.Schema:
    """What a reader collects for each accepted record of ``fmt``; ``with_content_hash`` completes
    it to ``record_schema``."""
    return pl.Schema(
        {
            "source_line": pl.Int64,
            **({fmt.turns: TURNS} if fmt.turns else {}),
            **({fmt.context: TURNS} if fmt.context else {}),
            **{name: pl.String for name in fmt.required + fmt.optional_text},
            **{name: pl.Float64 for name in fmt.optional_numbers},
            "id": pl.String,
            "created_at": pl.Datetime("us", "UTC"),
            "meta": pl.String,
            "extra": pl.String,
        }
    )


def record_schema(fmt: RecordFormat) -> pl.Schema:
    return pl.Schema({**parsed_schema(fmt), "content_hash": pl.String})


PARSED_SCHEMA = parsed_schema(SFT)
QUARANTINE_SCHEMA = pl.Schema(
    {"source_line": pl.Int64, "raw": pl.String, "reason": pl.String, "detail": pl.String}
)


class Rejected(Exception):
    """A record that breaks the landing contract; ``reason`` is the short code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def with_content_hash(records: pl.LazyFrame, fmt: RecordFormat = SFT) -> pl.LazyFrame:
    """Add ``content_hash``: a 128-bit hash of what a record says (not where it came from), the
    first 32 hex digits of BLAKE3 over its text joined by U+001F (sft: system, prompt and response;
    a missing optional text counts as empty; a conversation: each turn's role and content, as JSON;
    a conversational pair: its earlier turns too, as JSON, after the rest). Vectorized, so both
    readers hash a whole file at once (lazily: on every polars thread)."""
    turns = [turns_json(fmt.turns)] if fmt.turns else []
    texts = (*(pl.col(name).fill_null("") for name in fmt.optional_text), *fmt.required, *turns)
    payload = plh.concat_str(*texts, separator="\x1f")
    if fmt.context:
        in_context = plh.concat_str(*texts, turns_json(fmt.context), separator="\x1f")
        payload = pl.when(has_turns(fmt.context)).then(in_context).otherwise(payload)
    return records.with_columns(content_hash=payload.chash.blake3().str.slice(0, 32))


def validate_landing_object(
    obj: object, field_mapping: Mapping[str, str], fmt: RecordFormat = SFT
) -> tuple:
    """Check one parsed record against the landing contract of ``fmt``.

    Returns the values of ``parsed_schema(fmt)`` but ``source_line`` (sft: ``(prompt, response,
    system, id, created_at, meta_json, extra_json)``; a conversation: its turns first; a
    preference pair: its earlier turns first, None unless its prompt is a list of turns) or raises
    ``Rejected`` with the first broken rule, in that order.
    """
    if not isinstance(obj, dict):
        raise Rejected("not_an_object", f"expected a JSON object, got {_json_type(obj)}")
    if field_mapping:
        obj = _apply_mapping(obj, field_mapping)
    turns_key = _turns_key(obj, fmt)
    unknown = [key for key in obj if key not in fmt.known and key != turns_key]
    turns = [_required_turns(obj, turns_key, unknown)] if fmt.turns else []
    if fmt.context and isinstance(obj.get(PROMPT), list):
        context, required, system = _conversational_pair(obj, fmt)
    else:
        context, system = None, None
        required = [_required_text(obj, name, unknown) for name in fmt.required]
    turns += [context] if fmt.context else []
    texts = [_optional_text(obj, name) for name in fmt.optional_text]
    texts = _with_system_turn(texts, fmt, system)
    numbers = [_optional_number(obj, name) for name in fmt.optional_numbers]
    source_id = _optional_id(obj)
    created_at = _optional_timestamp(obj, "created_at")
    meta = _optional_object_json(obj, "meta")
    extra = _json_text({key: obj[key] for key in unknown}, "extra") if unknown else None
    return *turns, *required, *texts, *numbers, source_id, created_at, meta, extra


def _conversational_pair(obj: dict, fmt: RecordFormat) -> tuple[list | None, list[str], str | None]:
    """A pair in TRL's conversational shape: ``prompt`` a list of turns ending on a user turn, each
    answer a list of one assistant turn. Returns (the turns between a leading system turn and the
    final user turn, or None when there are none; the final user turn's text and each answer's;
    the leading system turn's text or None), or ``Rejected``."""
    value = obj[PROMPT]
    if not value:
        raise Rejected(f"empty_field:{PROMPT}", f"'{PROMPT}' holds no turn")
    prompt = [_turn(turn, index, False, PROMPT) for index, turn in enumerate(value)]
    last = prompt[-1]["role"]
    if last != "user":
        raise Rejected(
            f"prompt_ends_on_{last}_turn",
            f"{PROMPT} turn {len(prompt) - 1}, the last, is a {last} turn: a conversational "
            "pair's prompt ends with the user turn its answers reply to",
        )
    answers = [_answer_turn(obj, name) for name in fmt.required if name != PROMPT]
    system = prompt[0]["content"] if prompt[0]["role"] == "system" else None
    earlier = prompt[1 if system is not None else 0 : -1]
    return earlier or None, [prompt[-1]["content"], *answers], system


def _answer_turn(obj: dict, name: str) -> str:
    """The text of a conversational pair's answer: a list holding one assistant turn."""
    value = obj.get(name)
    if value is None:
        raise Rejected(f"missing_field:{name}", f"required field '{name}' is absent or null")
    if not isinstance(value, list):
        raise Rejected(
            f"wrong_type:{name}",
            f"'{name}' of a pair whose prompt is a list of turns must be a list holding its "
            f"assistant turn, got {_json_type(value)}",
        )
    if len(value) != 1:
        raise Rejected(
            f"not_one_turn:{name}", f"'{name}' holds {len(value)} turns; an answer is one turn"
        )
    turn = _turn(value[0], 0, False, name)
    if turn["role"] != "assistant":
        raise Rejected(
            f"not_assistant:{name}", f"{name} turn 0 is a {turn['role']} turn, not the assistant's"
        )
    return turn["content"]


def _with_system_turn(texts: list, fmt: RecordFormat, system: str | None) -> list:
    """``texts`` (the optional text fields) with a conversational prompt's leading system turn as
    ``system``; ``Rejected`` when the record also has a ``system`` field."""
    if system is None:
        return texts
    at = fmt.optional_text.index(SYSTEM)
    if texts[at] is not None:
        raise Rejected(
            "system_twice",
            f"'{SYSTEM}' is given and '{PROMPT}' starts with a system turn: which one is meant?",
        )
    return [*texts[:at], system, *texts[at + 1 :]]


def _turns_key(obj: dict, fmt: RecordFormat) -> str | None:
    """Where the record keeps its turns: the format's field, else the ShareGPT shape's; None for a
    format without turns."""
    if not fmt.turns:
        return None
    if obj.get(fmt.turns) is None and obj.get(SHAREGPT_TURNS) is not None:
        return SHAREGPT_TURNS
    return fmt.turns


def _required_turns(obj: dict, key: str, unknown: list[str]) -> list[dict]:
    """The turns under ``key`` as ``{"role", "content"}`` structs, checked turn by turn in order
    (ShareGPT's ``from``/``value`` and its roles mapped to the chat shape's), then as a
    conversation: one that has an assistant turn and ends with one."""
    value = obj.get(key)
    if value is None:
        hint = f"; unknown field(s) present: {', '.join(unknown)}" if unknown else ""
        raise Rejected(
            "missing_field:messages",
            f"neither 'messages' nor '{SHAREGPT_TURNS}' holds the turns{hint}",
        )
    if not isinstance(value, list):
        raise Rejected(
            "wrong_type:messages", f"'{key}' must be a list of turns, got {_json_type(value)}"
        )
    if not value:
        raise Rejected("empty_field:messages", f"'{key}' holds no turn")
    sharegpt = key == SHAREGPT_TURNS
    turns = [_turn(turn, index, sharegpt) for index, turn in enumerate(value)]
    roles = [turn["role"] for turn in turns]
    if "assistant" not in roles:
        raise Rejected(
            "no_assistant_turn",
            f"none of its {len(turns)} turns is an assistant turn (roles: {', '.join(roles)})",
        )
    if roles[-1] != "assistant":
        raise Rejected(
            f"ends_on_{roles[-1]}_turn",
            f"turn {len(turns) - 1}, the last, is a {roles[-1]} turn: a conversation ends with an "
            "assistant turn, the answer it trains",
        )
    return turns


def _turn(turn: object, index: int, sharegpt: bool, field: str = "messages") -> dict:
    """One turn of ``field`` as ``{"role", "content"}``, or ``Rejected`` naming its index (and the
    field, when it is not a conversation's ``messages``)."""
    role_key, content_key = SHAREGPT_TURN if sharegpt else ("role", "content")
    where = f"turn {index}" if field == "messages" else f"{field} turn {index}"
    if not isinstance(turn, dict):
        raise Rejected(
            f"wrong_type:{field}",
            f"{where} must be an object with '{role_key}' and '{content_key}', got "
            f"{_json_type(turn)}",
        )
    others = sorted(
        k for k, v in turn.items() if k not in (role_key, content_key) and v is not None
    )
    if others or role_key not in turn:
        found = f"field(s) {', '.join(others)}" if others else f"no '{role_key}'"
        raise Rejected(
            f"wrong_type:{field}",
            f"{where} must hold '{role_key}' and '{content_key}' only, has {found}",
        )
    role, content = turn[role_key], turn.get(content_key)
    for name, value in ((role_key, role), (content_key, content)):
        if not isinstance(value, str) and (value is not None or name == role_key):
            raise Rejected(
                f"wrong_type:{field}",
                f"{where}: '{name}' must be a string, got {_json_type(value)}",
            )
    known = SHAREGPT_ROLES if sharegpt else dict(zip(ROLES, ROLES, strict=True))
    if role not in known:
        raise Rejected(
            "unknown_role",
            f"{where}: {role_key} {role!r} is not one of {', '.join(known)}",
        )
    if content is None or not content.strip():
        raise Rejected("empty_turn", f"{where} ({known[role]}) has no content")
    return {"role": known[role], "content": content}


def _apply_mapping(obj: dict, field_mapping: Mapping[str, str]) -> dict:
    mapped = dict(obj)
    for theirs, ours in field_mapping.items():
        if theirs in mapped and ours not in mapped:
            mapped[ours] = mapped.pop(theirs)
    return mapped


def _required_text(obj: dict, name: str, unknown: list[str]) -> str:
    value = obj.get(name)
    if value is None:
        hint = f"; unknown field(s) present: {', '.join(unknown)}" if unknown else ""
        raise Rejected(f"missing_field:{name}", f"required field '{name}' is absent or null{hint}")
    if not isinstance(value, str):
        raise Rejected(f"wrong_type:{name}", f"'{name}' must be a string, got {_json_type(value)}")
    if not value.strip():
        raise Rejected(f"empty_field:{name}", f"'{name}' is empty or whitespace only")
    return value


def _optional_text(obj: dict, name: str) -> str | None:
    value = obj.get(name)
    if value is None or isinstance(value, str):
        return value
    raise Rejected(f"wrong_type:{name}", f"'{name}' must be a string, got {_json_type(value)}")


def _optional_number(obj: dict, name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise Rejected(f"wrong_type:{name}", f"'{name}' must be a number, got {_json_type(value)}")


def _optional_id(obj: dict) -> str | None:
    value = obj.get("id")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # sources often number their records: keep the id, as text
    raise Rejected("wrong_type:id", f"'id' must be a string or an integer, got {_json_type(value)}")


def _optional_timestamp(obj: dict, name: str) -> datetime | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise Rejected(
                f"invalid_timestamp:{name}", f"'{name}'={value!r} is not an RFC 3339 timestamp"
            ) from None
    if not isinstance(value, datetime):
        raise Rejected(
            f"wrong_type:{name}", f"'{name}' must be an RFC 3339 string, got {_json_type(value)}"
        )
    if value.tzinfo is None:
        raise Rejected(
            f"invalid_timestamp:{name}", f"'{name}'={value.isoformat()!r} has no UTC offset"
        )
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:
        raise Rejected(
            f"invalid_timestamp:{name}",
            f"'{name}'={value.isoformat()!r} is outside the years 1 to 9999 in UTC",
        ) from None


def _optional_object_json(obj: dict, name: str) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(f"wrong_type:{name}", f"'{name}' must be an object, got {_json_type(value)}")
    return _json_text(value, name)


def _json_text(value: object, name: str) -> str:
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:  # orjson writes 255 levels of nesting, where it reads 1024
        raise Rejected(
            f"too_deep:{name}",
            f"'{name}' is nested deeper than the 255 levels a JSON text column holds",
        ) from None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)
