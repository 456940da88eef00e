"""Silver's curation of conversations: the same stages as sft records, through the format's turns
and views (lib.formats.CONVERSATION), on lib.silver.curation.curate."""

from __future__ import annotations

import json
import random
from functools import partial

import polars as pl

from pipeline_assets.lib.formats import CONVERSATION, TURNS
from pipeline_assets.lib.silver.curation import SilverConfig, curate
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import PROMPT_BAND, band_entries, joined_text, lookup_in
from pipeline_assets.lib.silver.minhash import MinHashConfig, jaccard, signatures
from pipeline_assets.lib.silver.normalize import normalize_records
from pipeline_assets.lib.stages import Stage, from_row, run_in_process, run_stages, to_row
from pipeline_assets_tests.lib.silver.test_curation_blocks import (
    assert_every_stage_accounts_for_its_rows,
)
from pipeline_assets_tests.lib.silver.test_dedup import WORDS, _edited

EVAL_QUESTION = " ".join(f"riddle{i}" for i in range(15))
EVAL_ANSWER = " ".join(f"benchmark{i}" for i in range(20))


def _text(rng: random.Random, words: tuple[int, int] = (30, 60)) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))


def _chat(rng: random.Random, question: str, turns: int = 2) -> list[dict]:
    """A system turn, then ``turns`` user and assistant turns."""
    chat = [{"role": "system", "content": "You are a patient tutor."}]
    for number in range(turns):
        chat.append({"role": "user", "content": question if number == 0 else _text(rng, (8, 15))})
        chat.append({"role": "assistant", "content": _text(rng)})
    return chat


def _conversations(chats: list[list[dict]], batch_id: str = "b1") -> pl.DataFrame:
    """Bronze conversation rows of ``chats``, the rest filled in."""
    return pl.DataFrame(
        {
            "record_id": [f"{batch_id}-{i:05d}" for i in range(len(chats))],
            "batch_id": batch_id,
            "source": "chats",
            "messages": chats,
        },
        schema_overrides={"messages": TURNS},
    )


def _clean(n: int, seed: int = 3) -> list[list[dict]]:
    rng = random.Random(seed)
    return [_chat(rng, f"Question {seed}-{i}: {_text(rng, (8, 15))}?") for i in range(n)]


def _eval_index() -> EvalNgramIndex:
    items = {"eval_set": ["bench"], "item_id": ["1"]}
    return EvalNgramIndex.build(
        pl.DataFrame({**items, "prompt": [EVAL_QUESTION], "response": [EVAL_ANSWER]})
    )


def _curate(bronze: pl.DataFrame, earlier=None, rows_per_block: int = 20_000):
    look_up = lookup_in(earlier.index.lazy()) if earlier is not None else None
    run_blocks = partial(run_in_process, rows_per_block=rows_per_block)
    return curate(bronze, look_up, _eval_index(), SilverConfig(), run_blocks, fmt=CONVERSATION)


def _reject(curated, record_id: str) -> dict | None:
    found = curated.rejects.filter(pl.col("record_id") == record_id)
    return found.row(0, named=True) if found.height else None


def _with_turn(chat: list[dict], index: int, content: str) -> list[dict]:
    return [{**turn, "content": content} if i == index else turn for i, turn in enumerate(chat)]


def test_every_turn_is_normalized_and_its_role_kept():
    chat = [
        {"role": "system", "content": "  Be\u00a0brief.\r\n"},
        {"role": "user", "content": "Cafe\u0301\t\tplease\x07"},
        {"role": "assistant", "content": "One\n\n\n\nTwo"},
    ]
    clean = [{"role": "user", "content": "Fine."}, {"role": "assistant", "content": "Yes."}]

    normalized, _, details = normalize_records(_conversations([chat, clean]))

    assert normalized["messages"].to_list() == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Café please"},
            {"role": "assistant", "content": "One\n\nTwo"},
        ],
        clean,
    ]
    assert details["messages_changed"] == 1


def test_exact_dedup_compares_whole_conversations_after_normalization():
    rows = _clean(5)
    rows.append(_with_turn(rows[0], 2, rows[0][2]["content"].replace(" ", "  \t")))  # a copy
    rows.append(_with_turn(rows[1], 4, "An answer of its own to the second question, in words."))

    curated = _curate(_conversations(rows))

    assert _reject(curated, "b1-00005")["stage"] == "exact_dup"
    assert json.loads(_reject(curated, "b1-00005")["evidence"])["duplicate_of"] == "b1-00000"
    assert _reject(curated, "b1-00006") is None, "one turn differs: a conversation of its own"


