import polars as pl

from pipeline_assets.lib.formats import CONVERSATION, SFT, TURNS, text_chars

TURNS_OF_ONE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."},
]


def test_a_conversations_views_are_the_text_of_its_turns_by_role():
    frame = pl.DataFrame({"messages": [TURNS_OF_ONE]}, schema={"messages": TURNS})

    views = CONVERSATION.with_views(frame).row(0, named=True)

    assert views["assistant_turns"] == "Hello.\n\nBye."
    assert "context_turns" not in views, "decontamination reads each turn, not a view"
    assert views["first_user_turn"] == "Hi?"
    assert views["conversation"].split("\n\n")[:2] == ["system: Be brief.", "user: Hi?"]
    assert SFT.with_views(frame) is frame


def test_text_chars_counts_the_contents_of_turns():
    frame = pl.DataFrame({"messages": [TURNS_OF_ONE]}, schema={"messages": TURNS})

    assert text_chars(frame) == sum(len(t["content"]) for t in TURNS_OF_ONE)
    assert text_chars(frame.with_columns(prompt=pl.lit("abc"))) == text_chars(frame) + 3


def test_a_conversation_is_recognized_by_its_turns_in_either_shape():
    assert CONVERSATION.looks_like({"messages"})
    assert CONVERSATION.looks_like({"conversations", "id"})
    assert not CONVERSATION.looks_like({"prompt", "response"})
    assert not SFT.looks_like({"messages"})
