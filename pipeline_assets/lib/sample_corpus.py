"""A deterministic sample landing corpus: real text, with known defects in known places.

Prompts and responses are built from docstrings of the Python standard library and, when the
requested size needs more text, of a fixed list of installed packages, read with ``ast`` from
their source files (nothing is imported). Four sources land in four formats. On top of the clean
records the generator injects exact and near duplicates, copies of eval-set items, low-quality
records and malformed lines, and writes a manifest saying where each one is and what the
pipeline should make of it, so every layer's tests can check they catch exactly those.

Same ``records`` and ``seed`` on the same install give byte-identical files.
"""

from __future__ import annotations

import ast
import gc
import gzip
import hashlib
import importlib.util
import io
import json
import math
import os
import random
import re
import sysconfig
import textwrap
import threading
import warnings
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import polars as pl
import zstandard

SOURCES = ("annotate", "synth", "logs", "scrape")
SOURCE_FORMATS = {
    "annotate": "jsonl",
    "synth": "jsonl.zst",
    "logs": "jsonl.gz",
    "scrape": "parquet",
}
FILES_PER_SOURCE = 2
EVAL_SETS = ("stdlib_qa", "doc_summaries")
MANIFEST_NAME = "_sample_manifest.json"

# Share of landing lines given to each injected defect; every other line is a clean record.
INJECTION_RATES = {
    "exact_duplicate": 0.03,
    "near_duplicate": 0.03,
    "eval_copy": 0.01,
    "low_quality": 0.02,
    "malformed": 0.01,
}
MAX_MALFORMED_PERCENT = 3  # per file, strictly below; a later check blocks a batch above 5%
JSON_MALFORMED_REASONS = (
    "invalid_json",
    "not_an_object",
    "missing_field:response",
    "wrong_type:prompt",
    "empty_field:response",
    "invalid_utf8",
)
PARQUET_MALFORMED_REASONS = ("missing_field:response", "empty_field:prompt")
LOW_QUALITY_KINDS = ("too_short", "symbol_spam", "repeated_lines", "non_alpha")

RESPONSE_MIN_WORDS = 6
RESPONSE_MAX_WORDS = 300
# Real post-training responses are long-tailed: many short answers, a few long ones. The short
# ones matter downstream, since they are what fills the gaps when sequences are packed.
RESPONSE_MEDIAN_WORDS = 40
RESPONSE_LENGTH_SIGMA = 1.0
EVAL_RESPONSE_MIN_WORDS = 30
NEAR_DUPLICATE_MIN_JACCARD = 0.85
# One edit in a shorter response can drop the word 5-gram Jaccard below 0.85.
NEAR_DUPLICATE_MIN_WORDS = 70

BASE_TIME = datetime(2026, 11, 1, tzinfo=timezone.utc)
TIME_SPREAD_S = 30 * 86_400

# Packages read after the stdlib when it runs out of text, in this order (most prose per second
# of parsing first). All are dependencies of this project, direct or through mlflow, torch and
# dagster; one that is missing is skipped.
EXTRA_DOC_PACKAGES = (
    "networkx", "flask", "werkzeug", "click", "jinja2", "sklearn", "sqlalchemy", "scipy", "numpy",
    "sympy", "matplotlib", "dagster", "torch", "mlflow", "pandas", "pydantic", "polars", "alembic",
    "botocore", "pandera", "graphql", "pygments", "fsspec", "git", "urllib3", "requests", "pyarrow",
)  # fmt: skip
_SKIPPED_DIRS = frozenset(
    {
        "__pycache__", "site-packages", "dist-packages", "test", "tests", "testing", "idle_test",
        "lib2to3", "turtledemo", "ensurepip", "_vendor", "vendor", "vendored", "examples",
        "benchmarks",
    }
)  # fmt: skip


# --- Text: cleaned docstring paragraphs -----------------------------------------------------------


class Doc(NamedTuple):
    """The cleaned paragraphs of one docstring, and what it documents."""

    origin: str  # "stdlib" or the package name
    module: str
    qualname: str  # "" for a module docstring
    kind: str  # module | class | function | method
    paragraphs: tuple[str, ...]

    @property
    def name(self) -> str:
        """The name users know, private modules left out: ``sklearn.feature_selection.RFE``."""
        parts = self.module.split(".")
        public = [part for part in parts if not part.startswith("_")] or parts
        return ".".join(public + ([self.qualname] if self.qualname else []))

    @property
    def words(self) -> int:
        return sum(len(p.split()) for p in self.paragraphs)


def _origin_root(origin: str) -> Path | None:
    if origin == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    try:  # for a top-level name, find_spec locates the package without importing it
        spec = importlib.util.find_spec(origin)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _python_files(root: Path) -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        files.extend(
            Path(folder) / name
            for name in sorted(names)
            if name.endswith(".py") and not name.startswith(("test_", "conftest"))
        )
    return files


