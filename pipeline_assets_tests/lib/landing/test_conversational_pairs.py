"""The landing contract of preference pairs in TRL's conversational shape: `prompt` a list of
turns ending on a user turn, `chosen` and `rejected` one assistant turn each, stored as the flat
shape's fields plus the earlier turns, with a reason code for every way the shape is broken."""

from __future__ import annotations

import io

import polars as pl
import pytest

from pipeline_assets.lib.formats import PREFERENCE, TURNS
from pipeline_assets.lib.landing.files import read_landing_file, read_landing_file_exact
from pipeline_assets_tests.conftest import jsonl_bytes


def turn(role: str, content: str | None) -> dict:
    return {"role": role, "content": content}


SYSTEM = turn("system", "You answer in one line.")
EARLIER = [turn("user", "What is a Delta table?"), turn("assistant", "Parquet plus a log.")]
QUESTION = turn("user", "And time travel?")
CHOSEN, REJECTED = [turn("assistant", "Reading an older version.")], [turn("assistant", "No.")]


def chat_pair(prompt: list, chosen: object = CHOSEN, rejected: object = REJECTED, **more) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **more}


FLAT = {"prompt": "And time travel?", "chosen": "Reading an older version.", "rejected": "No."}

# (record, reason, words its detail must hold): one case per way the conversational shape breaks
BROKEN = [
    (chat_pair([]), "empty_field:prompt", ["no turn"]),
    (chat_pair([EARLIER[0], "hi"]), "wrong_type:prompt", ["prompt turn 1", "object"]),
    (chat_pair([{"role": "user", "text": "x"}]), "wrong_type:prompt", ["prompt turn 0"]),
    (chat_pair([turn("tool", "{}"), QUESTION]), "unknown_role", ["prompt turn 0", "'tool'"]),
    (chat_pair([turn("user", " ")]), "empty_turn", ["prompt turn 0", "user"]),
    (chat_pair(EARLIER), "prompt_ends_on_assistant_turn", ["prompt turn 1"]),
    (chat_pair([QUESTION, SYSTEM]), "prompt_ends_on_system_turn", ["prompt turn 1"]),
    (chat_pair([QUESTION], chosen="Plain text."), "wrong_type:chosen", ["list", "string"]),
    (chat_pair([QUESTION], chosen=[]), "not_one_turn:chosen", ["0 turns"]),
    (chat_pair([QUESTION], rejected=REJECTED * 2), "not_one_turn:rejected", ["2 turns"]),
    (chat_pair([QUESTION], rejected=[QUESTION]), "not_assistant:rejected", ["user"]),
    (chat_pair([QUESTION], chosen=[turn("bot", "x")]), "unknown_role", ["chosen turn 0"]),
    (chat_pair([QUESTION], chosen=[turn("assistant", "")]), "empty_turn", ["chosen turn 0"]),
    (chat_pair([QUESTION], chosen=["x"]), "wrong_type:chosen", ["chosen turn 0"]),
    (chat_pair([QUESTION], rejected=None), "missing_field:rejected", ["'rejected'"]),
    (chat_pair([SYSTEM, QUESTION], system="Be kind."), "system_twice", ["'system'"]),
    ({**FLAT, "chosen": CHOSEN}, "wrong_type:chosen", ["string"]),  # shapes mixed in one line
]


def _read(rows: list, name: str = "prefs.jsonl"):
    return read_landing_file(name, jsonl_bytes(rows), record_format=PREFERENCE)


def test_a_conversational_pair_is_stored_as_prompt_answers_system_and_earlier_turns():
    records = _read(
        [chat_pair([SYSTEM, *EARLIER, QUESTION], id="c1"), chat_pair([QUESTION]), FLAT]
    ).records

    assert records.schema["prompt_messages"] == TURNS
    stored = records.select("system", "prompt_messages", "prompt", "chosen", "rejected").rows()
    assert stored == [
        (
            "You answer in one line.",
            EARLIER,
            "And time travel?",
            "Reading an older version.",
            "No.",
        ),
        (None, None, "And time travel?", "Reading an older version.", "No."),
        (None, None, "And time travel?", "Reading an older version.", "No."),
    ]
    assert records["content_hash"][1] == records["content_hash"][2], (
        "a prompt of one user turn is the flat pair it says"
    )
    assert records["extra"].null_count() == 3


def test_the_content_hash_covers_the_earlier_turns():
    hashes = _read(
        [
            chat_pair([*EARLIER, QUESTION]),
            chat_pair([EARLIER[0], turn("assistant", "A lake table."), QUESTION]),
            chat_pair([EARLIER[1], EARLIER[0], QUESTION]),  # the same words, other roles
            chat_pair([QUESTION]),
            chat_pair([*EARLIER, QUESTION]),
        ]
    ).records["content_hash"]

    assert hashes[0] == hashes[4] and hashes[:4].n_unique() == 4


@pytest.mark.parametrize("broken, reason, words", BROKEN)
def test_each_broken_conversational_pair_is_quarantined_with_its_own_reason(broken, reason, words):
    result = _read([chat_pair([QUESTION]), broken])

    assert result.records["source_line"].to_list() == [1]
    quarantined = result.quarantine.row(0, named=True)
    assert (quarantined["source_line"], quarantined["reason"]) == (2, reason)
    assert all(word in quarantined["detail"] for word in words), quarantined["detail"]
    assert result.lines_read == 2


def test_both_shapes_mix_line_by_line_in_jsonl_and_parquet_and_both_readers_agree():
    lines = [FLAT, chat_pair([SYSTEM, *EARLIER, QUESTION]), *(b for b, _, _ in BROKEN)]
    data = jsonl_bytes(lines)
    fast = read_landing_file("p.jsonl", data, record_format=PREFERENCE)
    exact = read_landing_file_exact("p.jsonl", data, record_format=PREFERENCE)
    assert fast.records.equals(exact.records) and fast.quarantine.equals(exact.quarantine)
    assert fast.records.height == 2 and fast.quarantine.height == len(BROKEN)

    buffer = io.BytesIO()
    pl.DataFrame([chat_pair([SYSTEM, *EARLIER, QUESTION]), chat_pair(EARLIER)]).write_parquet(
        buffer
    )
    parquet = read_landing_file("p.parquet", buffer.getvalue(), record_format=PREFERENCE)
    assert parquet.records["prompt_messages"].to_list() == [EARLIER]
    assert parquet.quarantine["reason"].to_list() == ["prompt_ends_on_assistant_turn"]
