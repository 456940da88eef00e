"""Gold for preference pairs: a pair tokenized as two chat documents sharing a prefix, packed
per split."""

from __future__ import annotations

import random

import polars as pl

from pipeline_assets.lib.formats import TURNS
from pipeline_assets.lib.gold.chat_format import prefix_text, response_text
from pipeline_assets.lib.gold.encoder import EncoderSpec
from pipeline_assets.lib.gold.preference import (
    build_pair_sequences,
    pair_side_conversations,
    tokenize_pairs_stage,
)
from pipeline_assets.lib.gold.tokenizer import tokenizer_from_json, tokenizer_to_json, train_bpe
from pipeline_assets.lib.stages import run_stages
from pipeline_assets_tests.lib.gold.test_conversations import (  # noqa: F401 (the fixture)
    SHORT,
    SUPPORT,
    family,
    trained_spans,
)
from pipeline_assets_tests.lib.silver.test_dedup import WORDS


def _pairs(n: int, seed: int = 1) -> pl.DataFrame:
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    return pl.DataFrame(
        [
            {
                "record_id": f"r{i:03d}",
                "system": "Be brief." if i % 3 == 0 else None,
                "prompt_messages": None,
                "prompt": text(rng.randint(5, 15)),
                "chosen": text(rng.randint(10, 40)),
                "rejected": text(rng.randint(10, 40)),
                "source": "prefs",
                "split": "validation" if i % 5 == 0 else "train",
            }
            for i in range(n)
        ],
        schema_overrides={"system": pl.String, "prompt_messages": TURNS},
    )


def _tokenizer_json(pairs: pl.DataFrame) -> str:
    texts = [
        prefix_text(s, p) + response_text(c)
        for s, p, c in pairs.select("system", "prompt", "chosen").iter_rows()
    ]
    return tokenizer_to_json(train_bpe(texts, vocab_size=400))


def test_a_pair_is_its_prompt_once_and_each_answer_as_the_chat_format_renders_it():
    pairs = _pairs(12)
    tokenizer_json = _tokenizer_json(pairs)
    tokenizer = tokenizer_from_json(tokenizer_json)
    result = run_stages([tokenize_pairs_stage(EncoderSpec(tokenizer_json))], pairs)
    tokenized, counters = result.kept, result.counters["tokenize"]
    assert tokenized["pair_id"].to_list() == pairs["record_id"].to_list()
    assert counters.pop("seconds") >= 0 and counters == {
        "rows_in": 12,
        "kept": 12,
        "rejected": 0,
        "tokens": int(tokenized["n_tokens"].sum()),
    }
    for pair, row in zip(pairs.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        prefix = prefix_text(pair["system"], pair["prompt"])
        for side in ("chosen", "rejected"):
            whole = tokenizer.encode(prefix + response_text(pair[side])).ids
            assert row["prefix_ids"] + row[f"{side}_ids"] == whole
        assert row["n_tokens"] == 2 * len(row["prefix_ids"]) + len(row["chosen_ids"]) + len(
            row["rejected_ids"]
        )


def test_pairs_are_packed_per_split_and_a_pair_too_long_is_left_out_whole():
    pairs = _pairs(30)
    tokenizer_json = _tokenizer_json(pairs)
    tokenized = run_stages([tokenize_pairs_stage(EncoderSpec(tokenizer_json))], pairs).kept
    seq_len = (
        int(tokenized["n_tokens"].sort()[-2]) + 1
    )  # the longest pair does not fit, every other one does
    rows, left_out, counters = build_pair_sequences(tokenized, seq_len, seed=7, pad_id=0)
    longest = tokenized.sort("n_tokens")["pair_id"][-1]
    assert left_out["pair_id"].to_list() == [longest] and left_out["reason"].to_list() == [
        "too_long"
    ]
    assert counters["pairs_too_long"] == 1 and counters["pairs_packed"] == 29
    by_split = dict(tokenized.select("pair_id", "split").iter_rows())
    for row in rows.iter_rows(named=True):
        assert {by_split[p] for p in row["pair_ids"]} == {row["split"]}
        assert (
            len(row["input_ids"]) == seq_len and sum(row["document_lengths"]) == row["real_tokens"]
        )
    assert (
        rows.group_by("split")
        .agg(pl.col("sequence_index").sort())["sequence_index"]
        .map_elements(lambda s: s.to_list() == list(range(len(s))), return_dtype=pl.Boolean)
        .all()
    )
    again, _, _ = build_pair_sequences(
        tokenized.sample(fraction=1.0, shuffle=True, seed=3), seq_len, seed=7, pad_id=0
    )
    assert again.equals(rows), "the rows do not depend on the order the pairs arrive in"


def test_a_conversational_pair_trains_only_its_answers_after_the_whole_context(family):  # noqa: F811
    pairs = pl.DataFrame(
        {
            "record_id": ["support", "flat"],
            "system": [SUPPORT[0]["content"], None],
            "prompt_messages": [SUPPORT[1:5], None],
            "prompt": [SUPPORT[5]["content"], SHORT[0]["content"]],
            "chosen": [SUPPORT[6]["content"], SHORT[1]["content"]],
            "rejected": ["No refund, sorry.", "No idea."],
            "source": ["prefs", "prefs"],
            "split": ["train", "train"],
        },
        schema_overrides={"prompt_messages": TURNS},
    )
    tokenized = run_stages([tokenize_pairs_stage(family.spec)], pairs).kept

    closing = family.end_of_turn + family.closes
    for pair, row in zip(pairs.iter_rows(named=True), tokenized.iter_rows(named=True), strict=True):
        one = pairs.filter(pl.col("record_id") == pair["record_id"])
        for side in ("chosen", "rejected"):
            assert family.decode(row[f"{side}_ids"]) == pair[side] + closing, "the answer alone"
            whole = family.encoder.encode_conversations(pair_side_conversations(one, side))
            ids, mask = whole["input_ids"][0], whole["loss_mask"][0]
            assert row["prefix_ids"] + row[f"{side}_ids"] == list(
                ids[: len(row["prefix_ids"]) + len(row[f"{side}_ids"])]
            )
            trained = [family.decode(span) for span in trained_spans(list(ids), list(mask))]
            assert trained[-1] == pair[side] + closing
        prefix = family.decode(row["prefix_ids"])
        context = [m["content"] for m in (pair["prompt_messages"] or [])] + [pair["prompt"]]
        places = [prefix.find(text) for text in context]
        assert -1 not in places and places == sorted(places), "every earlier turn, in order"
        assert pair["chosen"] not in prefix and pair["rejected"] not in prefix