def _module_name(origin: str, root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if origin != "stdlib":
        parts.insert(0, origin)
    return ".".join(parts) or origin


def _docstrings(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(qualname, kind, docstring) of the module and every class and function in it."""
    found = []
    if doc := ast.get_docstring(tree):
        found.append(("", "module", doc))

    def visit(body: list, prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{node.name}"
                is_class = isinstance(node, ast.ClassDef)
                kind = "class" if is_class else ("method" if in_class else "function")
                if doc := ast.get_docstring(node):
                    found.append((qualname, kind, doc))
                visit(node.body, f"{qualname}.", is_class)
            else:  # definitions inside if/try/with/for blocks
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner, prefix, in_class)

    visit(tree.body, "", False)
    return found


_SECTION_HEADER = re.compile(r"^[\w ]{1,30}:$")  # "Args:", "Note:", "Example usage:"
_CODE_SECTIONS = frozenset({"Example", "Examples", "Usage", "Code"})
_MARKUP_LINE = re.compile(r"^\s*(?:[=\-~^*+#`]{3,}|\+[-=+]+\+)")  # rst underlines and tables
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_TRIPLE_QUOTED = re.compile(rb'""".*?"""|\'\'\'.*?\'\'\'', re.S)
MIN_DOCSTRING_SHARE = 0.1  # files with less are mostly code: slow to parse for little text


def clean_paragraph(raw: str) -> str | None:
    """The paragraph as one line of prose, or None for code, doctests, tables and fragments."""
    lines = raw.strip("\n").split("\n")
    doctest_start = next(
        (i for i, line in enumerate(lines) if line.lstrip().startswith((">>>", "..."))), None
    )
    lines = lines[:doctest_start]  # prose that introduces an example stays; the example goes
    if lines and _SECTION_HEADER.match(lines[0]):  # "Args:", "Note:": keep what the section says
        if lines[0].split()[0].rstrip(":") in _CODE_SECTIONS:
            return None
        lines = textwrap.dedent("\n".join(lines[1:])).split("\n")
    first = lines[0] if lines else ""
    if not first or first[0].isspace() or first.startswith(":") or _SECTION_HEADER.match(first):
        return None
    if any(_MARKUP_LINE.match(line) for line in lines):
        return None
    text = " ".join(" ".join(lines).split())
    words = text.split()
    if not 12 <= len(words) <= 250 or text.endswith("::") or text[-1] not in ".!?:)":
        return None
    if not text.isprintable():  # control, format or unassigned characters
        return None
    if sum(w.lower() == w.upper() for w in words) > 0.15 * len(words):  # words without a letter
        return None
    visible = text.replace(" ", "")
    if sum(map(str.isalpha, visible)) < 0.75 * len(visible):
        return None
    return text


def _docstring_share(source: bytes) -> float:
    """Rough share of a file's bytes inside triple-quoted strings."""
    return sum(map(len, _TRIPLE_QUOTED.findall(source))) / max(1, len(source))


def _file_docs(origin: str, root: Path, path: Path) -> list[Doc]:
    try:
        source = path.read_bytes()
        if _docstring_share(source) < MIN_DOCSTRING_SHARE:
            return []
        with warnings.catch_warnings():  # invalid escape sequences etc. in third-party sources
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError, RecursionError, OSError):
        return []
    module = _module_name(origin, root, path)
    docs = []
    for qualname, kind, text in _docstrings(tree):
        paragraphs = tuple(p for raw in _PARAGRAPH_BREAK.split(text) if (p := clean_paragraph(raw)))
        if paragraphs:
            docs.append(Doc(origin, module, qualname, kind, paragraphs))
    return docs


def _origin_docs(origin: str) -> list[Doc]:
    """The docs of every source file of ``origin`` (the stdlib or a package), in path order."""
    root = _origin_root(origin)
    if root is None:
        return []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # parsing allocates millions of AST nodes; collection passes would double the time
    try:
        return [doc for path in _python_files(root) for doc in _file_docs(origin, root, path)]
    finally:
        if gc_was_enabled:
            gc.enable()


class _DocPool:
    """Docstrings of the stdlib, then of each extra package, with no text shared between any two.

    A paragraph that shares a word 8-gram (lowercased) with a paragraph kept before it is dropped,
    so no two records, and no record and eval item, can be near duplicates of each other or trip
    an n-gram decontamination check. Packages are read only when a corpus needs their text, and
    the result is kept for the life of the process; the order is fixed, so the first k origins
    always give the same docs.
    """

    ORIGINS = ("stdlib", *EXTRA_DOC_PACKAGES)

    def __init__(self) -> None:
        self._docs: list[Doc] = []
        self._ends: list[tuple[int, int]] = []  # per origin read: (docs so far, words so far)
        self._vocabulary: dict[str, int] = {}
        self._seen_8grams: set[int] = set()
        self._seen_subjects: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def docs_with_words(self, min_words: int) -> list[Doc]:
        """The docs of the fewest origins that hold at least ``min_words`` words."""
        with self._lock:
            while self._words < min_words and len(self._ends) < len(self.ORIGINS):
                self._add(_origin_docs(self.ORIGINS[len(self._ends)]))
            for doc_count, words in self._ends:
                if words >= min_words:
                    return self._docs[:doc_count]
            raise RuntimeError(
                f"the installed docstrings hold {self._words} words of unique prose and "
                f"{min_words} are needed: ask for fewer records, or for Markov text "
                "(markov_corpus, `sample-data --text markov`), which has no such limit"
            )

    @property
    def _words(self) -> int:
        return self._ends[-1][1] if self._ends else 0

    def _add(self, docs: list[Doc]) -> None:
        words = self._words
        for doc in docs:
            subject = (doc.module, doc.qualname)
            if subject in self._seen_subjects:
                continue
            paragraphs = tuple(p for p in doc.paragraphs if self._is_new_text(p))
            if paragraphs:
                self._seen_subjects.add(subject)
                self._docs.append(doc._replace(paragraphs=paragraphs))
                words += sum(len(p.split()) for p in paragraphs)
        self._ends.append((len(self._docs), words))

    def _is_new_text(self, paragraph: str) -> bool:
        ids = [
            self._vocabulary.setdefault(w, len(self._vocabulary))
            for w in re.findall(r"\w+", paragraph.lower())
        ]
        # Hashes of tuples of ints do not depend on PYTHONHASHSEED, so this is deterministic.
        grams = {hash(tuple(ids[i : i + 8])) for i in range(len(ids) - 7)}
        if not grams or not grams.isdisjoint(self._seen_8grams):
            return False
        self._seen_8grams |= grams
        return True


@lru_cache(maxsize=1)
def _doc_pool() -> _DocPool:
    return _DocPool()


# --- Responses: unused text handed out in order ---------------------------------------------------


class _Piece(NamedTuple):
    doc: Doc
    continued: bool  # not the first paragraph of its docstring
    text: str


class _PoolExhausted(Exception):
    pass


_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z`\"'(])")


class _TextStream:
    """Paragraphs not yet used by any record; each piece of text goes to exactly one record.

    Unique text is the scarce resource (a 20,000-line corpus needs about a million words), so
    a response is filled close to its target length: a paragraph that would overshoot is cut
    at a sentence boundary, or one of the next few paragraphs that fits is taken first.
    """

    LOOKAHEAD = 8
    SLACK_WORDS = 5

    def __init__(self, docs: list[Doc]):
        self._pieces = deque(
            _Piece(doc, i > 0, p) for doc in docs for i, p in enumerate(doc.paragraphs)
        )

    def next_subject(self) -> tuple[Doc, bool]:
        if not self._pieces:
            raise _PoolExhausted
        return self._pieces[0].doc, self._pieces[0].continued

    def take(self, target_words: int) -> tuple[Doc, bool, str]:
        """(doc, continued, text): RESPONSE_MIN_WORDS..RESPONSE_MAX_WORDS words, near the target."""
        doc, continued = self.next_subject()
        taken: list[str] = []
        words = 0
        while words < target_words:
            room = target_words - words + self.SLACK_WORDS
            # The subject's own paragraph comes first; the later ones are picked to fit.
            piece = self._pop_fitting(doc.module, room) if taken else self._pieces.popleft()
            size = _word_count(piece.text)
            if size > room:
                head, rest = _split_at_sentence(
                    piece.text,
                    RESPONSE_MIN_WORDS - words,
                    target_words - words,
                    RESPONSE_MAX_WORDS - words,
                )
                if head:
                    taken.append(head)
                    self._pieces.appendleft(piece._replace(continued=True, text=rest))
                    break
                if words >= RESPONSE_MIN_WORDS:  # the target is a wish, the minimum is a rule
                    self._pieces.appendleft(piece)
                    break
            taken.append(piece.text)
            words += size
        return doc, continued, "\n\n".join(taken)

    def _pop_fitting(self, module: str, room: int) -> _Piece:
        """Of the next few pieces from ``module``, the first that fits in ``room`` words, else the
        shortest; the next piece when none of them is from ``module``."""
        if not self._pieces:
            raise _PoolExhausted
        window = [
            i
            for i in range(min(self.LOOKAHEAD, len(self._pieces)))
            if self._pieces[i].doc.module == module
        ]
        sizes = {i: _word_count(self._pieces[i].text) for i in window}
        index = next(
            (i for i in window if sizes[i] <= room), min(window, key=sizes.__getitem__, default=0)
        )
        piece = self._pieces[index]
        del self._pieces[index]
        return piece


def _word_count(text: str) -> int:
    return len(text.split())


def _split_at_sentence(
    text: str, min_words: int, want_words: int, max_words: int
) -> tuple[str, str]:
    """(head, rest) cut between sentences: the head within min_words..max_words and as close to
    ``want_words`` as it can be, the rest at least 12 words; ("", "") when there is no such cut."""
    sentences = _SENTENCE_BREAK.split(text)
    total = _word_count(text)
    best_cut, best_distance, words = 0, None, 0
    for cut, sentence in enumerate(sentences[:-1], start=1):
        words += _word_count(sentence)
        distance = abs(words - want_words)
        fits = min_words <= words <= max_words and total - words >= 12
        if fits and (best_distance is None or distance < best_distance):
            best_cut, best_distance = cut, distance
    if not best_cut:
        return "", ""
    return " ".join(sentences[:best_cut]), " ".join(sentences[best_cut:])


def _response_target(rng: random.Random) -> int:
    """Response length in words: log-normal, mostly short, with a tail of long answers."""
    words = rng.lognormvariate(math.log(RESPONSE_MEDIAN_WORDS), RESPONSE_LENGTH_SIGMA)
    # capped below the maximum: joining paragraphs can add a few words past the target
    return max(RESPONSE_MIN_WORDS, min(RESPONSE_MAX_WORDS - 50, round(words)))


# --- Prompts, in each source's own voice ----------------------------------------------------------

_ANNOTATE_PROMPTS = {
    "module": (
        "What is the `{name}` module used for?",
        "Give an overview of what the `{name}` module provides.",
        "Which problems does the `{name}` module solve?",
    ),
    "class": (
        "What is the `{name}` class for?",
        "Explain the purpose of the `{name}` class.",
        "When would I use the `{name}` class from `{module}`?",
    ),
    "function": (
        "What does the `{name}` function do?",
        "Explain how `{name}` behaves and what it returns.",
        "Describe the `{name}` function from `{module}`.",
    ),
    "method": (
        "What does the `{name}` method do?",
        "Explain the behaviour of the `{name}` method.",
        "When is the `{name}` method called, and what does it do?",
    ),
    "continued": (
        "What else does the documentation say about `{name}`?",
        "Can you give more detail on `{name}`?",
        "Tell me more about how `{name}` works.",
    ),
}
_SYNTH_PROMPTS = (
    "Write a concise explanation of `{name}` for a developer who is new to `{top}`.",
    "Explain `{name}` as it would be described in its API reference.",
    "Summarize the documented behaviour of `{name}` in plain English.",
    "Document `{name}` for an internal wiki page about `{module}`.",
    "Describe what `{name}` is responsible for and how it is meant to be used.",
)
_SYNTH_CONTINUED_PROMPTS = (
    "Continue the explanation of `{name}` with further details from its documentation.",
    "Add more detail about `{name}` for an advanced reader.",
)
SYNTH_SYSTEM_PROMPTS = (
    "You are a helpful Python expert.",
    "You are a senior Python developer who explains library APIs clearly and accurately.",
    "You are a technical writer. Answer with precise, well-structured documentation.",
    "You are a patient programming tutor who explains concepts step by step.",
)
_LOGS_PROMPTS = (
    "hey what does {name} do",
    "how do i use {name}?? the docs confuse me",
    "quick question: what is {name} for",
    "can you explain {name} to me",
    "whats the deal with {name} in {module}",
    "explain {name} pls, i keep seeing it in our codebase",
)
_LOGS_CONTINUED_PROMPTS = (
    "ok and what else about {name}",
    "tell me more about {name}",
    "go on, more about {name} please",
)
_SCRAPE_PROMPTS = (
    "How to use {name} in Python?",
    "What exactly does {name} do? The docs are not clear to me.",
    "Question about using {name} in {top}",
    "Trying to understand {name} - can someone explain?",
    "[{top}] What is {name} for and when should I use it?",
)
_SCRAPE_CONTINUED_PROMPTS = (
    "Follow-up: more details on {name}?",
    "Any further details about {name}?",
)
_EVAL_PROMPTS = {
    "stdlib_qa": (
        "In the Python standard library, what does `{name}` do?",
        "According to its documentation, what is `{name}` for?",
    ),
    "doc_summaries": (
        "Summarize the documentation of `{name}` in a few sentences.",
        "Give a short summary of what the docs say about `{name}`.",
    ),
}


def _prompt(source: str, doc: Doc, continued: bool, rng: random.Random) -> str:
    if source == "annotate":
        templates = _ANNOTATE_PROMPTS["continued" if continued else doc.kind]
    elif source == "synth":
        templates = _SYNTH_CONTINUED_PROMPTS if continued else _SYNTH_PROMPTS
    elif source == "logs":
        templates = _LOGS_CONTINUED_PROMPTS if continued else _LOGS_PROMPTS
    else:
        templates = _SCRAPE_CONTINUED_PROMPTS if continued else _SCRAPE_PROMPTS
    text = rng.choice(templates).format(
        name=doc.name, module=doc.module, top=doc.module.split(".")[0]
    )
    return text.lower() if source == "logs" else text


# --- Layout: which line of which file holds what --------------------------------------------------


@dataclass(frozen=True)
class LandingFile:
    source: str
    path: str  # relative to out_dir
    format: str
    lines: int


@dataclass(frozen=True)
class _Slot:
    file: LandingFile
    line: int  # 1-based
    kind: str  # clean | exact_duplicate | near_duplicate | eval_copy | low_quality | malformed
    detail: str | None = None  # the low-quality kind or the malformed reason


SAMPLE_RECORDS = 20_000  # the sample corpus: what make demo lands and the benchmarks measure
MARKOV_FILE_RECORDS = 125_000  # lines per file of a Markov-text corpus: 4 sources make 500,000


def _landing_files(records: int) -> list[LandingFile]:
    """Files in path order (as a landing scanner lists them), ~1/4 of the lines per source."""
    per_source = [
        records // len(SOURCES) + (i < records % len(SOURCES)) for i in range(len(SOURCES))
    ]
    files = []
    for source, lines in zip(SOURCES, per_source, strict=True):
        fmt = SOURCE_FORMATS[source]
        for index in range(FILES_PER_SOURCE):
            share = lines // FILES_PER_SOURCE + (index < lines % FILES_PER_SOURCE)
            files.append(LandingFile(source, f"{source}/{source}-{index:03d}.{fmt}", fmt, share))
    return sorted(files, key=lambda f: f.path)


def _count(rate: float, lines: int) -> int:
    return int(rate * lines + 0.5)


def _injection_counts(files: list[LandingFile]) -> list[dict[str, int]]:
    """Per file, how many lines each defect gets: rate x all lines, spread evenly over files."""
    total = sum(file.lines for file in files)
    counts: list[dict[str, int]] = [{} for _ in files]
    for kind, rate in INJECTION_RATES.items():
        wanted = _count(rate, total)
        for index, file in enumerate(files):
            share = wanted * (index + 1) // len(files) - wanted * index // len(files)
            counts[index][kind] = (
                min(share, _max_malformed(file.lines)) if kind == "malformed" else share
            )
    return counts


def _file_slots(file: LandingFile, counts: dict[str, int], rng: random.Random) -> list[_Slot]:
    """What each line of ``file`` will hold, in a seeded-random order."""
    reasons = PARQUET_MALFORMED_REASONS if file.format == "parquet" else JSON_MALFORMED_REASONS
    kinds = _cycled("malformed", reasons, counts["malformed"], rng)
    kinds += _cycled("low_quality", LOW_QUALITY_KINDS, counts["low_quality"], rng)
    for kind in ("exact_duplicate", "near_duplicate", "eval_copy"):
        kinds += [(kind, None)] * counts[kind]
    kinds += [("clean", None)] * (file.lines - len(kinds))
    rng.shuffle(kinds)
    return [_Slot(file, line, kind, detail) for line, (kind, detail) in enumerate(kinds, start=1)]


def _max_malformed(lines: int) -> int:
    """The most malformed lines a file may hold and stay strictly under MAX_MALFORMED_PERCENT."""
    return max(0, (MAX_MALFORMED_PERCENT * lines - 1) // 100)


def _cycled(
    kind: str, details: tuple[str, ...], count: int, rng: random.Random
) -> list[tuple[str, str | None]]:
    """``count`` slots that go through ``details`` in turn, from a random start."""
    start = rng.randrange(len(details))
    return [(kind, details[(start + i) % len(details)]) for i in range(count)]


def _eval_items_per_set(records: int) -> int:
    return max(20, _count(0.01, records))


# --- Records --------------------------------------------------------------------------------------


@dataclass
class _Record:
    """One landing line before serialisation, and what the manifest says about it."""

    source: str
    id: str
    prompt: object
    response: object
    created_s: int  # seconds after BASE_TIME
    fields: dict  # the source's own fields: meta, session_id, url
    system: str | None = None
    words: int = 0  # response words, for clean records


def _timestamp(seconds: int) -> str:
    """BASE_TIME + seconds as RFC 3339 (a datetime and strftime per record cost ~15 us)."""
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    return f"{_date(days)}T{hours:02d}:{rest // 60:02d}:{rest % 60:02d}Z"


@lru_cache(maxsize=4096)
def _date(days: int) -> str:
    return (BASE_TIME + timedelta(days=days)).strftime("%Y-%m-%d")


class _SourceVoice:
    """Per-source ids, metadata and conversation state."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._next_id = dict.fromkeys(SOURCES, 0)
        self._session: tuple[str, int] = ("", 0)

    def new_id(self, source: str) -> str:
        number = self._next_id[source]
        self._next_id[source] += 1
        return f"{source}-{number:06d}"

    def fields(self, source: str, record_id: str, prompt: str) -> dict:
        rng = self._rng
        if source == "annotate":
            return {
                "meta": {
                    "annotator": f"ann-{rng.randint(1, 24):02d}",
                    "label_confidence": round(rng.uniform(0.6, 1.0), 2),
                }
            }
        if source == "synth":
            return {
                "meta": {
                    "generator": rng.choice(("synth-gen-1", "synth-gen-2", "synth-gen-3")),
                    "temperature": rng.choice((0.2, 0.5, 0.7, 0.9, 1.0)),
                }
            }
        if source == "logs":
            session, turns_left = self._session
            if turns_left == 0:
                session, turns_left = f"sess-{rng.getrandbits(40):010x}", rng.randint(1, 4)
            self._session = (session, turns_left - 1)
            return {"session_id": session}
        slug = "-".join(re.findall(r"[a-z0-9]+", prompt.lower())[:8]) or "question"
        topic = int(record_id.rsplit("-", 1)[1]) + 100_000
        return {"url": f"https://forum.example.org/t/{slug}/{topic}"}

    def record(
        self,
        source: str,
        prompt: object,
        response: object,
        created_s: int,
        system: str | None = None,
    ) -> _Record:
        record_id = self.new_id(source)
        fields = self.fields(source, record_id, prompt if isinstance(prompt, str) else "")
        return _Record(source, record_id, prompt, response, created_s, fields, system)


def _record_object(record: _Record) -> dict:
    obj: dict = {"id": record.id}
    if record.system is not None:
        obj["system"] = record.system
    if "session_id" in record.fields:
        obj["session_id"] = record.fields["session_id"]
    obj["prompt"] = record.prompt
    obj["response"] = record.response
    obj["created_at"] = _timestamp(record.created_s)
    if "meta" in record.fields:
        obj["meta"] = record.fields["meta"]
    if "url" in record.fields:
        obj["url"] = record.fields["url"]
    return obj


# --- Injected defects -----------------------------------------------------------------------------


def word_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = text.split()
    if len(words) < n:
        return {tuple(words)}
    return set(zip(*(words[i:] for i in range(n))))


def shingle_jaccard(a: str, b: str, n: int = 5) -> float:
    """Jaccard similarity of the word n-grams (whitespace tokens, case kept) of two texts."""
    left, right = word_shingles(a, n), word_shingles(b, n)
    return len(left & right) / len(left | right)


_WORD_CHAR = re.compile(r"\w")
_NON_WORD_CHAR = re.compile(r"\W")
_PLAIN_WORD = re.compile(r"\w+")
_FILLER_WORDS = (
    "also", "simply", "actually", "usually", "generally", "really", "just", "typically",
)  # fmt: skip
_SUBSTITUTES = {
    "return": "give", "returns": "gives", "object": "instance", "value": "result",
    "values": "results", "function": "routine", "specified": "given", "list": "sequence",
    "the": "this", "a": "one", "is": "remains", "are": "remain", "be": "become",
    "used": "employed", "new": "fresh",
}  # fmt: skip


def near_duplicate_response(response: str, rng: random.Random) -> tuple[str, float] | None:
    """The response with 1-3 small edits, and its Jaccard with the original (>= 0.85).

    The first edit always changes a word, so no normalization (case, punctuation, whitespace)
    can turn the copy into an exact duplicate of the original.
    """
    most_edits = 1 if _word_count(response) < 130 else (2 if _word_count(response) < 190 else 3)
    for _ in range(8):
        paragraphs = [p.split(" ") for p in response.split("\n\n")]
        for n in range(rng.randint(1, most_edits)):
            words = rng.choice([p for p in paragraphs if len(p) > 3] or paragraphs)
            index = rng.choice([i for i, w in enumerate(words) if _WORD_CHAR.search(w)])
            if n == 0 or rng.random() < 0.5:
                _edit_word(words, index, rng)
            else:
                words[index] = _edit_punctuation_or_case(words[index])
        edited = "\n\n".join(" ".join(p) for p in paragraphs)
        jaccard = shingle_jaccard(response, edited)
        if jaccard >= NEAR_DUPLICATE_MIN_JACCARD and _plain_words(edited) != _plain_words(response):
            return edited, jaccard
        most_edits = 1
    return None


def _edit_word(words: list[str], index: int, rng: random.Random) -> None:
    action = rng.choice(("substitute", "insert", "delete"))
    if action == "insert":
        words.insert(index, rng.choice(_FILLER_WORDS))
    elif action == "delete":
        del words[index]
    else:
        core = _NON_WORD_CHAR.sub("", words[index]).lower()
        words[index] = _SUBSTITUTES.get(core) or rng.choice([w for w in _FILLER_WORDS if w != core])


def _edit_punctuation_or_case(word: str) -> str:
    stripped = word.rstrip(".,;:")
    if stripped != word:
        return stripped
    return word.swapcase() if word.lower() != word.upper() else word + ","


def _plain_words(text: str) -> list[str]:
    return _PLAIN_WORD.findall(text.lower())


_SHORT_REPLIES = (
    "ok", "yes", "no", "idk", "see docs", "thanks!", "not sure", "works for me", "same here",
    "no idea", "it depends", "google it",
)  # fmt: skip
_SPAM_SYMBOLS = (
    "####", "$$$", "!!!", "@@@", "%%%", "***", "&&&", "^^^", "~~~", "<<<", ">>>>", "+++", "???",
    "|||", "///", "===",
)  # fmt: skip
_SPAM_LINES = (
    "Great answer, upvote this post now!",
    "Click the link below for free downloads",
    "Subscribe to my channel for more tips",
    "This is the best answer on the whole forum",
    "DM me for the full solution today",
)


def low_quality_response(kind: str, rng: random.Random) -> str:
    """A response that a quality gate should reject as ``kind``; every one is distinct."""
    if kind == "too_short":
        return rng.choice(_SHORT_REPLIES)
    if kind == "symbol_spam":
        return " ".join(rng.choice(_SPAM_SYMBOLS) for _ in range(rng.randint(20, 40)))
    if kind == "repeated_lines":
        line = f"{rng.choice(_SPAM_LINES)} #{rng.randrange(1000, 10_000)}"
        return "\n".join([line] * rng.randint(10, 16))
    return " ".join(_non_alpha_token(rng) for _ in range(rng.randint(20, 40)))


def _non_alpha_token(rng: random.Random) -> str:
    shape = rng.randrange(4)
    if shape == 0:
        return str(rng.randrange(10**6))
    if shape == 1:
        return f"{rng.random():.4f}"
    if shape == 2:
        return f"{rng.randrange(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return rng.choice(("--", "...", "%", "(", ")", "[", "]", "::", "=>", "#", "+/-", "<>"))


def _malformed_line(record: _Record, reason: str, rng: random.Random) -> bytes:
    """One JSON line that the landing contract rejects with exactly ``reason``."""
    obj = _record_object(record)
    if reason == "invalid_json":
        text = _dumps(obj)
        return text[: rng.randint(len(text) // 4, len(text) * 3 // 4)].encode()
    if reason == "not_an_object":
        return _dumps(
            rng.choice(([record.prompt, record.response], record.prompt, rng.randrange(1, 1000)))
        ).encode()
    if reason == "missing_field:response":
        del obj["response"]
    elif reason == "wrong_type:prompt":
        obj["prompt"] = rng.choice((rng.randrange(1, 10**6), str(record.prompt).split()[:4]))
    elif reason == "empty_field:response":
        obj["response"] = rng.choice(("", "   ", "\n\t "))
    elif reason == "invalid_utf8":
        line = _dumps(obj).encode()
        cut = line.index(b'"prompt": "') + len(b'"prompt": "')
        return line[:cut] + b"\xff\xfe" + line[cut:]
    else:
        raise ValueError(f"unknown malformed reason {reason!r}")
    return _dumps(obj).encode()


def eval_copy_text(prompt: str, response: str, rng: random.Random) -> tuple[str, str]:
    """An eval item as it leaks into training data: verbatim, or with case/whitespace changes."""
    variant = rng.choice(("verbatim", "lowercase", "whitespace"))
    if variant == "lowercase":
        return prompt.lower(), response.lower()
    if variant == "whitespace":
        return f"  {prompt} ", response.replace(". ", ".  ").replace("\n\n", "\n") + "\n"
    return prompt, response


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


# --- Assembling the corpus ------------------------------------------------------------------------


class _OriginalPicker:
    """Earlier clean records that a duplicate may copy; each one is copied at most once."""

    def __init__(self) -> None:
        self._by_source: dict[str, list[_Record]] = {s: [] for s in SOURCES}

    def add(self, record: _Record) -> None:
        self._by_source[record.source].append(record)

    def pick(
        self, rng: random.Random, source: str, other_source_odds: float, min_words: int = 0
    ) -> _Record | None:
        others = [s for s in SOURCES if s != source]
        groups = [others, [source]] if rng.random() < other_source_odds else [[source], others]
        for group in groups:
            for _ in range(60):
                sizes = [len(self._by_source[s]) for s in group]
                if not sum(sizes):
                    break
                candidates = self._by_source[rng.choices(group, weights=sizes)[0]]
                index = rng.randrange(len(candidates))
                if candidates[index].words >= min_words:
                    candidates[index], candidates[-1] = candidates[-1], candidates[index]
                    return candidates.pop()
        return None


def _pick_eval_items(
    docs: list[Doc], per_set: int, rng: random.Random
) -> tuple[dict[str, list[dict]], list[Doc]]:
    """Eval items (stdlib_qa from stdlib docs, doc_summaries from any), and the docs left over."""
    order = list(range(len(docs)))
    rng.shuffle(order)  # items from many modules, not the first few in stream order
    used: set[int] = set()
    eval_sets: dict[str, list[dict]] = {}
    for name in EVAL_SETS:
        items = eval_sets[name] = []
        for index in order:
            doc = docs[index]
            if len(items) == per_set:
                break
            if index in used or (name == "stdlib_qa" and doc.origin != "stdlib"):
                continue
            response = _eval_response(doc, rng.randint(EVAL_RESPONSE_MIN_WORDS, 60))
            if response is None:
                continue
            used.add(index)
            items.append(
                {
                    "eval_set": name,
                    "item_id": f"{name}-{len(items) + 1:04d}",
                    "prompt": rng.choice(_EVAL_PROMPTS[name]).format(name=doc.name),
                    "response": response,
                }
            )
    return eval_sets, [doc for index, doc in enumerate(docs) if index not in used]


def _eval_response(doc: Doc, target_words: int) -> str | None:
    """The doc's first paragraphs, up to about ``target_words``; None if it has too few words."""
    paragraphs, words = [], 0
    for paragraph in doc.paragraphs:
        if words >= target_words:
            break
        paragraphs.append(paragraph)
        words += _word_count(paragraph)
    return "\n\n".join(paragraphs) if words >= EVAL_RESPONSE_MIN_WORDS else None


def _shuffled_by_module(docs: list[Doc], rng: random.Random) -> list[Doc]:
    """Docs in a random module order, each module's docs together so responses stay on topic."""
    modules: dict[tuple[str, str], list[Doc]] = {}
    for doc in docs:
        modules.setdefault((doc.origin, doc.module), []).append(doc)
    groups = list(modules.values())
    rng.shuffle(groups)
    return [doc for group in groups for doc in group]


@dataclass
class _Corpus:
    lines: dict[str, list]  # file path -> JSON line bytes, or Parquet row dicts
    eval_sets: dict[str, list[dict]]
    injected: dict[str, list[dict]]
    clean_ids: list[str]


class _CorpusBuilder:
    """Fills every slot of every file, in path order, and notes what went where."""

    def __init__(self, records: int, seed: int, docs: list[Doc]):
        rng = self._rng = random.Random(seed)
        self.files = _landing_files(records)
        counts = _injection_counts(self.files)
        self._slots = [
            slot
            for file, n in zip(self.files, counts, strict=True)
            for slot in _file_slots(file, n, rng)
        ]
        eval_sets, stream_docs = _pick_eval_items(
            _shuffled_by_module(docs, rng), _eval_items_per_set(records), rng
        )
        self._eval_items = [item for items in eval_sets.values() for item in items]
        rng.shuffle(self._eval_items)
        self._stream = _TextStream(stream_docs)
        self._voice = _SourceVoice(rng)
        self._originals = _OriginalPicker()
        self._deferred: deque[str] = deque()  # duplicates that had no earlier record to copy yet
        self._injections = {
            "exact_duplicate": self._exact_duplicate,
            "near_duplicate": self._near_duplicate,
            "eval_copy": self._eval_copy,
            "low_quality": self._low_quality,
        }
        self.corpus = _Corpus(
            lines={file.path: [] for file in self.files},
            eval_sets=eval_sets,
            injected={kind: [] for kind in INJECTION_RATES},
            clean_ids=[],
        )

    def build(self) -> _Corpus:
        for slot in self._slots:
            self._fill(slot)
        return self.corpus

    def _fill(self, slot: _Slot) -> None:
        kind = slot.kind
        if kind == "clean" and self._deferred:
            kind = self._deferred.popleft()
        if kind == "malformed":
            self._add_malformed(slot)
            return
        made = self._injections[kind](slot) if kind in self._injections else None
        if made is None:  # a clean slot, or a duplicate with nothing to copy yet
            if kind in ("exact_duplicate", "near_duplicate"):
                self._deferred.append(kind)
            record = self._clean_record(slot.file.source)
            self.corpus.clean_ids.append(record.id)
            self._originals.add(record)
        else:
            record, facts = made
            where = {"file": slot.file.path, "line": slot.line}
            entry = {"id": record.id, "source": record.source, **where, **facts}
            self.corpus.injected[kind].append(entry)
        obj = _record_object(record)
        is_parquet = slot.file.format == "parquet"
        self.corpus.lines[slot.file.path].append(obj if is_parquet else _dumps(obj).encode())

    def _clean_record(self, source: str, target_words: int | None = None) -> _Record:
        rng = self._rng
        doc, continued, response = self._stream.take(target_words or _response_target(rng))
        prompt = _prompt(source, doc, continued, rng)
        system = rng.choice(SYNTH_SYSTEM_PROMPTS) if source == "synth" else None
        record = self._voice.record(source, prompt, response, rng.randrange(TIME_SPREAD_S), system)
        record.words = _word_count(response)
        return record

    def _exact_duplicate(self, slot: _Slot) -> tuple[_Record, dict] | None:
        original = self._originals.pick(self._rng, slot.file.source, other_source_odds=2 / 3)
        if original is None:
            return None
        return self._copy_of(original, slot, original.response), {"duplicate_of": original.id}

    def _near_duplicate(self, slot: _Slot) -> tuple[_Record, dict] | None:
        original = self._originals.pick(
            self._rng, slot.file.source, other_source_odds=0.5, min_words=NEAR_DUPLICATE_MIN_WORDS
        )
        edit = near_duplicate_response(original.response, self._rng) if original else None
        if edit is None:
            return None
        response, jaccard = edit
        facts = {"duplicate_of": original.id, "jaccard": round(jaccard, 4)}
        return self._copy_of(original, slot, response), facts

    def _copy_of(self, original: _Record, slot: _Slot, response: str) -> _Record:
        """A later record with the original's prompt (and system) and ``response``."""
        later = original.created_s + self._rng.randint(600, 3 * 86_400)
        return self._voice.record(
            slot.file.source, original.prompt, response, later, original.system
        )

    def _eval_copy(self, slot: _Slot) -> tuple[_Record, dict] | None:
        if not self._eval_items:
            return None
        item = self._eval_items.pop()
        prompt, response = eval_copy_text(item["prompt"], item["response"], self._rng)
        created = self._rng.randrange(TIME_SPREAD_S)
        record = self._voice.record(slot.file.source, prompt, response, created)
        return record, {"eval_set": item["eval_set"], "item_id": item["item_id"]}

    def _low_quality(self, slot: _Slot) -> tuple[_Record, dict]:
        rng = self._rng
        doc, continued = self._stream.next_subject()  # a real question, a useless answer
        prompt = _prompt(slot.file.source, doc, continued, rng)
        response = low_quality_response(slot.detail, rng)
        record = self._voice.record(
            slot.file.source, prompt, response, rng.randrange(TIME_SPREAD_S)
        )
        return record, {"kind": slot.detail}

    def _add_malformed(self, slot: _Slot) -> None:
        record = self._clean_record(slot.file.source, target_words=12)  # quarantined: any text
        if slot.file.format == "parquet":
            unit = _record_object(record)
            if slot.detail == "missing_field:response":
                unit["response"] = None
            else:  # empty_field:prompt
                unit["prompt"] = self._rng.choice(("   ", "\t", " \n "))
        else:
            unit = _malformed_line(record, slot.detail, self._rng)
        self.corpus.lines[slot.file.path].append(unit)
        entry = {"source": slot.file.source, "file": slot.file.path, "line": slot.line}
        self.corpus.injected["malformed"].append({**entry, "reason": slot.detail})


# --- Writing --------------------------------------------------------------------------------------

_PARQUET_COLUMNS = ("id", "prompt", "response", "created_at", "url")


def _encode_file(fmt: str, lines: list) -> bytes:
    if fmt == "parquet":
        frame = pl.DataFrame(
            {c: [row[c] for row in lines] for c in _PARQUET_COLUMNS},
            schema=dict.fromkeys(_PARQUET_COLUMNS, pl.String),
        )
        buffer = io.BytesIO()
        frame.write_parquet(buffer, compression="zstd", statistics=False)
        return buffer.getvalue()
    text = b"\n".join(lines) + b"\n"
    if fmt == "jsonl.gz":
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="", compresslevel=6) as gz:
            gz.write(text)
        return buffer.getvalue()
    if fmt == "jsonl.zst":
        return zstandard.ZstdCompressor(level=3).compress(text)
    return text


def _write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _needed_words(records: int) -> int:
    """Words of unique text a corpus of ``records`` lines uses, with a small margin.

    Measured: a clean response averages about 61 words. Duplicates, eval copies and low-quality
    records use no new text.
    """
    reused = sum(rate for kind, rate in INJECTION_RATES.items() if kind != "malformed")
    eval_words = len(EVAL_SETS) * _eval_items_per_set(records) * 55
    return int(1.04 * (records * (1 - reused) * 61 + eval_words))


def write_sample_corpus(
    out_dir: Path,
    records: int = SAMPLE_RECORDS,
    eval_sets_dir: Path | None = None,
    seed: int = 20261121,
) -> dict:
    """Writes the landing files under out_dir/<source>/..., the eval sets under eval_sets_dir
    (default out_dir/'_eval_sets'), and the manifest out_dir/'_sample_manifest.json'.
    Returns the manifest dict.

    Every clean record and eval item uses text that nothing else uses, so the size is bounded by
    the prose in the installed docstrings: about 23,000 records on this project's dependencies.
    A larger ``records`` raises RuntimeError.
    """
    if records < len(SOURCES) * FILES_PER_SOURCE:
        raise ValueError(
            f"records must be at least {len(SOURCES) * FILES_PER_SOURCE}, got {records}"
        )
    out_dir = Path(out_dir)
    eval_sets_dir = Path(eval_sets_dir) if eval_sets_dir is not None else out_dir / "_eval_sets"

    needed = _needed_words(records)
    while True:  # should the estimate fall short, read more packages and start again
        try:
            docs = _doc_pool().docs_with_words(needed)
            corpus = _CorpusBuilder(records, seed, docs).build()
            break
        except _PoolExhausted:
            needed = int(needed * 1.1)

    manifest_files = []
    for file in _landing_files(records):
        sha256 = _write(out_dir / file.path, _encode_file(file.format, corpus.lines[file.path]))
        manifest_files.append(
            {
                "path": file.path,
                "source": file.source,
                "format": file.format,
                "lines": file.lines,
                "sha256": sha256,
            }
        )
    manifest_eval_sets = []
    for name, items in corpus.eval_sets.items():
        data = b"".join(_dumps(item).encode() + b"\n" for item in items)
        sha256 = _write(eval_sets_dir / f"{name}.jsonl", data)
        manifest_eval_sets.append({"path": f"{name}.jsonl", "items": len(items), "sha256": sha256})

    malformed = len(corpus.injected["malformed"])
    manifest = {
        "seed": seed,
        "records": records,
        "sources": list(SOURCES),
        "files": manifest_files,
        "eval_sets": manifest_eval_sets,
        "injected": corpus.injected,
        "clean_ids": corpus.clean_ids,
        "expected": {
            "lines": records,
            "quarantined": malformed,
            "bronze_rows": records - malformed,
        },
    }
    _write(
        out_dir / MANIFEST_NAME,
        (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode(),
    )
    return manifest
