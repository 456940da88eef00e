"""The sample corpus at any size: Markov text in place of docstring prose, streamed to disk.

``sample_corpus`` hands every record prose that nothing else uses, so it stops at about 23,000
records. This writer keeps its sources, formats, injected defects and rates, and its manifest of
what was injected where, but the answers come from ``markov_text`` (a chain trained once on a
capped part of the same docstrings), so millions of records are as easy as thousands:

- Files: each source's lines are split into files of at most ``file_records`` lines. File k of
  every source forms shard k, and the corpus is generated shard by shard, each file written (on
  a background thread) as soon as it is full: memory holds one file's lines, never the corpus.
  A benchmark can land shard by shard, in batches of ``4 * file_records`` records.
- Every clean answer is distinct (as lowercased words) from every other one, shares no 13-word
  run with any eval item and passes every quality rule; eval items come from a chain trained on
  docs the answers' chain never saw, and each names a subject no other item names. So silver
  removes the injected defects and nothing else: the manifest's ``expected`` says how many of
  each (near duplicates are found by MinHash estimates: a few in a thousand can slip through).
- A duplicate copies a record sampled from all earlier ones (a bounded reservoir), from its own
  source or one before it in path order: the original precedes its copies whether the corpus is
  landed at once or shard by shard, so it is the copy that silver removes.
- The manifest lists injected records as ``sample_corpus`` does but counts the clean ones
  (``clean_records``) instead of listing their ids.

Same arguments on the same install give byte-identical files.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import math
import os
import random
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson
import zstandard

from pipeline_assets.sample_data import markov_text
from pipeline_assets.sample_data.corpus import (
    _EVAL_PROMPTS,
    EVAL_RESPONSE_MIN_WORDS,
    EVAL_SETS,
    FILES_PER_SOURCE,
    INJECTION_RATES,
    MANIFEST_NAME,
    MARKOV_FILE_RECORDS,
    NEAR_DUPLICATE_MIN_WORDS,
    RESPONSE_LENGTH_SIGMA,
    RESPONSE_MAX_WORDS,
    RESPONSE_MEDIAN_WORDS,
    RESPONSE_MIN_WORDS,
    SOURCE_FORMATS,
    SOURCES,
    SYNTH_SYSTEM_PROMPTS,
    TIME_SPREAD_S,
    Doc,
    LandingFile,
    _CopyInjection,
    _doc_pool,
    _dumps,
    _encode_file,
    _eval_items_per_set,
    _injection_counts,
    _malformed_line,
    _prompt,
    _Record,
    _record_object,
    _Slot,
    _slot_kinds,
    _SourceVoice,
    _write,
    low_quality_response,
)  # fmt: skip

# Words of docstring prose the chains learn from: the stdlib and the first packages in
# EXTRA_DOC_PACKAGES (about 16 s of parsing on 2 cores, once per process).
TRAINING_WORDS = 500_000
RESERVOIR_PER_SOURCE = 4096  # earlier clean records a duplicate may copy
CONTINUED_PROMPT_ODDS = 0.2  # "tell me more about X" instead of a first question
EVAL_RESPONSE_MAX_WORDS = 60
_WRITES_IN_FLIGHT = 1  # files handed to the writer and not yet written
ANSWER_BATCH = 8192
_LINES_PER_JOIN = 4096
GZIP_LEVEL = 1  # 4x faster than sample_corpus's 6, for files about a fifth larger
PARALLEL_MIN_RECORDS = 100_000  # below, starting processes costs more than they save


class _Subject(NamedTuple):
    """What a prompt names (the fields of Doc that ``_prompt`` reads, worked out once)."""

    name: str
    module: str
    kind: str


@lru_cache(maxsize=1)
def _trained() -> tuple[markov_text.MarkovText, list[_Subject], list[Doc]]:
    """The chains, the subjects of the answers' docs, and the held-out docs."""
    docs = _doc_pool().docs_with_words(TRAINING_WORDS)
    held_out = [doc for doc in docs if markov_text.held_out(doc.module, doc.qualname)]
    subjects = [
        _Subject(doc.name, doc.module, doc.kind)
        for doc in docs
        if not markov_text.held_out(doc.module, doc.qualname)
    ]
    return markov_text.train_markov_text(docs), subjects, held_out


class _FastRandom(random.Random):
    """``random.Random`` whose choice, randrange and randint take one ``random()`` each: several
    times faster than the exact stdlib ones, at a bias (below 2**-40) no corpus can show."""

    def choice(self, seq):
        return seq[int(self.random() * len(seq))]

    def randrange(self, start, stop=None):
        if stop is None:
            start, stop = 0, start
        return start + int(self.random() * (stop - start))

    def randint(self, a, b):
        return a + int(self.random() * (b - a + 1))


