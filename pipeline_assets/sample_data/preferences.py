"""A deterministic preference-pair source for the sample corpus: ``prefs``, format ``preference``.

Every line is a pair: a ``prompt``, a ``chosen`` and a ``rejected`` answer, most with scores
(``score_chosen`` strictly above ``score_rejected``), an ``id``, a ``created_at`` and the rater in
``meta``. Prompts and chosen answers come from the docstring prose of the SFT sample corpus
(``sample_corpus``'s doc pool, text stream and per-source prompt voices), without the docs the eval
sets were made of, so no clean pair shares an n-gram with an eval item. The pairs land in two files,
``<source>/<source>-000.jsonl`` and ``<source>/<source>-001.jsonl.zst``.

The rejected answer is the chosen one garbled in two consistent, surface-level ways
(``rejected_answer``): its sentences in reverse order, paragraph breaks gone, and about one word in
ten left out, articles first ("the", "a", "an"), then short function words. Both sides share their
words, topic and length (within 10 %), so nothing but the garbling tells them apart, and the
garbling is local and repeated several times in every pair (a noun where an article belongs, an
answer that opens with its closing remark): a tiny transformer learns to rank such text below the
chosen answer within a few hundred DPO steps. An answer to a different prompt was the alternative;
it asks the model to judge relevance, which a model that size cannot learn in that time.

About one prompt in five has 2-4 pairs (different chosen answers, each with its rejected), and the
first prompt has 11, so a cap of 8 pairs per prompt has 3 to set aside. On top of the clean pairs
the generator injects, at the fixed rates of ``INJECTION_RATES`` (shares of all lines):

- ``exact_duplicate``: an earlier clean pair again (prompt, chosen, rejected), with a new id;
- ``near_duplicate``: an earlier clean pair with a word edited in the prompt and 1-2 in the chosen
  answer, word 5-shingle Jaccard >= 0.85 on prompt + chosen + rejected and on chosen alone;
- ``contradiction``: an earlier clean pair with chosen and rejected swapped (same file or later);
- ``tie``: a new pair whose two scores are equal;
- ``chosen_equals_rejected``: chosen and rejected differ only in whitespace runs, CRLF line ends or
  Unicode form (NFC against NFD), so they are equal after ``normalize.normalize_text``. Docstrings
  are ASCII, so the NFD pairs' answer ends with a sentence that quotes accented words;
- ``eval_copy``: an eval item's prompt and answer (in one of ``eval_copy_text``'s disguises) as the
  prompt and chosen answer, caught by the decontamination n-gram check in either field; each item
  is copied once at most, so small eval sets give fewer copies than the rate asks for;
- ``low_quality``: a useless chosen answer (``low_quality_response``) over a real rejected one;
- ``malformed``: a line bronze quarantines (``missing_field:rejected``, ``empty_field:chosen``,
  ``invalid_json``).

Each clean pair is copied at most once, and never one of the 11-pair prompt's. The sample manifest
gets a ``preference`` section (``add_preference_source``) that says where each injection is, with
the ids involved. Same ``pairs``, ``seed`` and eval items give byte-identical files.
"""

from __future__ import annotations

import random
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_assets.lib.silver.preference_rules import MAX_PAIRS_PER_PROMPT as PROMPT_PAIR_CAP
from pipeline_assets.sample_data.corpus import (
    _SENTENCE_BREAK,
    LOW_QUALITY_KINDS,
    NEAR_DUPLICATE_MIN_JACCARD,
    NEAR_DUPLICATE_MIN_WORDS,
    SOURCES,
    SYNTH_SYSTEM_PROMPTS,
    TIME_SPREAD_S,
    Doc,
    EarlierOriginals,
    _dumps,
    _edit_word,
    _prompt,
    _shuffled_by_module,
    _Slot,
    _split_at_sentence,
    _TextStream,
    _timestamp,
    _word_count,
    add_manifest_section,
    built_with_enough_words,
    docs_without_eval_text,
    eval_copy_text,
    low_quality_response,
    near_duplicate_response,
    shingle_jaccard,
    spread_slots,
    two_landing_files,
    written_file_entry,
)

