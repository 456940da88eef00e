"""The Markov text's checks against the pipeline's own rules, on hand-made answers, and the
chain on a tiny training text. No docstrings are parsed here (that is test_sample_corpus's)."""

from __future__ import annotations

import numpy as np
import polars as pl

from pipeline_assets.lib.silver.decontam import EvalNgramIndex, find_contamination
from pipeline_assets.lib.silver.quality import quality_gate
from pipeline_assets.sample_data import markov_text as mt

LONG = (
    "The parser reads the configuration file once at start-up, checks every section against "
    "the schema, and reports the first error with its line number so it can be fixed quickly."
)
TEXTS = [
    LONG,
    "Return a list of candidates. Return a new database.",  # a repeated 2-gram in few words
    "Note that if the engine stops.\n\nNote that name.",
    "This routine comes from issue #10492 for pymysql, though arg signature mismatches in "
    "aiomysql tracked by issue #10492 for pymysql, though arg signature mismatches in aiomysql "
    "tracked by issue #24801. The rest is from a normal distribution.",  # a repeated 5-gram run
    "$$$ ### 42 7 9 ok then",
    "https://example.org/a/very/long/address/with/many/parts https://example.org/another/one",
    "Short but fine answer here.",
]


def answers_of(texts: list[str]) -> tuple[mt.TokenTable, mt.Answers]:
    vocabulary = mt.Vocabulary()
    ids = [vocabulary.ids(text) for text in texts]
    table = vocabulary.freeze()
    tokens = np.array([i for words in ids for i in words], dtype=np.int64)
    owner = np.repeat(np.arange(len(texts)), [len(words) for words in ids])
    return table, mt.Answers(texts, np.array([len(w) for w in ids]), tokens, owner)


def test_word_and_repetition_rules_agree_with_the_quality_gate():
    table, answers = answers_of(TEXTS)
    ours = mt.passes_word_rules(table, answers) & mt.passes_repetition_rules(table, answers)
    _, rejected, _ = quality_gate(pl.DataFrame({"response": TEXTS, "source": ["a"] * len(TEXTS)}))
    gate = [text not in set(rejected["response"]) for text in TEXTS]
    assert ours.tolist() == gate
    assert gate[0] and not all(gate)  # the hand-made set has both kinds


def test_gram_ban_finds_a_13_word_run_as_decontamination_does():
    candidates = [
        "As documented, " + " ".join(LONG.split()[3:17]).upper() + " and more.",  # 14 words shared
        "The parser reads the configuration file once, then stops.",
        LONG.lower(),
    ]
    table, both = answers_of([LONG, *candidates])  # one table for the eval text and the answers
    ban = mt.GramBan(table, mt.first_answers(both, 1))
    rest = mt.subset(both, np.arange(len(both.texts)) >= 1)
    hits = ban.hits(rest.tokens, rest.owner, len(rest.texts)).tolist()

    index = EvalNgramIndex.build(
        pl.DataFrame({"eval_set": ["e"], "item_id": ["e-1"], "prompt": ["x"], "response": [LONG]})
    )
    records = pl.DataFrame(
        {"record_id": ["1", "2", "3"], "prompt": ["q"] * 3, "response": candidates}
    )
    _, contaminated, _ = find_contamination(records, index)
    assert hits == [i in set(contaminated["record_id"]) for i in ("1", "2", "3")]
    assert hits == [True, False, True]


def test_unique_keys_refuse_a_key_seen_before_or_twice_in_one_batch():
    unique = mt.UniqueKeys()
    first = unique.new(np.array([5, 3, 5], dtype=np.uint64))
    second = unique.new(np.array([3, 9], dtype=np.uint64))
    assert first.tolist() == [True, True, False] and second.tolist() == [False, True]


def test_chain_walks_only_through_word_pairs_it_was_trained_on():
    vocabulary = mt.Vocabulary()
    training = [
        "The cache keeps the newest entries and drops the oldest ones first.",
        "The queue keeps the order of tasks and hands them to idle workers.",
        "A worker drops a task when the queue is closed by the pool.",
        "The pool keeps idle workers and drops the oldest ones on shutdown.",
    ]
    sentences = mt.training_sentences(training, vocabulary)
    table = vocabulary.freeze()
    chain = mt.train_chain(sentences, table.space)
    made = mt.generate_sentences(chain, 20_000, np.random.default_rng(1))
    pairs = {(a, b) for s in sentences for a, b in zip(s, s[1:], strict=False)}
    starts = {s[0] for s in sentences}
    tokens = made.tokens.tolist()
    for start, length in zip(made.starts.tolist(), made.lengths.tolist(), strict=True):
        words = tokens[start : start + length]
        assert words[0] in starts
        assert all(pair in pairs for pair in zip(words, words[1:], strict=False))
    assert len(made.lengths) > 20  # and many, all different
    rows = {
        tuple(tokens[s : s + n])
        for s, n in zip(made.starts.tolist(), made.lengths.tolist(), strict=True)
    }
    assert len(rows) == len(made.lengths)


def test_answers_made_in_a_worker_process_are_the_ones_made_here():
    vocabulary = mt.Vocabulary()
    sentences = mt.training_sentences([LONG, *TEXTS[1:3], TEXTS[6]], vocabulary)
    table = vocabulary.freeze()
    recipe = mt.AnswerRecipe(
        mt.train_chain(sentences, table.space),
        table,
        mt.UniformWords(6, 30),
        seed=3,
        stream=0,
        batch=64,
    )
    with (
        mt.AnswerSource(recipe, mt.UniqueKeys()) as here,
        mt.AnswerSource(recipe, mt.UniqueKeys(), workers=1) as there,
    ):
        assert [here.take() for _ in range(40)] == [there.take() for _ in range(40)]