# --- Layout ---------------------------------------------------------------------------------------


def landing_shards(
    records: int, file_records: int = MARKOV_FILE_RECORDS
) -> list[list[LandingFile]]:
    """Shard k holds file k of every source, in path order; a source's lines spread evenly over
    its files, at least ``FILES_PER_SOURCE`` of them and none over ``file_records`` lines."""
    per_source = [
        records // len(SOURCES) + (i < records % len(SOURCES)) for i in range(len(SOURCES))
    ]
    files_per_source = max(FILES_PER_SOURCE, math.ceil(max(per_source) / file_records))
    width = max(3, len(str(files_per_source - 1)))
    shards: list[list[LandingFile]] = [[] for _ in range(files_per_source)]
    for source, lines in sorted(zip(SOURCES, per_source, strict=True)):
        fmt = SOURCE_FORMATS[source]
        for index, shard in enumerate(shards):
            share = lines // files_per_source + (index < lines % files_per_source)
            shard.append(
                LandingFile(source, f"{source}/{source}-{index:0{width}d}.{fmt}", fmt, share)
            )
    return shards


# --- Duplicates' originals ------------------------------------------------------------------------


class _OriginalReservoir:
    """A uniform sample of the clean records written so far, per source and apart for the long
    ones (a near duplicate needs NEAR_DUPLICATE_MIN_WORDS: drawn from one pool, near duplicates
    would use up its long records faster than new ones come in); each is copied at most once.
    A copy takes its original from its own source or one before it in path order."""

    def __init__(self, rng: _FastRandom) -> None:
        self._rng = rng
        self._kept: dict[tuple[str, bool], list[_Record]] = {
            (s, long): [] for s in SOURCES for long in (False, True)
        }
        self._seen = dict.fromkeys(self._kept, 0)

    def add(self, record: _Record) -> None:
        pool = (record.source, record.words >= NEAR_DUPLICATE_MIN_WORDS)
        kept = self._kept[pool]
        self._seen[pool] += 1
        if len(kept) < RESERVOIR_PER_SOURCE:
            kept.append(record)
        elif (slot := self._rng.randrange(self._seen[pool])) < RESERVOIR_PER_SOURCE:
            kept[slot] = record

    def pick(self, source: str, other_source_odds: float, long: bool = False) -> _Record | None:
        rng = self._rng
        others = [s for s in SOURCES if s < source]
        groups = [others, [source]] if rng.random() < other_source_odds else [[source], others]
        for group in groups:
            pools = [(s, True) for s in group] + ([] if long else [(s, False) for s in group])
            sizes = [len(self._kept[pool]) for pool in pools]
            if sum(sizes):
                candidates = self._kept[rng.choices(pools, weights=sizes)[0]]
                index = rng.randrange(len(candidates))
                candidates[index], candidates[-1] = candidates[-1], candidates[index]
                return candidates.pop()
        return None


# --- Eval sets ------------------------------------------------------------------------------------


def _eval_items(
    held_out: list[Doc], per_set: int, rng: random.Random, answers: markov_text.AnswerSource
) -> tuple[dict[str, list[dict]], markov_text.Answers]:
    """Eval items with held-out text, each named after its own subject, and their answers."""
    batch = _answers_for(answers, len(EVAL_SETS) * per_set)
    used: set[str] = set()
    names = _subject_names(held_out, rng, used)
    stdlib_names = _subject_names(
        [d for d in held_out if d.origin == "stdlib"] or held_out, rng, used
    )
    eval_sets: dict[str, list[dict]] = {}
    responses = iter(batch.texts)
    for name in EVAL_SETS:
        subjects = stdlib_names if name == "stdlib_qa" else names
        items = eval_sets[name] = []
        width = max(4, len(str(per_set)))
        for number in range(1, per_set + 1):
            subject = next(subjects)
            template = rng.choice(_EVAL_PROMPTS[name])
            items.append({"eval_set": name, "item_id": f"{name}-{number:0{width}d}",
                          "prompt": template.format(name=subject),
                          "response": next(responses)})  # fmt: skip
    return eval_sets, batch


