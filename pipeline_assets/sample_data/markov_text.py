"""Word-level Markov text trained once on docstring prose: unique answers by the million.

An order-2 chain over whitespace tokens, one sentence at a time. With odds ``BACKOFF_ODDS`` a
step forgets the word two back and goes on from any place the last word occurred (order 1): the
text stays locally fluent, and long runs copied from one docstring become rare, which keeps
millions of generated answers apart. A walk that repeats a word pair is dropped, so generated
sentences have no loops ("and X and X and X").

Everything per token is numpy over many walks or answers at once; Python sees whole batches.
Answers are checked against what would make a corpus's curation unpredictable: no two answers
are equal as lowercased words (``UniqueKeys``), none shares a 13-word run with a banned text
such as an eval item (``GramBan``), and none fails a rule of the quality gate
(``passes_word_rules``, ``passes_repetition_rules``: the gate's rules, computed on token ids).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import re
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import polars as pl

from pipeline_assets.lib.silver.decontam import DecontamConfig, text_words
from pipeline_assets.lib.silver.quality import QualityThresholds

BOS, END = 0, 1  # token ids: before a sentence's first word, after its last
TOKEN_BITS = 20
_TOKEN_MASK = (1 << TOKEN_BITS) - 1
SENTENCE_MIN_WORDS = 3
SENTENCE_MAX_WORDS = 60
BACKOFF_ODDS = 0.15
PARAGRAPH_BREAK_ODDS = 0.3  # after each sentence but an answer's last
TARGET_SLACK_WORDS = 5  # an answer ends within this many words past its target
LANES = 4096  # walks run side by side
SENTENCE_YIELD = 0.8  # the share of walked tokens that ends up in a usable sentence
SPARE_TEXT = 1.25  # text generated per word answers want: what does not fit is dropped
LOOP_WINDOW = 8  # a walk back at a word pair it left this few steps ago is looping
DECONTAM_NGRAM = DecontamConfig().ngram

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z`\"'(])")
_LETTER = re.compile(r"[^\W\d_]")
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")
_MIX = np.uint64(0x9E3779B97F4A7C15)
_NO_IDS = np.array([], dtype=np.int64)


# --- Tokens ---------------------------------------------------------------------------------------


class Vocabulary:
    """Token ids of whitespace-separated words, handed out as words are first seen."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"<s>": BOS, "</s>": END}

    def ids(self, sentence: str) -> list[int]:
        ids = self._ids
        return [ids.setdefault(word, len(ids)) for word in sentence.split()]

    def freeze(self) -> TokenTable:
        return TokenTable(list(self._ids))


class TokenTable:
    """Per token id: its UTF-8 bytes, a 64-bit key of its lowercase form (what near-duplicate
    detection compares), of its decontamination word (0 for none: punctuation only), and the
    quality gate's word measures. Three more ids past the words stand for what follows a word:
    a space, a paragraph break, the end of an answer ("\\x00")."""

    def __init__(self, words: list[str]):
        self.space, self.paragraph_break, self.answer_end = range(len(words), len(words) + 3)
        encoded = [w.encode() for w in [*words, " ", "\n\n", "\x00"]]
        self._utf8 = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._byte_lengths = np.array([len(b) for b in encoded], dtype=np.int64)
        self._byte_starts = np.cumsum(self._byte_lengths) - self._byte_lengths
        lowered = [w.lower() for w in words]
        decontam = [" ".join(text_words(w)) for w in words]  # one word or none: no spaces inside
        self.fold_keys = _string_keys(lowered)
        self.gram_keys = np.where([bool(w) for w in decontam], _string_keys(decontam), 0).astype(
            np.uint64
        )
        self.chars = np.array([len(w) for w in words], dtype=np.int64)
        self.has_letter = np.array([bool(_LETTER.search(w)) for w in words])
        self.has_letter_or_digit = np.array([bool(_LETTER_OR_DIGIT.search(w)) for w in words])

    def text(self, ids: np.ndarray) -> str:
        """The strings of ``ids``, one after the other."""
        lengths = self._byte_lengths[ids]
        return self._utf8[_ranges(self._byte_starts[ids], lengths)].tobytes().decode()


