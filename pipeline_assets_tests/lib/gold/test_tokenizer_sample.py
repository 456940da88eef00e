import hashlib

import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, SFT, TURNS
from pipeline_assets.lib.gold.chat_format import conversation_text, prefix_text, response_text
from pipeline_assets.lib.gold.splits import TRAIN, assign_split
from pipeline_assets.lib.gold.tokenizer_sample import sample_for_tokenizer

VALIDATION_FRACTION, SEARCH_FRACTION = 0.3, 0.2  # half the records are not training records


def batch(name: str, n: int) -> pl.DataFrame:
    responses = [f"answer {i} of {name} " + "word " * (i % 37) for i in range(n)]
    return pl.DataFrame(
        {
            "record_id": [f"{name}-{i:05d}" for i in range(n)],
            "exact_hash": [
                hashlib.blake2b(text.encode(), digest_size=16).hexdigest() for text in responses
            ],
            "system": [None if i % 3 else "be brief" for i in range(n)],
            "prompt": [f"question {i}" for i in range(n)],
            "response": responses,
        }
    )


def sample(frame: pl.DataFrame, max_chars: int, conversations: pl.DataFrame | None = None):
    silver = {SFT: frame.lazy()}
    if conversations is not None:
        silver[CONVERSATION] = conversations.lazy()
    return sample_for_tokenizer(silver, max_chars, VALIDATION_FRACTION, SEARCH_FRACTION)


def chars(frame: pl.DataFrame) -> int:
    """Characters of sft records' text, or of the sample's messages."""
    if "messages" in frame.columns:
        return sum(len(turn["content"]) for turns in frame["messages"] for turn in turns)
    return sum(
        len(text or "") for column in ("system", "prompt", "response") for text in frame[column]
    )


def chats(n: int) -> pl.DataFrame:
    """Conversations as silver stores them: a first user turn shared by every three (variants of
    one conversation), the content hashed whole."""
    messages = [
        [
            {"role": "user", "content": f"opening question {i // 3}"},
            {"role": "assistant", "content": f"reply {i} " + "more " * (i % 11)},
            {"role": "user", "content": f"follow-up {i}"},
            {"role": "assistant", "content": f"second reply {i}"},
        ]
        for i in range(n)
    ]
    digest = [hashlib.blake2b(repr(m).encode(), digest_size=16).hexdigest() for m in messages]
    first = [
        hashlib.blake2b(m[0]["content"].encode(), digest_size=16).hexdigest() for m in messages
    ]
    return pl.DataFrame(
        {
            "record_id": [f"c-{i:05d}" for i in range(n)],
            "exact_hash": digest,
            "prompt_hash": first,
            "messages": messages,
        },
        schema_overrides={"messages": TURNS},
    )


def test_the_sample_holds_only_training_records_within_the_cap_whatever_the_row_order():
    silver = batch("b1", 2000)
    taken = sample(silver, 20_000)
    train = assign_split(silver, VALIDATION_FRACTION, search_fraction=SEARCH_FRACTION).filter(
        pl.col("split") == TRAIN
    )
    assert set(taken.records["record_id"]) <= set(train["record_id"])
    longest = max(chars(train[i]) for i in range(train.height))
    assert taken.chars == chars(taken.records) and 20_000 - longest < taken.chars <= 20_000, (
        "taken until the cap"
    )
    assert (taken.train_records, taken.train_chars, taken.max_chars) == (
        train.height,
        chars(train),
        20_000,
    )
    assert (
        taken.records["record_id"].to_list()
        != train["record_id"].head(taken.records.height).to_list()
    ), "not the first rows"
    assert sample(silver.sample(fraction=1.0, shuffle=True, seed=7), 20_000).records.equals(
        taken.records
    )


def test_a_new_batch_displaces_only_the_highest_ranked_records():
    first = sample(batch("b1", 2000), 20_000).records["record_id"].to_list()
    after = (
        sample(pl.concat([batch("b1", 2000), batch("b2", 2000)]), 20_000)
        .records["record_id"]
        .to_list()
    )
    kept = [record_id for record_id in after if record_id.startswith("b1")]
    assert kept == first[: len(kept)], (
        "records of the first batch stay in order; those dropped ranked highest"
    )
    assert 0 < len(kept) < len(first), "the new batch took some of the sample's room"


def test_a_cap_below_one_character_is_refused():
    with pytest.raises(ValueError, match="at least 1 character"):
        sample(batch("b1", 10), 0)


def test_conversations_are_sampled_beside_sft_records_on_their_own_split():
    records, conversations = batch("b1", 300), chats(300)
    taken = sample(records, 10**9, conversations)
    train_chats = assign_split(
        conversations, VALIDATION_FRACTION, key="prompt_hash", search_fraction=SEARCH_FRACTION
    ).filter(pl.col("split") == TRAIN)
    sampled_chats = taken.records.filter(pl.col("record_id").str.starts_with("c-"))
    assert set(sampled_chats["record_id"]) == set(train_chats["record_id"]), (
        "every training conversation under a cap that takes all, split by its first user turn"
    )
    alone = sample(records, 10**9)
    assert taken.train_records == alone.train_records + train_chats.height
    assert taken.chars == chars(taken.records) == alone.chars + chars(train_chats)
    by_id = dict(taken.records.iter_rows())
    first = train_chats.row(0, named=True)
    assert by_id[first["record_id"]] == first["messages"], "all its turns, in order"

    only_chats = sample_for_tokenizer(
        {CONVERSATION: conversations.lazy()}, 10**9, VALIDATION_FRACTION, SEARCH_FRACTION
    )
    assert only_chats.train_records == train_chats.height > 0, "no sft record needed"


def test_an_sft_record_renders_to_the_same_text_as_before_conversations():
    records = batch("b1", 40)
    taken = sample(records, 10**9).records
    by_id = {row["record_id"]: row for row in records.iter_rows(named=True)}
    for record_id, messages in taken.iter_rows():
        record = by_id[record_id]
        assert conversation_text(messages) == prefix_text(
            record["system"], record["prompt"]
        ) + response_text(record["response"])