def _subject_names(docs: list[Doc], rng: random.Random, used: set[str]):
    """Endless API names not in ``used`` (each one added as it is handed out): the docs' own,
    then made-up ones (a module's name and another doc's last name part, numbered once those
    run out), so every eval prompt names a subject of its own."""
    names = [doc.name for doc in docs]
    rng.shuffle(names)
    modules = sorted({doc.module for doc in docs})
    leaves = sorted({doc.name.rsplit(".", 1)[-1] for doc in docs})
    made_up = (f"{rng.choice(modules)}.{rng.choice(leaves)}" for _ in itertools.repeat(None))
    for name in itertools.chain(names, made_up):
        numbered, number = name, 1
        while numbered in used:
            number += 1
            numbered = f"{name}{number}"
        used.add(numbered)
        yield numbered


def _answers_for(source: markov_text.AnswerSource, count: int) -> markov_text.Answers:
    """The next ``count`` answers of ``source`` as one batch (tokens kept, for the ban)."""
    batches, have = [], 0
    while have < count:
        batches.append(source.next_batch())
        have += len(batches[-1].texts)
    return markov_text.first_answers(markov_text.concat_answers(batches), count)


# --- Records --------------------------------------------------------------------------------------


def _batch_size(answers: int) -> int:
    """Answers made at a time: no more than a small corpus needs, and fewer than the few
    thousand that keep numpy's work per call large."""
    return min(ANSWER_BATCH, max(256, answers))


class _MarkovCorpusBuilder(_CopyInjection):
    """Fills the slots of one file after another and notes what went where."""

    def __init__(self, records: int, seed: int, spool: dict, workers: int) -> None:
        text, self._subjects, held_out = _trained()
        rng = self._rng = _FastRandom(seed)
        unique = markov_text.UniqueKeys()
        per_set = _eval_items_per_set(records)
        eval_recipe = markov_text.AnswerRecipe(
            text.held_out_chain, text.table,
            markov_text.UniformWords(EVAL_RESPONSE_MIN_WORDS, EVAL_RESPONSE_MAX_WORDS),
            seed, stream=1, batch=_batch_size(len(EVAL_SETS) * per_set), keep_tokens=True,
        )  # fmt: skip
        self.eval_sets, eval_answers = _eval_items(
            held_out, per_set, rng, markov_text.AnswerSource(eval_recipe, unique)
        )
        self._eval_queue = [item for items in self.eval_sets.values() for item in items]
        rng.shuffle(self._eval_queue)
        recipe = markov_text.AnswerRecipe(
            text.chain, text.table,
            markov_text.LogNormalWords(RESPONSE_MEDIAN_WORDS, RESPONSE_LENGTH_SIGMA,
                                       RESPONSE_MIN_WORDS, RESPONSE_MAX_WORDS - 50),
            seed, stream=0, ban=markov_text.GramBan(text.table, eval_answers),
            batch=_batch_size(records),
        )  # fmt: skip
        self._answers = markov_text.AnswerSource(recipe, unique, workers)
        self._voice = _SourceVoice(rng)
        self._originals = _OriginalReservoir(rng)
        self._deferred: deque[str] = deque()  # duplicates that had no earlier record to copy yet
        self._low_quality_seen: set[tuple[str, str]] = set()
        self._spool = spool  # kind -> a file of injected entries, one JSON object a line
        self.injected_counts = dict.fromkeys(INJECTION_RATES, 0)
        self.clean_records = 0
        self._injections = {
            "exact_duplicate": self._exact_duplicate,
            "near_duplicate": self._near_duplicate,
            "eval_copy": self._eval_copy,
            "low_quality": self._low_quality,
        }

    def close(self) -> None:
        self._answers.close()

    def file_content(self, file: LandingFile, counts: dict[str, int]) -> bytes | list[dict]:
        """The file's JSON lines as one text, or its rows (dicts, for Parquet), in order."""
        units: list = []
        joined: list[bytes] = []  # orjson's bytes keep ~5 KB of spare room: join them soon
        for line, (kind, detail) in enumerate(self._slot_plan(file, counts), start=1):
            if kind == "clean" and not self._deferred:
                units.append(self._clean_unit(file))
            else:
                units.append(self._fill(_Slot(file, line, kind, detail)))
            if len(units) == _LINES_PER_JOIN and file.format != "parquet":
                joined.append(b"".join(units))
                units = []
        return units if file.format == "parquet" else b"".join([*joined, *units])

    def _slot_plan(self, file: LandingFile, counts: dict[str, int]) -> list[tuple[str, str | None]]:
        """(kind, detail) of each line, in a seeded-random order (as ``_file_slots``, faster)."""
        kinds = _slot_kinds(file, counts, self._rng)
        order = np.random.default_rng(self._rng.getrandbits(64)).permutation(len(kinds))
        return [kinds[i] for i in order.tolist()]

    def _clean_unit(self, file: LandingFile):
        record = self._clean_record(file.source)
        self.clean_records += 1
        self._originals.add(record)
        obj = _record_object(record)
        return obj if file.format == "parquet" else orjson.dumps(obj) + b"\n"

    def _fill(self, slot: _Slot):
        kind = slot.kind
        if kind == "clean" and self._deferred:
            kind = self._deferred.popleft()
        if kind == "malformed":
            return self._malformed(slot)
        made = self._injections[kind](slot) if kind in self._injections else None
        if made is None:  # nothing to copy (yet): a clean record, and a duplicate comes later
            if kind in ("exact_duplicate", "near_duplicate"):
                self._deferred.append(kind)
            return self._clean_unit(slot.file)
        record, facts = made
        where = {"file": slot.file.path, "line": slot.line}
        self._note(kind, {"id": record.id, "source": record.source, **where, **facts})
        obj = _record_object(record)
        return obj if slot.file.format == "parquet" else orjson.dumps(obj) + b"\n"

    def _note(self, kind: str, entry: dict) -> None:
        self._spool[kind].write(orjson.dumps(entry) + b"\n")
        self.injected_counts[kind] += 1

    def _clean_record(self, source: str) -> _Record:
        rng = self._rng
        response, words = self._answers.take()
        subject = self._subjects[rng.randrange(len(self._subjects))]
        prompt = _prompt(source, subject, rng.random() < CONTINUED_PROMPT_ODDS, rng)
        system = rng.choice(SYNTH_SYSTEM_PROMPTS) if source == "synth" else None
        record = self._voice.record(source, prompt, response, rng.randrange(TIME_SPREAD_S), system)
        record.words = words
        return record

    def _original(self, source: str, other_source_odds: float, near: bool) -> _Record | None:
        return self._originals.pick(source, other_source_odds=other_source_odds, long=near)

    def _low_quality(self, slot: _Slot) -> tuple[_Record, dict]:
        """A real question with a useless answer; never the same question with the same kind of
        junk twice, which would make it a duplicate before it is low quality."""
        rng = self._rng
        while True:
            subject = self._subjects[rng.randrange(len(self._subjects))]
            prompt = _prompt(slot.file.source, subject, False, rng)
            response = low_quality_response(slot.detail, rng)
            key = (prompt, response.split("\n", 1)[0])
            if key not in self._low_quality_seen:
                self._low_quality_seen.add(key)
                break
        record = self._voice.record(
            slot.file.source, prompt, response, rng.randrange(TIME_SPREAD_S)
        )
        return record, {"kind": slot.detail}

    def _malformed(self, slot: _Slot):
        rng = self._rng
        subject = self._subjects[rng.randrange(len(self._subjects))]
        prompt = _prompt(slot.file.source, subject, False, rng)
        response = " ".join(self._answers.take()[0].split()[:12])  # quarantined: any text
        record = self._voice.record(
            slot.file.source, prompt, response, rng.randrange(TIME_SPREAD_S)
        )
        self._note("malformed", {"source": slot.file.source, "file": slot.file.path,
                                 "line": slot.line, "reason": slot.detail})  # fmt: skip
        if slot.file.format != "parquet":
            return _malformed_line(record, slot.detail, rng) + b"\n"
        unit = _record_object(record)
        if slot.detail == "missing_field:response":
            unit["response"] = None
        else:  # empty_field:prompt
            unit["prompt"] = rng.choice(("   ", "\t", " \n "))
        return unit