def test_near_duplicates_need_their_assistant_turns_near_too():
    rng = random.Random(9)
    question = "Read this and answer: " + _text(rng, (1500, 1500))  # a long shared context
    rows = _clean(4)
    rows.append(_chat(rng, question))
    rows.append(_chat(rng, question))  # the same context, other answers: kept
    rows.append(_with_turn(rows[4], 2, _edited(rows[4][2]["content"], rng)))  # one word edited

    curated = _curate(_conversations(rows))

    alike = signatures(
        joined_text(CONVERSATION.with_views(_conversations(rows[4:6])), ("conversation",))
    )
    assert jaccard(alike[:1], alike[1:])[0] >= MinHashConfig().threshold, "alike as conversations"
    assert _reject(curated, "b1-00005") is None
    assert _reject(curated, "b1-00006")["stage"] == "near_dup"
    assert _reject(curated, "b1-00006")["duplicate_of"] == "b1-00004"
    assert json.loads(_reject(curated, "b1-00006")["evidence"])["response_jaccard"] >= 0.8


def test_a_user_turn_or_an_assistant_turn_from_an_eval_set_is_decontaminated():
    rows = _clean(5)
    rows[1] = _with_turn(rows[1], 3, f"Here is a puzzle: {EVAL_QUESTION}")  # the second user turn
    rows[2] = _with_turn(rows[2], 4, f"As the benchmark says: {EVAL_ANSWER}.")  # the last answer

    curated = _curate(_conversations(rows))

    user, assistant = (_reject(curated, f"b1-0000{i}") for i in (1, 2))
    assert user["stage"] == assistant["stage"] == "decontaminated"
    assert json.loads(user["evidence"])["field"] == "messages[3]"
    assert json.loads(assistant["evidence"])["field"] == "messages[4]"
    assert (user["eval_item_id"], assistant["matched_ngram"].split()[0]) == ("1", "benchmark0")
    assert assistant["messages"] == rows[2], "the reject keeps the conversation"


def test_the_quality_rules_judge_the_assistant_turns_only():
    rng = random.Random(4)
    rows = _clean(5)
    terse = [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": "ok"}]
    rows.append(terse)  # a rich question, an answer that teaches nothing
    brief_question = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "x"}]
    rows.append(_with_turn(brief_question, 1, _text(rng)))  # a terse question, a real answer

    curated = _curate(_conversations(rows))

    assert _reject(curated, "b1-00005")["stage"] == "quality:min_words"
    assert _reject(curated, "b1-00005")["rule_value"] == 1.0
    assert _reject(curated, "b1-00006") is None


def test_prompt_hash_is_the_normalized_first_user_turns_and_not_an_index_key():
    rng = random.Random(6)
    question = "How do I read an older version of a Delta table?"
    first = _chat(rng, question)
    variant = _chat(rng, question.replace(" ", "  "))  # another conversation, the same question
    rows = [first, variant, *_clean(3)]

    curated = _curate(_conversations(rows))

    hashes = dict(curated.kept.select("record_id", "prompt_hash").iter_rows())
    assert hashes["b1-00000"] == hashes["b1-00001"] and len(set(hashes.values())) == 4
    assert PROMPT_BAND not in set(band_entries(curated.index)["band"])
    assert curated.index["prompt_hash"].is_null().all()


def test_every_stage_accounts_for_its_conversations_in_blocks_of_any_size():
    rows = _clean(30)
    rows[7] = rows[3]
    rows[9] = _with_turn(_with_turn(rows[9], 2, "ok"), 4, "fine")
    rows[11] = _with_turn(rows[11], 2, f"As the benchmark says: {EVAL_ANSWER}.")
    bronze = _conversations(rows)

    whole = _curate(bronze)
    blocked = _curate(bronze, rows_per_block=4)

    assert_every_stage_accounts_for_its_rows(whole, bronze)
    assert list(whole.stages) == [
        "normalize",
        "views",
        "minhash",
        "exact_dedup",
        "near_dedup",
        "decontaminate",
        "quality",
        "language",
    ]
    assert blocked.kept.equals(whole.kept) and blocked.rejects.equals(whole.rejects)
    assert set(whole.rejects["stage"]) == {"exact_dup", "quality:min_words", "decontaminated"}


def test_a_later_batch_dedups_against_the_conversations_earlier_batches_kept():
    earlier = _curate(_conversations(_clean(6)))
    again = [_clean(6)[2], *_clean(3, seed=8)]

    later = _curate(_conversations(again, batch_id="b2"), earlier=earlier)

    assert _reject(later, "b2-00000")["stage"] == "exact_dup"
    assert _reject(later, "b2-00000")["duplicate_of"] == "b1-00002"
    assert later.kept.height == 3


def test_a_block_of_conversations_crosses_a_process_boundary_as_arrow():
    """As the Ray engine sends a block (Arrow, the oldest compat level) and takes back its result
    (``to_row``: Arrow IPC)."""
    block = _conversations(_clean(4))
    through_arrow = pl.from_arrow(block.to_arrow(compat_level=pl.CompatLevel.oldest()))

    result = run_stages([Stage("normalize", normalize_records)], through_arrow)
    back = from_row(to_row(result))

    assert through_arrow.equals(block) and back.kept.schema["messages"] == TURNS
    assert back.kept.equals(result.kept)