def _string_keys(strings: list[str]) -> np.ndarray:
    """Deterministic 64-bit keys (never 0) of strings, the same in every process."""
    keys = pl.Series(strings, dtype=pl.String).hash(seed=0x5A3C).to_numpy().astype(np.uint64)
    return keys | np.uint64(1)


# --- The chain ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarkovChain:
    """Transitions grouped by state (a pair of token ids), each packed as
    ``next_state << TOKEN_BITS | token`` (the state after END is the start, 0).
    ``by_last_token`` groups the same transitions by their state's last token, for the order-1
    steps."""

    offsets: np.ndarray  # per state: its first transition
    counts: np.ndarray  # per state: how many transitions
    transitions: np.ndarray
    last_tokens: np.ndarray  # per state: its second token
    by_last_token: np.ndarray  # transition ids ordered by their state's last token
    last_offsets: np.ndarray  # per token: its first entry in by_last_token
    last_counts: np.ndarray


def train_chain(sentences: Iterable[list[int]], vocabulary_size: int) -> MarkovChain:
    """The chain of ``sentences`` (token ids); the start state (BOS, BOS) is state 0."""
    if vocabulary_size > _TOKEN_MASK:
        raise ValueError(f"{vocabulary_size} tokens do not fit in {TOKEN_BITS} bits")
    states = {(BOS, BOS): 0}
    from_state, packed = [], []
    for sentence in sentences:
        last, state = BOS, 0
        for token in sentence:
            following = states.setdefault((last, token), len(states))
            from_state.append(state)
            packed.append(following << TOKEN_BITS | token)
            last, state = token, following
        from_state.append(state)
        packed.append(END)
    from_state = np.array(from_state, dtype=np.int64)
    order = np.argsort(from_state, kind="stable")
    counts = np.bincount(from_state, minlength=len(states))
    last_tokens = np.array([pair[1] for pair in states], dtype=np.int64)
    transitions_last = last_tokens[from_state[order]]
    last_counts = np.bincount(transitions_last, minlength=vocabulary_size)
    return MarkovChain(
        offsets=np.concatenate([[0], np.cumsum(counts)[:-1]]),
        counts=counts,
        transitions=np.array(packed, dtype=np.int64)[order],
        last_tokens=last_tokens,
        by_last_token=np.argsort(transitions_last, kind="stable"),
        last_offsets=np.concatenate([[0], np.cumsum(last_counts)[:-1]]),
        last_counts=last_counts,
    )


def training_sentences(paragraphs: Iterable[str], vocabulary: Vocabulary) -> list[list[int]]:
    """The sentences of ``paragraphs`` as token ids, those of a usable length only."""
    found = []
    for paragraph in paragraphs:
        for sentence in _SENTENCE_BREAK.split(paragraph):
            ids = vocabulary.ids(sentence)
            if SENTENCE_MIN_WORDS <= len(ids) <= SENTENCE_MAX_WORDS:
                found.append(ids)
    return found


# --- Sentences ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sentences:
    tokens: np.ndarray  # every sentence's token ids, one after the other
    lengths: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths


def generate_sentences(chain: MarkovChain, tokens: int, rng: np.random.Generator) -> Sentences:
    """Distinct sentences of about ``tokens`` tokens in all, from ``LANES`` walks that start a new
    sentence after each end. Sentences that loop or run past the maximum are dropped."""
    steps = max(-(-tokens // LANES), SENTENCE_MAX_WORDS + 1)  # room for a whole sentence
    walked = np.empty((LANES, steps), dtype=np.int64)  # written a column at a time: no transpose
    states = np.zeros(LANES, dtype=np.int64)
    for step in range(steps):
        walked[:, step] = packed = chain.transitions[_next_transitions(chain, states, rng)]
        states = packed >> TOKEN_BITS
    walked = walked.ravel()  # one walk after the other
    emitted, visited = walked & _TOKEN_MASK, walked >> TOKEN_BITS
    sentence = _sentence_numbers(emitted, steps)
    bad = _loops(visited, sentence)
    ends = np.flatnonzero(emitted == END)
    starts = np.maximum(np.concatenate([[0], ends[:-1] + 1]), ends - ends % steps)
    lengths = ends - starts
    usable = (
        (lengths >= SENTENCE_MIN_WORDS) & (lengths <= SENTENCE_MAX_WORDS) & ~bad[sentence[ends]]
    )
    starts, lengths = starts[usable], lengths[usable]
    owner = np.repeat(np.arange(len(starts)), lengths)
    ids = emitted[_ranges(starts, lengths)]
    distinct = _first_of_each(_polynomial_keys(ids.astype(np.uint64), owner, len(starts)))
    return Sentences(ids[distinct[owner]], lengths[distinct])


def _next_transitions(
    chain: MarkovChain, states: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    which, draw = rng.random((2, states.size))
    backoff = (which < BACKOFF_ODDS) & (states != 0)  # a first word always comes from a start
    pick = chain.offsets[states] + (draw * chain.counts[states]).astype(np.int64)
    last = chain.last_tokens[states[backoff]]
    slot = chain.last_offsets[last] + (draw[backoff] * chain.last_counts[last]).astype(np.int64)
    pick[backoff] = chain.by_last_token[slot]
    return pick


def _sentence_numbers(emitted: np.ndarray, steps: int) -> np.ndarray:
    """Per position, a number shared by the positions of one sentence (its END included)."""
    starts = np.zeros(len(emitted), dtype=np.int64)
    starts[1:] = emitted[:-1] == END
    starts[::steps] = 1  # a walk's first sentence
    return np.cumsum(starts)


def _loops(visited: np.ndarray, sentence: np.ndarray) -> np.ndarray:
    """Per sentence number: whether the walk came back to a state (a word pair) within
    ``LOOP_WINDOW`` steps, as in "and X and X and X"."""
    bad = np.zeros(sentence[-1] + 1, dtype=bool)
    for back in range(1, LOOP_WINDOW + 1):
        again = (visited[back:] == visited[:-back]) & (sentence[back:] == sentence[:-back])
        bad[sentence[back:][again]] = True
    return bad


def _first_of_each(keys: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each key."""
    first = np.zeros(len(keys), dtype=bool)
    first[np.unique(keys, return_index=True)[1]] = True
    return first


# --- Answers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answers:
    """A batch of answers: their texts and, flat, their token ids."""

    texts: list[str]
    words: np.ndarray  # per answer
    tokens: np.ndarray  # every answer's tokens, one answer after the other
    owner: np.ndarray  # per token: its answer's index


def assemble_answers(
    sentences: Sentences, targets: np.ndarray, table: TokenTable, rng: np.random.Generator
) -> Answers:
    """Answers of about ``targets`` words each, from unused sentences that fit; an answer for
    which the batch has no fitting sentence left is left out."""
    answer, sentence, step = _fill(sentences, targets, rng)
    order = np.lexsort((step, answer))
    answer, sentence = answer[order], sentence[order]
    kept_answers, answer = np.unique(answer, return_inverse=True)
    lengths = sentences.lengths[sentence]
    tokens = sentences.tokens[_ranges(sentences.starts[sentence], lengths)]
    owner = np.repeat(answer, lengths)
    separators = np.full(len(tokens), table.space)
    answer_last = np.append(answer[1:] != answer[:-1], True)
    breaks = rng.random(len(sentence)) < PARAGRAPH_BREAK_ODDS
    separators[np.cumsum(lengths) - 1] = np.where(
        answer_last, table.answer_end, np.where(breaks, table.paragraph_break, table.space)
    )
    pieces = np.empty(2 * len(tokens), dtype=np.int64)
    pieces[0::2], pieces[1::2] = tokens, separators
    texts = table.text(pieces).split("\x00")[:-1]
    words = np.bincount(owner, minlength=len(kept_answers))
    return Answers(texts, words, tokens, owner)


def _fill(
    sentences: Sentences, targets: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(answer, sentence, step) of every sentence placed: at each step every unfinished answer
    takes a random unused sentence of at most its remaining words plus the slack."""
    by_length = np.argsort(sentences.lengths, kind="stable")
    pool_start = np.searchsorted(sentences.lengths[by_length], np.arange(SENTENCE_MAX_WORDS + 1))
    left = np.bincount(sentences.lengths, minlength=SENTENCE_MAX_WORDS + 1)
    used = np.zeros_like(left)
    remaining = targets.astype(np.int64)
    placed: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    active = np.arange(len(targets))
    for step in range(targets.max(initial=0) + 1):
        limit = np.minimum(remaining[active] + TARGET_SLACK_WORDS, SENTENCE_MAX_WORDS)
        fitting = np.cumsum(left)
        possible = fitting[limit] > 0
        active, limit = active[possible], limit[possible]
        if not active.size:
            break
        lengths = np.searchsorted(fitting, rng.random(active.size) * fitting[limit], side="right")
        order = np.argsort(lengths, kind="stable")
        active, lengths = active[order], lengths[order]
        rank = np.arange(active.size) - np.searchsorted(lengths, lengths)
        got = rank < left[lengths]
        chosen = by_length[pool_start[lengths[got]] + used[lengths[got]] + rank[got]]
        taken = np.bincount(lengths[got], minlength=left.size)
        used += taken
        left -= taken
        remaining[active[got]] -= lengths[got]
        placed.append((active[got], chosen, np.full(got.sum(), step)))
        active = np.sort(active[remaining[active] > 0])
    if not placed:
        return _NO_IDS, _NO_IDS, _NO_IDS
    answer, sentence, step_of = (np.concatenate(part) for part in zip(*placed, strict=True))
    done = (remaining <= 0)[answer]  # an answer the sentences ran out for is left out
    return answer[done], sentence[done], step_of[done]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start..start+length-1 of every (start, length), one range after the other."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)


# --- Checks ---------------------------------------------------------------------------------------


def _polynomial_keys(values: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
    """A 64-bit key per owner of its run of ``values`` (owners contiguous, 0..count-1)."""
    sizes = np.bincount(owner, minlength=count)
    ends = np.cumsum(sizes)
    from_end = np.repeat(ends, sizes) - 1 - np.arange(len(values))
    weighted = values * _powers(max(1, sizes.max(initial=0)))[from_end]
    keys = np.zeros(count, dtype=np.uint64)
    present = sizes > 0
    keys[present] = np.add.reduceat(weighted, (ends - sizes)[present])
    return keys


def _powers(count: int) -> np.ndarray:
    """_MIX ** i mod 2**64 for i < count."""
    powers, value = [], 1
    for _ in range(count):
        powers.append(value)
        value = value * int(_MIX) % (1 << 64)
    return np.array(powers, dtype=np.uint64)


def window_keys(values: np.ndarray, owner: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The key of every run of ``n`` values that lies within one owner, and that owner."""
    count = len(values) - n + 1
    if count <= 0:
        return np.array([], dtype=np.uint64), np.array([], dtype=np.int64)
    keys = np.zeros(count, dtype=np.uint64)
    for k in range(n):
        keys = keys * _MIX + values[k : k + count]
    inside = owner[n - 1 :] == owner[:count]
    return keys[inside], owner[:count][inside]


class UniqueKeys:
    """Keys of every answer handed out so far (lowercased words), sorted, to refuse a repeat."""

    def __init__(self) -> None:
        self._keys = np.array([], dtype=np.uint64)

    def new(self, keys: np.ndarray) -> np.ndarray:
        """True for each key seen neither before nor earlier in ``keys``; remembers those."""
        seen = np.zeros(len(keys), dtype=bool)
        if len(self._keys):
            where = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
            seen = self._keys[where] == keys
        fresh = ~seen & _first_of_each(keys)
        added = np.sort(keys[fresh])
        self._keys = np.insert(self._keys, np.searchsorted(self._keys, added), added)
        return fresh


class GramBan:
    """Every decontamination 13-gram of some texts (the eval items), to refuse an answer that
    shares one: a bitmap in front of a sorted array, since almost every lookup misses."""

    _BITS = 26

    def __init__(self, table: TokenTable, answers: Answers) -> None:
        self._table = table
        self._keys = np.unique(self._grams(answers.tokens, answers.owner)[0])
        self._bitmap = np.zeros(1 << (self._BITS - 3), dtype=np.uint8)
        slots = self._keys >> np.uint64(64 - self._BITS)
        bits = np.left_shift(1, slots & np.uint64(7)).astype(np.uint8)
        np.bitwise_or.at(self._bitmap, slots >> np.uint64(3), bits)

    def _grams(self, tokens: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = self._table.gram_keys[tokens]
        words = keys != 0  # punctuation-only tokens are no word to decontamination
        return window_keys(keys[words], owner[words], DECONTAM_NGRAM)

    def hits(self, tokens: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
        """True for each of ``count`` answers that shares a 13-gram with the banned texts."""
        grams, owners = self._grams(tokens, owner)
        slots = grams >> np.uint64(64 - self._BITS)
        bits = self._bitmap[slots >> np.uint64(3)] >> (slots & np.uint64(7)).astype(np.uint8)
        maybe = (bits & 1) == 1
        grams, owners = grams[maybe], owners[maybe]
        where = np.minimum(np.searchsorted(self._keys, grams), len(self._keys) - 1)
        found = np.zeros(count, dtype=bool)
        if len(self._keys):
            found[owners[self._keys[where] == grams]] = True
        return found


def passes_word_rules(
    table: TokenTable, answers: Answers, rules: QualityThresholds = QualityThresholds()
) -> np.ndarray:
    """The quality gate's word-count, word-length, symbol and letter rules, per answer."""
    count = len(answers.texts)
    words = answers.words.astype(np.float64)

    def per_answer(values: np.ndarray) -> np.ndarray:
        return np.bincount(
            answers.owner, values[answers.tokens].astype(np.float64), minlength=count
        )

    chars, letters = per_answer(table.chars), per_answer(table.has_letter)
    symbols = per_answer(~table.has_letter_or_digit)
    mean_length = chars / np.maximum(words, 1)
    return (
        (words >= rules.min_words)
        & (words <= rules.max_words)
        & (mean_length >= rules.min_mean_word_length)
        & (mean_length <= rules.max_mean_word_length)
        & (symbols / np.maximum(words, 1) <= rules.max_symbol_word_ratio)
        & (letters / np.maximum(words, 1) >= rules.min_alpha_word_fraction)
    )


def passes_repetition_rules(
    table: TokenTable, answers: Answers, rules: QualityThresholds = QualityThresholds()
) -> np.ndarray:
    """The quality gate's top 2-gram and duplicate 5-gram rules, per answer
    (``lib/silver/quality.py`` says what they measure; here words are token ids, compared within
    their answer). Only an answer that repeats a 2-gram can fail either, so 5-grams are looked at in
    those alone."""
    count = len(answers.texts)
    chars = table.chars[answers.tokens]
    starts, owners = _ngram_starts(answers, 2)
    size = table.space  # ids below it are words
    keys = (owners * size + answers.tokens[starts]) * size + answers.tokens[starts + 1]
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    first, counts = first[counts > 1], counts[counts > 1]
    top_bigram = np.zeros(count)
    at = starts[first]
    np.maximum.at(top_bigram, owners[first], counts * (chars[at] + chars[at + 1]))
    repeating = np.zeros(count, dtype=bool)
    repeating[owners[first]] = True
    starts, owners = _ngram_starts(answers, 5)
    starts, owners = starts[repeating[owners]], owners[repeating[owners]]
    keys = owners.astype(np.uint64)
    for offset in range(5):
        keys = keys * _MIX + answers.tokens[starts + offset].astype(np.uint64)
    later = np.ones(len(starts), dtype=bool)
    later[np.unique(keys, return_index=True)[1]] = False  # the first of each 5-gram
    in_repeat = np.zeros(len(answers.tokens), dtype=bool)
    for offset in range(5):
        in_repeat[starts[later] + offset] = True
    total_chars = np.maximum(np.bincount(answers.owner, chars, minlength=count), 1)
    repeated_chars = np.bincount(answers.owner, chars * in_repeat, minlength=count)
    return (np.minimum(top_bigram / total_chars, 1.0) <= rules.max_top_2gram_char_fraction) & (
        repeated_chars / total_chars <= rules.max_duplicate_5gram_char_fraction
    )


def _ngram_starts(answers: Answers, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions where an n-token run within one answer starts, and that answer."""
    count = len(answers.tokens) - n + 1
    if count <= 0:
        return np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    starts = np.flatnonzero(answers.owner[:count] == answers.owner[n - 1 :])
    return starts, answers.owner[starts]


# --- A stream of checked answers ------------------------------------------------------------------


@dataclass(frozen=True)
class LogNormalWords:
    """Answer lengths in words: log-normal, clipped to low..high."""

    median: float
    sigma: float
    low: int
    high: int

    def __call__(self, rng: np.random.Generator, count: int) -> np.ndarray:
        words = rng.lognormal(math.log(self.median), self.sigma, count)
        return np.clip(np.rint(words), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class UniformWords:
    low: int
    high: int

    def __call__(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, count)


@dataclass(frozen=True)
class AnswerRecipe:
    """Everything that makes batch ``i`` of an answer stream; batch i depends on nothing but
    this and i, so any process can make it."""

    chain: MarkovChain
    table: TokenTable
    target_words: LogNormalWords | UniformWords
    seed: int
    stream: int  # tells apart the streams of one seed
    ban: GramBan | None = None
    batch: int = 8192
    keep_tokens: bool = False  # what a GramBan is built from; answers need only texts


def answer_batch(recipe: AnswerRecipe, index: int) -> tuple[Answers, np.ndarray]:
    """Batch ``index``: the answers that pass the checks that need no other batch, and their
    uniqueness keys."""
    rng = np.random.default_rng([recipe.seed, recipe.stream, index])
    targets = recipe.target_words(rng, recipe.batch)
    sentences = _sentences_for(recipe.chain, int(targets.sum() * SPARE_TEXT), rng)
    answers = assemble_answers(sentences, targets, recipe.table, rng)
    ok = passes_word_rules(recipe.table, answers) & passes_repetition_rules(recipe.table, answers)
    if recipe.ban is not None:
        ok &= ~recipe.ban.hits(answers.tokens, answers.owner, len(answers.texts))
    answers = subset(answers, ok)
    keys = _polynomial_keys(
        recipe.table.fold_keys[answers.tokens], answers.owner, len(answers.texts)
    )
    if not recipe.keep_tokens:
        answers = Answers(answers.texts, answers.words, _NO_IDS, _NO_IDS)
    return answers, keys


def _sentences_for(chain: MarkovChain, words: int, rng: np.random.Generator) -> Sentences:
    """Sentences of at least ``words`` words in all (walks lose some to loops and repeats)."""
    parts = [generate_sentences(chain, int(words / SENTENCE_YIELD), rng)]
    while (have := sum(int(p.lengths.sum()) for p in parts)) < words:
        parts.append(generate_sentences(chain, int((words - have) / SENTENCE_YIELD) + LANES, rng))
    return Sentences(
        np.concatenate([p.tokens for p in parts]), np.concatenate([p.lengths for p in parts])
    )


class AnswerSource:
    """The answers of a recipe's batches, in batch order, each one not seen before (``unique``
    is shared with other sources whose answers must differ from these). With ``workers``,
    batches are made by that many processes, a few batches ahead: the answers are the same."""

    def __init__(self, recipe: AnswerRecipe, unique: UniqueKeys, workers: int = 0) -> None:
        self._recipe, self._unique = recipe, unique
        self._next_index = 0
        self._ready: list[tuple[str, int]] = []
        self._pool = None
        self._in_flight: deque[Future] = deque()
        if workers:
            self._pool = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_set_worker_recipe, initargs=(recipe,),
            )  # fmt: skip
            for _ in range(2 * workers):
                self._in_flight.append(self._pool.submit(_worker_batch, self._claim_index()))

    def __enter__(self) -> AnswerSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def take(self) -> tuple[str, int]:
        """(text, words) of the next answer."""
        while not self._ready:
            answers = self.next_batch()
            self._ready = list(zip(answers.texts, answers.words.tolist(), strict=True))[::-1]
        return self._ready.pop()

    def next_batch(self) -> Answers:
        if self._pool is None:
            answers, keys = answer_batch(self._recipe, self._claim_index())
        else:
            answers, keys = self._in_flight.popleft().result()
            self._in_flight.append(self._pool.submit(_worker_batch, self._claim_index()))
        return subset(answers, self._unique.new(keys))

    def _claim_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1


_worker_recipe: AnswerRecipe | None = None


def _set_worker_recipe(recipe: AnswerRecipe) -> None:
    global _worker_recipe
    _worker_recipe = recipe


def _worker_batch(index: int) -> tuple[Answers, np.ndarray]:
    return answer_batch(_worker_recipe, index)


def concat_answers(batches: Sequence[Answers]) -> Answers:
    shifts = np.cumsum([0] + [len(b.texts) for b in batches[:-1]])
    return Answers(
        [text for b in batches for text in b.texts],
        np.concatenate([b.words for b in batches]),
        np.concatenate([b.tokens for b in batches]),
        np.concatenate([b.owner + shift for b, shift in zip(batches, shifts, strict=True)]),
    )


def first_answers(answers: Answers, count: int) -> Answers:
    return subset(answers, np.arange(len(answers.texts)) < count)


def subset(answers: Answers, keep: np.ndarray) -> Answers:
    """The answers where ``keep`` is True, in order (their tokens too, if they have them)."""
    texts = list(itertools.compress(answers.texts, keep.tolist()))
    if not len(answers.tokens):
        return Answers(texts, answers.words[keep], _NO_IDS, _NO_IDS)
    tokens_kept = keep[answers.owner]
    renumbered = np.cumsum(keep) - 1
    owner = renumbered[answers.owner[tokens_kept]]
    return Answers(texts, answers.words[keep], answers.tokens[tokens_kept], owner)


# --- Training -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarkovText:
    table: TokenTable
    chain: MarkovChain  # trained on most docs: the corpus's answers
    held_out_chain: MarkovChain  # trained on the rest: eval items, kept apart from the answers


def held_out(module: str, qualname: str) -> bool:
    """One doc in five, chosen by name so the split never depends on a seed."""
    return zlib.crc32(f"{module}:{qualname}".encode()) % 5 == 0


def train_markov_text(docs: Sequence) -> MarkovText:
    """Both chains from ``docs`` (sample_corpus.Doc: module, qualname, paragraphs)."""
    vocabulary = Vocabulary()
    kept, apart = [], []
    for doc in docs:
        sentences = training_sentences(doc.paragraphs, vocabulary)
        (apart if held_out(doc.module, doc.qualname) else kept).extend(sentences)
    table = vocabulary.freeze()
    size = table.space  # the first id past the words
    return MarkovText(table, train_chain(kept, size), train_chain(apart, size))