SOURCE = "prefs"
RECORD_FORMAT = "preference"
MIN_PAIRS = 40

INJECTION_RATES = {
    "exact_duplicate": 0.03,
    "near_duplicate": 0.03,
    "contradiction": 0.03,
    "tie": 0.02,
    "chosen_equals_rejected": 0.02,
    "eval_copy": 0.02,
    "low_quality": 0.02,
    "malformed": 0.01,
}
COPY_KINDS = ("exact_duplicate", "near_duplicate", "contradiction")  # need an earlier clean pair
MALFORMED_REASONS = ("missing_field:rejected", "empty_field:chosen", "invalid_json")
EQUAL_VARIANTS = ("whitespace", "crlf", "nfd")
_SLOT_DETAILS = {
    "malformed": MALFORMED_REASONS,
    "low_quality": LOW_QUALITY_KINDS,
    "chosen_equals_rejected": EQUAL_VARIANTS,
}

ANSWER_MIN_WORDS = 24  # so the rejected answer, a tenth shorter, keeps at least 20
ANSWER_MAX_WORDS = 150  # prompt, chosen and rejected fit 512 tokens together
ANSWER_TARGET_WORDS = (30, 110)
DROP_SHARE = 0.1  # of the chosen answer's words, left out of the rejected one
_DROPPED_FIRST = (
    frozenset({"the", "a", "an"}),
    frozenset({"of", "to", "is", "in", "and", "for", "that", "or"}),
)

MULTI_PAIR_SHARE = 0.2  # of prompts, with 2-4 pairs
LARGEST_PROMPT_PAIRS = 11
SCORED_SHARE = 0.85
SYSTEM_SHARE = 0.25
RATERS = 12
# Unique text a pair uses; measured: 64 words (answers of clean and new injected pairs, and texts
# that did not fit).
WORDS_PER_PAIR = 80

_ACCENTED_SENTENCES = (
    'Names such as "José", "Zoë" and "Ångström" are text like any other.',
    'The same holds for words such as "café", "naïve" and "façade".',
    'Accented words, such as "résumé" or "crème brûlée", are no exception.',
)


# --- Rejected answers and the text of injected pairs ----------------------------------------------


def rejected_answer(chosen: str) -> str:
    """``chosen`` with its sentences in reverse order and about a tenth of its words left out."""
    sentences = [s for p in chosen.split("\n\n") for s in _SENTENCE_BREAK.split(p.strip()) if s]
    words = " ".join(reversed(sentences)).split()
    dropped = _words_to_drop(words, max(2, int(len(words) * DROP_SHARE)))
    return " ".join(word for index, word in enumerate(words) if index not in dropped)