# --- Writing --------------------------------------------------------------------------------------


def write_markov_corpus(
    out_dir: Path,
    records: int,
    eval_sets_dir: Path | None = None,
    seed: int = 20261121,
    file_records: int = MARKOV_FILE_RECORDS,
    workers: int | None = None,
) -> dict:
    """Writes the landing files under out_dir/<source>/..., the eval sets under eval_sets_dir
    (default out_dir/'_eval_sets') and the manifest out_dir/'_sample_manifest.json'. Returns the
    manifest without its injected entries (they can be millions): read the file for those.

    ``workers``: processes that generate answers (None: one per core for a corpus of
    ``PARALLEL_MIN_RECORDS`` or more, else none); the files do not depend on it."""
    if records < len(SOURCES) * FILES_PER_SOURCE:
        raise ValueError(
            f"records must be at least {len(SOURCES) * FILES_PER_SOURCE}, got {records}"
        )
    if file_records < 1:
        raise ValueError(f"file_records must be at least 1, got {file_records}")
    out_dir = Path(out_dir)
    eval_sets_dir = Path(eval_sets_dir) if eval_sets_dir is not None else out_dir / "_eval_sets"
    shards = landing_shards(records, file_records)
    files = sorted((file for shard in shards for file in shard), key=lambda f: f.path)
    counts = dict(zip((f.path for f in files), _injection_counts(files), strict=True))
    with tempfile.TemporaryDirectory() as spool_dir:
        spool = {kind: open(Path(spool_dir) / kind, "w+b") for kind in INJECTION_RATES}
        try:
            builder = _MarkovCorpusBuilder(records, seed, spool, _workers(records, workers))
            try:
                written = _write_files(out_dir, shards, counts, builder)
            finally:
                builder.close()
            manifest = _manifest(
                records, seed, file_records, shards, written, builder, eval_sets_dir
            )
            _write_manifest(out_dir / MANIFEST_NAME, manifest, spool)
        finally:
            for handle in spool.values():
                handle.close()
    return manifest


