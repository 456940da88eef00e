"""The landing contract of a conversation source: `messages` lines and Parquet rows, the ShareGPT
shape, and a reason code for every way a conversation is broken."""

from __future__ import annotations

import io

import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, TURNS
from pipeline_assets.lib.landing.files import read_landing_file, read_landing_file_exact
from pipeline_assets.lib.landing.health import schema_drift_hints
from pipeline_assets_tests.conftest import jsonl_bytes


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


CHAT = [
    turn("system", "You answer in one line."),
    turn("user", "What is a Delta table?"),
    turn("assistant", "A Parquet table with a transaction log."),
    turn("user", "And time travel?"),
    turn("assistant", "Reading an older version of its log."),
]
SHAREGPT = {
    "id": "sg1",
    "conversations": [
        {"from": "system", "value": "You answer in one line."},
        {"from": "human", "value": "What is a Delta table?"},
        {"from": "gpt", "value": "A Parquet table with a transaction log."},
    ],
}

# (record, reason, words its detail must hold): one case per reason code of a conversation
BROKEN = [
    ({"messages": "hello"}, "wrong_type:messages", ["list of turns", "string"]),
    ({"messages": []}, "empty_field:messages", ["no turn"]),
    ({"messages": [CHAT[1], "hi"]}, "wrong_type:messages", ["turn 1", "object"]),
    ({"messages": [CHAT[1], {"role": "user", "text": "x"}]}, "wrong_type:messages", ["turn 1"]),
    ({"messages": [CHAT[1], turn("assistant", 42)]}, "wrong_type:messages", ["turn 1", "number"]),
    ({"messages": [turn("tool", "{}"), CHAT[2]]}, "unknown_role", ["turn 0", "'tool'"]),
    ({"messages": [CHAT[1], turn("assistant", "  \n")]}, "empty_turn", ["turn 1", "assistant"]),
    ({"messages": [CHAT[1], turn("assistant", None)]}, "empty_turn", ["turn 1"]),
    ({"messages": CHAT[:2]}, "no_assistant_turn", ["2 turns"]),
    ({"messages": CHAT[:4]}, "ends_on_user_turn", ["turn 3"]),
    ({"messages": [*CHAT[1:3], turn("system", "Be kind.")]}, "ends_on_system_turn", ["turn 2"]),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "unknown_role", ["turn 0", "'bot'"]),
    ({"prompt": "p", "response": "r"}, "missing_field:messages", ["prompt", "response"]),
]


def _read(rows: list, name: str = "chats.jsonl"):
    return read_landing_file(name, jsonl_bytes(rows), record_format=CONVERSATION)


def test_a_conversation_is_stored_as_its_turns_with_a_hash_of_them():
    result = _read([{"messages": CHAT, "id": "c1", "meta": {"lang": "en"}, "rating": 5}])

    row = result.records.row(0, named=True)
    assert result.records.schema["messages"] == TURNS
    assert row["messages"] == CHAT
    assert (row["id"], row["meta"], row["extra"]) == ("c1", '{"lang":"en"}', '{"rating":5}')
    assert "prompt" not in result.records.columns and len(row["content_hash"]) == 32


def test_the_content_hash_covers_every_turns_role_and_content():
    hashes = _read(
        [
            {"messages": CHAT},
            {"messages": CHAT, "id": "same words, another id"},
            {"messages": [*CHAT[:4], turn("assistant", "Reading an older version.")]},
            {"messages": [turn("user", CHAT[0]["content"]), *CHAT[1:]]},  # a role changed
        ]
    ).records["content_hash"]

    assert hashes[0] == hashes[1]
    assert hashes.n_unique() == 3


def test_the_sharegpt_shape_is_stored_as_messages():
    stored = _read([SHAREGPT]).records.row(0, named=True)

    assert stored["messages"] == CHAT[:3]
    assert stored["extra"] is None, "the turns are the record, not an unknown field"
    assert stored["content_hash"] == _read([{"messages": CHAT[:3]}]).records["content_hash"][0]


@pytest.mark.parametrize("broken, reason, words", BROKEN)
def test_each_broken_conversation_is_quarantined_with_its_own_reason(broken, reason, words):
    result = _read([{"messages": CHAT}, broken])

    assert result.records["source_line"].to_list() == [1]
    quarantined = result.quarantine.row(0, named=True)
    assert (quarantined["source_line"], quarantined["reason"]) == (2, reason)
    assert all(word in quarantined["detail"] for word in words), quarantined["detail"]
    assert result.lines_read == 2


def test_parquet_rows_of_both_shapes_are_read_like_lines():
    buffer = io.BytesIO()
    rows = [{"id": "c1", "messages": CHAT}, {"id": "c2", "messages": CHAT[:4]}]
    pl.DataFrame(rows).write_parquet(buffer)
    sharegpt = io.BytesIO()
    pl.DataFrame([SHAREGPT]).write_parquet(sharegpt)

    messages = read_landing_file("chats.parquet", buffer.getvalue(), record_format=CONVERSATION)
    shared = read_landing_file("sg.parquet", sharegpt.getvalue(), record_format=CONVERSATION)

    assert messages.records["messages"].to_list() == [CHAT]
    assert messages.quarantine["reason"].to_list() == ["ends_on_user_turn"]
    assert shared.records["messages"].to_list() == [CHAT[:3]]


def test_conversations_take_the_exact_path_whole():
    data = jsonl_bytes([{"messages": CHAT}, *(broken for broken, _, _ in BROKEN), SHAREGPT])

    fast = read_landing_file("c.jsonl", data, record_format=CONVERSATION)
    exact = read_landing_file_exact("c.jsonl", data, record_format=CONVERSATION)

    assert fast.records.equals(exact.records) and fast.quarantine.equals(exact.quarantine)
    assert fast.records.height == 2 and fast.quarantine.height == len(BROKEN)


def test_schema_drift_names_the_format_entry_for_conversations_in_an_sft_source():
    sft_source = read_landing_file("c.jsonl", jsonl_bytes([{"messages": CHAT}] * 3))
    quarantine = sft_source.quarantine.with_columns(source=pl.lit("support"))

    (hint,) = schema_drift_hints(quarantine, {})

    assert hint["record_format"] == "conversation" and hint["lines_of_that_format"] == 3
    assert hint["fix"] == """PIPELINE_SOURCE_FORMATS='{"support": "conversation"}'"""


def test_schema_drift_names_sft_for_sft_records_in_a_conversation_source():
    landed = _read([{"prompt": "p", "response": "r"}] * 2)
    quarantine = landed.quarantine.with_columns(source=pl.lit("chats"))

    (hint,) = schema_drift_hints(quarantine, {"chats": "conversation"})

    assert hint["record_format"] == "sft" and hint["missing_field"] == "messages"