def _words_to_drop(words: list[str], budget: int) -> set[int]:
    """Positions of ``budget`` words: articles, then function words, then any word, each tier's
    picks spread evenly over the answer. Only words of letters alone go, so punctuation stays
    put."""
    plain = [i for i, word in enumerate(words) if word.isalpha()]
    tiers = [[i for i in plain if words[i].lower() in tier] for tier in _DROPPED_FIRST]
    in_tiers = set().union(*tiers)
    tiers.append([i for i in plain if i not in in_tiers])
    dropped: set[int] = set()
    for tier in tiers:
        need = min(budget - len(dropped), len(tier))
        dropped.update(tier[index * len(tier) // need] for index in range(need))
    return dropped


def dedup_text(prompt: str, chosen: str, rejected: str) -> str:
    """The text near dedup compares for a pair: its fields joined by newlines."""
    return "\n".join((prompt, chosen, rejected))


def equal_after_normalization(text: str, variant: str) -> tuple[str, str]:
    """(chosen, rejected): the same answer, apart only in what ``normalize_text`` undoes."""
    if variant == "whitespace":
        return text, "  " + text.replace(" ", " \t ") + " "
    if variant == "crlf":
        chosen = _in_two_paragraphs(text)
        return chosen, chosen.replace("\n", "\r\n") + "\r\n"
    if variant == "nfd":
        chosen = f"{text} {_ACCENTED_SENTENCES[_word_count(text) % len(_ACCENTED_SENTENCES)]}"
        return chosen, unicodedata.normalize("NFD", chosen)
    raise ValueError(f"unknown variant {variant!r}")


def _in_two_paragraphs(text: str) -> str:
    """``text`` with a line break to turn into CRLF: a one-paragraph answer is split in two."""
    if "\n" in text:
        return text
    sentences = _SENTENCE_BREAK.split(text)
    half = (len(sentences) + 1) // 2
    return " ".join(sentences[:half]) + (
        "\n\n" + " ".join(sentences[half:]) if half < len(sentences) else ""
    )


def _edited_prompt(prompt: str, rng: random.Random) -> str:
    """The prompt with one plain word substituted, inserted before or deleted (never the name)."""
    words = prompt.split(" ")
    plain = [i for i, word in enumerate(words) if word.strip("?.,:!").isalpha()]
    _edit_word(words, rng.choice(plain), rng)
    return " ".join(words)


def _answer_within_limits(text: str) -> str:
    """An eval item's answer cut at a sentence to ANSWER_MAX_WORDS, if it is longer."""
    if _word_count(text) <= ANSWER_MAX_WORDS:
        return text
    head, _ = _split_at_sentence(text, ANSWER_MIN_WORDS, ANSWER_MAX_WORDS, ANSWER_MAX_WORDS)
    return head or " ".join(text.split()[:ANSWER_MAX_WORDS])


# --- Pairs ----------------------------------------------------------------------------------------


@dataclass
class _Pair:
    id: str
    prompt: str
    chosen: str
    rejected: str
    created_s: int  # seconds after sample_corpus.BASE_TIME
    system: str | None = None
    scores: tuple[float, float] | None = None
    meta: dict = field(default_factory=dict)

    def as_object(self) -> dict:
        obj: dict = {"id": self.id}
        if self.system is not None:
            obj["system"] = self.system
        obj.update(prompt=self.prompt, chosen=self.chosen, rejected=self.rejected)
        if self.scores is not None:
            obj.update(score_chosen=self.scores[0], score_rejected=self.scores[1])
        obj["created_at"] = _timestamp(self.created_s)
        obj["meta"] = self.meta
        return obj


@dataclass(frozen=True)
class _PairText:
    """A clean pair before it has a line: its prompt group, prompt, system and chosen answer."""

    group: int
    prompt: str
    system: str | None
    chosen: str


class _PreferenceBuilder:
    """Fills every line of both files, in order, and notes what went where."""

    def __init__(self, pairs: int, seed: int, eval_items: list[dict], source: str, words: int):
        rng = self._rng = random.Random(f"{seed}/{source}/{RECORD_FORMAT}")
        self.source = source
        self.files = two_landing_files(source, pairs)
        self._slots = spread_slots(self.files, INJECTION_RATES, _SLOT_DETAILS, rng)
        self._stream = _TextStream(
            _shuffled_by_module(docs_without_eval_text(words, eval_items), rng)
        )
        self._eval_queue = list(eval_items)
        rng.shuffle(self._eval_queue)
        self._originals: EarlierOriginals[_Pair] = EarlierOriginals(
            lambda pair: _word_count(pair.chosen)
        )
        self._deferred: deque[str] = deque()  # copies that had no earlier clean pair to copy yet
        self._pending: deque[_PairText] = deque()  # the rest of the current prompt group
        self._groups: list[list[str]] = []  # clean pair ids of every prompt group
        self._prompts: set[str] = set()
        self._next_id = 0
        self._injections = {
            "exact_duplicate": self._exact_duplicate,
            "near_duplicate": self._near_duplicate,
            "contradiction": self._contradiction,
            "tie": self._tie,
            "chosen_equals_rejected": self._chosen_equals_rejected,
            "eval_copy": self._eval_copy,
            "low_quality": self._low_quality,
        }
        self.lines: dict[str, list[bytes]] = {file.path: [] for file in self.files}
        self.injected: dict[str, list[dict]] = {kind: [] for kind in INJECTION_RATES}
        self.clean_ids: list[str] = []

    def build(self) -> _PreferenceBuilder:
        for slot in self._slots:
            self._fill(slot)
        return self

    @property
    def prompt_groups(self) -> list[list[str]]:
        """Clean pair ids of every prompt with several of them, the largest first."""
        return sorted((ids for ids in self._groups if len(ids) > 1), key=len, reverse=True)

    def _fill(self, slot: _Slot) -> None:
        kind = slot.kind
        if kind == "clean" and self._deferred:
            kind = self._deferred.popleft()
        if kind == "malformed":
            self.lines[slot.file.path].append(self._malformed_line(slot.detail))
            self.injected[kind].append(
                {"file": slot.file.path, "line": slot.line, "reason": slot.detail}
            )
            return
        made = self._injections[kind](slot.detail) if kind in self._injections else None
        if made is None:  # a clean slot, or a copy with nothing to copy yet
            if kind in COPY_KINDS:
                self._deferred.append(kind)
            pair = self._clean_pair()
            self.clean_ids.append(pair.id)
        else:
            pair, facts = made
            self.injected[kind].append(
                {"id": pair.id, "file": slot.file.path, "line": slot.line, **facts}
            )
        self.lines[slot.file.path].append(_dumps(pair.as_object()).encode())

    # --- clean pairs ------------------------------------------------------------------------------

    def _clean_pair(self) -> _Pair:
        if not self._pending:
            self._pending.extend(self._prompt_group())
        text = self._pending.popleft()
        pair = self._pair(
            text.prompt, text.chosen, rejected_answer(text.chosen), text.system, self._scores()
        )
        self._groups[text.group].append(pair.id)
        if text.group > 0:  # the largest prompt keeps its 11 pairs, so its cap rejects exactly 3
            self._originals.add(pair)
        return pair

    def _prompt_group(self) -> list[_PairText]:
        rng = self._rng
        group = len(self._groups)
        self._groups.append([])
        size = (
            LARGEST_PROMPT_PAIRS
            if group == 0
            else (rng.randint(2, 4) if rng.random() < MULTI_PAIR_SHARE else 1)
        )
        prompt, system, first = self._fresh_prompt_and_answer()
        return [_PairText(group, prompt, system, first)] + [
            _PairText(group, prompt, system, self._answer()[2]) for _ in range(size - 1)
        ]

    def _fresh_prompt_and_answer(self) -> tuple[str, str | None, str]:
        """A prompt no pair has used yet, a system prompt or None, and an answer to the prompt."""
        while True:
            doc, continued, answer = self._answer()
            for _ in range(20):
                prompt = _prompt(self._rng.choice(SOURCES), doc, continued, self._rng)
                if prompt not in self._prompts:
                    self._prompts.add(prompt)
                    system = (
                        self._rng.choice(SYNTH_SYSTEM_PROMPTS)
                        if self._rng.random() < SYSTEM_SHARE
                        else None
                    )
                    return prompt, system, answer

    def _answer(self) -> tuple[Doc, bool, str]:
        """(doc, continued, text): unused text of ANSWER_MIN_WORDS..ANSWER_MAX_WORDS words."""
        while True:
            doc, continued, text = self._stream.take(self._rng.randint(*ANSWER_TARGET_WORDS))
            if _word_count(text) > ANSWER_MAX_WORDS:
                text, _ = _split_at_sentence(
                    text, ANSWER_MIN_WORDS, ANSWER_TARGET_WORDS[1], ANSWER_MAX_WORDS
                )
            if ANSWER_MIN_WORDS <= _word_count(text) <= ANSWER_MAX_WORDS:
                return doc, continued, text

    def _pair(
        self, prompt, chosen, rejected, system=None, scores=None, created_s=None, meta=None
    ) -> _Pair:
        pair_id = f"{self.source}-{self._next_id:06d}"
        self._next_id += 1
        created = self._rng.randrange(TIME_SPREAD_S) if created_s is None else created_s
        meta = {"rater": f"rater-{self._rng.randint(1, RATERS):02d}"} if meta is None else meta
        return _Pair(pair_id, prompt, chosen, rejected, created, system, scores, meta)

    def _scores(self) -> tuple[float, float] | None:
        """Most pairs are scored, the chosen answer strictly higher, on a 1-10 scale."""
        rng = self._rng
        if rng.random() >= SCORED_SHARE:
            return None
        chosen = round(rng.uniform(6.0, 9.8), 1)
        return chosen, round(rng.uniform(1.0, chosen - 1.0), 1)

    def _later(self, original: _Pair) -> int:
        return original.created_s + self._rng.randint(600, 3 * 86_400)

    # --- injections -------------------------------------------------------------------------------

    def _exact_duplicate(self, _: str | None) -> tuple[_Pair, dict] | None:
        original = self._originals.pick(self._rng)
        if original is None:
            return None
        copy = self._pair(
            original.prompt,
            original.chosen,
            original.rejected,
            original.system,
            original.scores,
            self._later(original),
            original.meta,
        )
        return copy, {"duplicate_of": original.id}

    def _near_duplicate(self, _: str | None) -> tuple[_Pair, dict] | None:
        original = self._originals.pick(self._rng, min_words=NEAR_DUPLICATE_MIN_WORDS)
        if original is None:
            return None
        before = dedup_text(original.prompt, original.chosen, original.rejected)
        for _ in range(8):
            prompt = _edited_prompt(original.prompt, self._rng)
            edit = near_duplicate_response(original.chosen, self._rng)
            if edit is None:
                continue
            jaccard = shingle_jaccard(before, dedup_text(prompt, edit[0], original.rejected))
            if jaccard >= NEAR_DUPLICATE_MIN_JACCARD:
                copy = self._pair(
                    prompt,
                    edit[0],
                    original.rejected,
                    original.system,
                    original.scores,
                    self._later(original),
                )
                return copy, {"duplicate_of": original.id, "jaccard": round(jaccard, 4)}
        return None

    def _contradiction(self, _: str | None) -> tuple[_Pair, dict] | None:
        original = self._originals.pick(self._rng)
        if original is None:
            return None
        swapped = self._pair(
            original.prompt,
            original.rejected,
            original.chosen,
            original.system,
            self._scores(),
            self._later(original),
        )
        return swapped, {"contradicts": original.id}

    def _tie(self, _: str | None) -> tuple[_Pair, dict]:
        prompt, system, answer = self._fresh_prompt_and_answer()
        score = round(self._rng.uniform(3.0, 8.0), 1)
        return self._pair(prompt, answer, rejected_answer(answer), system, (score, score)), {
            "score": score
        }

    def _chosen_equals_rejected(self, variant: str) -> tuple[_Pair, dict]:
        prompt, system, answer = self._fresh_prompt_and_answer()
        chosen, rejected = equal_after_normalization(answer, variant)
        return self._pair(prompt, chosen, rejected, system, self._scores()), {"variant": variant}

    def _eval_copy(self, _: str | None) -> tuple[_Pair, dict] | None:
        if not self._eval_queue:
            return None
        item = self._eval_queue.pop()
        prompt, answer = eval_copy_text(
            item["prompt"], _answer_within_limits(item["response"]), self._rng
        )
        pair = self._pair(prompt, answer, rejected_answer(answer), scores=self._scores())
        return pair, {"eval_set": item["eval_set"], "item_id": item["item_id"]}

    def _low_quality(self, kind: str) -> tuple[_Pair, dict]:
        prompt, system, answer = (
            self._fresh_prompt_and_answer()
        )  # a real question, a useless answer
        chosen = low_quality_response(kind, self._rng)
        return self._pair(prompt, chosen, rejected_answer(answer), system, self._scores()), {
            "kind": kind
        }

    def _malformed_line(self, reason: str) -> bytes:
        """One line that the preference landing contract rejects with exactly ``reason``."""
        prompt, system, answer = self._fresh_prompt_and_answer()
        obj = self._pair(
            prompt, answer, rejected_answer(answer), system, self._scores()
        ).as_object()
        if reason == "missing_field:rejected":
            del obj["rejected"]
        elif reason == "empty_field:chosen":
            obj["chosen"] = self._rng.choice(("", "   ", "\n\t "))
        elif reason == "invalid_json":
            text = _dumps(obj)
            return text[: self._rng.randint(len(text) // 4, len(text) * 3 // 4)].encode()
        else:
            raise ValueError(f"unknown malformed reason {reason!r}")
        return _dumps(obj).encode()


def _built(pairs: int, seed: int, eval_items: list[dict], source: str) -> _PreferenceBuilder:
    return built_with_enough_words(
        lambda words: _PreferenceBuilder(pairs, seed, eval_items, source, words).build(),
        pairs * WORDS_PER_PAIR,
    )


# --- Writing --------------------------------------------------------------------------------------


def check_pair_count(pairs: int) -> None:
    if pairs < MIN_PAIRS:
        raise ValueError(
            f"preference pairs must be at least {MIN_PAIRS} (the largest prompt alone has "
            f"{LARGEST_PROMPT_PAIRS}), got {pairs}"
        )


def write_preference_source(
    out_dir: Path, pairs: int, eval_items: list[dict], seed: int, source: str = SOURCE
) -> dict:
    """Writes ``pairs`` lines of preference pairs under out_dir/<source>/ and returns the manifest's
    ``preference`` section. ``eval_items`` are the eval sets' items (eval_set, item_id, prompt,
    response), the ones decontamination is to find copies of."""
    check_pair_count(pairs)
    builder = _built(pairs, seed, eval_items, source)
    files = []
    for file in builder.files:
        malformed = sum(entry["file"] == file.path for entry in builder.injected["malformed"])
        written = written_file_entry(out_dir, file, builder.lines[file.path], source)
        files.append({**written, "pairs": file.lines - malformed})
    return _manifest_section(builder, files, pairs, seed)


def _manifest_section(
    builder: _PreferenceBuilder, files: list[dict], pairs: int, seed: int
) -> dict:
    quarantined = len(builder.injected["malformed"])
    groups = builder.prompt_groups
    return {
        "source": builder.source,
        "format": RECORD_FORMAT,
        "setting": {"PIPELINE_SOURCE_FORMATS": {builder.source: RECORD_FORMAT}},
        "seed": seed,
        "pairs": pairs,
        "rates": dict(INJECTION_RATES),
        "files": files,
        "injected_counts": {kind: len(entries) for kind, entries in builder.injected.items()},
        "injected": builder.injected,
        "clean_ids": builder.clean_ids,
        "prompt_groups": builder.prompt_groups,
        "expected": {
            "lines": pairs,
            "quarantined": quarantined,
            "bronze_rows": pairs - quarantined,
            "prompt_pair_cap": PROMPT_PAIR_CAP,
            "pairs_over_prompt_cap": sum(max(0, len(ids) - PROMPT_PAIR_CAP) for ids in groups),
        },
    }


def add_preference_source(
    out_dir: Path, pairs: int, eval_sets_dir: Path | None = None, source: str = SOURCE
) -> dict:
    """Adds a preference source to the sample corpus written in out_dir (``write_sample_corpus``),
    with its seed and against its eval sets (in eval_sets_dir, default out_dir/'_eval_sets'), and
    its ``preference`` section to the corpus's manifest. Returns the whole manifest."""
    return add_manifest_section(
        out_dir,
        eval_sets_dir,
        "preference",
        lambda eval_items, seed: write_preference_source(out_dir, pairs, eval_items, seed, source),
    )