def _workers(records: int, workers: int | None) -> int:
    if workers is not None:
        return workers
    return len(os.sched_getaffinity(0)) if records >= PARALLEL_MIN_RECORDS else 0


def _write_files(out_dir: Path, shards, counts, builder: _MarkovCorpusBuilder) -> dict[str, str]:
    """Generates file after file, shard by shard, and writes each on a background thread while
    the next one fills. Returns path -> sha256."""
    written: dict[str, Future] = {}
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=1) as writer:
        for shard in shards:
            for file in shard:
                content = builder.file_content(file, counts[file.path])
                while len(pending) >= _WRITES_IN_FLIGHT:
                    pending.popleft().result()  # bounds the files held in memory
                future = writer.submit(_encode_and_write, out_dir / file.path, file.format, content)
                written[file.path] = future
                pending.append(future)
    return {path: future.result() for path, future in written.items()}


def _encode_and_write(path: Path, fmt: str, content: bytes | list[dict]) -> str:
    if fmt == "parquet":
        return _write(path, _encode_file(fmt, content))
    if fmt == "jsonl.gz":
        buffer = io.BytesIO()
        with gzip.GzipFile(
            fileobj=buffer, mode="wb", mtime=0, filename="", compresslevel=GZIP_LEVEL
        ) as gz:
            gz.write(content)
        return _write(path, buffer.getvalue())
    if fmt == "jsonl.zst":
        return _write(path, zstandard.ZstdCompressor(level=3).compress(content))
    return _write(path, content)


def _manifest(records, seed, file_records, shards, written, builder, eval_sets_dir) -> dict:
    files = [
        {"path": f.path, "source": f.source, "format": f.format, "lines": f.lines,
         "sha256": written[f.path], "shard": index}
        for index, shard in enumerate(shards) for f in shard
    ]  # fmt: skip
    eval_sets = []
    for name, items in builder.eval_sets.items():
        data = b"".join(_dumps(item).encode() + b"\n" for item in items)
        sha256 = _write(eval_sets_dir / f"{name}.jsonl", data)
        eval_sets.append({"path": f"{name}.jsonl", "items": len(items), "sha256": sha256})
    injected = builder.injected_counts
    return {
        "seed": seed,
        "records": records,
        "text": "markov",
        "file_records": file_records,
        "sources": list(SOURCES),
        "files": sorted(files, key=lambda f: f["path"]),
        "eval_sets": eval_sets,
        "injected_counts": injected,
        "clean_records": builder.clean_records,
        "expected": {
            "lines": records,
            "quarantined": injected["malformed"],
            "bronze_rows": records - injected["malformed"],
            "silver_rows": builder.clean_records,
            "silver_rejects": {
                "exact_dup": injected["exact_duplicate"],
                "near_dup": injected["near_duplicate"],
                "decontaminated": injected["eval_copy"],
                "quality": injected["low_quality"],
            },
        },
    }


def _write_manifest(path: Path, manifest: dict, spool: dict) -> None:
    """The manifest as sample_corpus writes it, with the spooled injected entries inserted, one
    per line, without holding them in memory."""
    head = json.dumps(manifest, indent=1, ensure_ascii=False)
    before, after = (
        head[: head.index('\n "clean_records"')],
        head[head.index('\n "clean_records"') :],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        out.write(before.encode() + b'\n "injected": {')
        for number, (kind, handle) in enumerate(spool.items()):
            out.write(b"," if number else b"")
            out.write(b'\n  "' + kind.encode() + b'": [')
            handle.seek(0)
            for line_number, line in enumerate(handle):
                out.write((b",\n   " if line_number else b"\n   ") + line.rstrip(b"\n"))
            out.write(b"\n  ]")
        out.write(b"\n },")
        out.write(after.encode() + b"\n")
