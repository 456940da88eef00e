"""Decontamination: which records share text with an eval item, and what is reported about it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.silver import decontam
from pipeline_assets.lib.silver.decontam import (
    DecontamConfig,
    EvalItems,
    EvalNgramIndex,
    find_contamination,
    read_eval_sets,
    text_words,
)
from pipeline_assets.lib.silver.normalize import normalize_records
from pipeline_assets.sample_data.corpus import write_sample_corpus

# 21 words: 9 windows of 13 words, no two alike.
EVAL_RESPONSE = (
    "The quick brown fox jumps over the lazy dog while seven purple owls quietly "
    "debate ancient riddles beneath silver moonlight tonight."
)
EVAL_WORDS = EVAL_RESPONSE.lower().rstrip(".").split()
FILLER = "Here is some unrelated text first, and"


def eval_items(*rows: tuple[str, str, str, str]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=list(decontam.EVAL_COLUMNS), orient="row")


def records(*rows: tuple[str, str], **extra_columns: list) -> pl.DataFrame:
    frame = pl.DataFrame(
        {
            "record_id": [f"r{i}" for i in range(len(rows))],
            "prompt": [p for p, _ in rows],
            "response": [r for _, r in rows],
        }
    )
    return frame.with_columns(pl.Series(name, values) for name, values in extra_columns.items())


@pytest.fixture(scope="module")
def index() -> EvalNgramIndex:
    return EvalNgramIndex.build(
        eval_items(
            ("qa", "qa-1", "Tell me a story about animals at night.", EVAL_RESPONSE),
            ("summ", "summ-7", "Describe the standard library module for reading zip archives "
                               "briefly please.",
             "Completely different words appear here so that nothing overlaps with the fox "
             "story at all."),
        )
    )  # fmt: skip


def rejected_one(index: EvalNgramIndex, prompt: str, response: str) -> dict | None:
    kept, rejected, _ = find_contamination(records((prompt, response)), index)
    assert kept.height + rejected.height == 1
    return rejected.row(0, named=True) if rejected.height else None


# --- words ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("The item.", ["the", "item"]),
        ('"Quoted," (bracketed) `os.path.join`!', ["quoted", "bracketed", "os.path.join"]),
        ("a - b ... c", ["a", "b", "c"]),  # all-punctuation words are dropped
        ("don't stop: e.g. 3.14%", ["don't", "stop", "e.g", "3.14"]),  # inner punctuation stays
        ("line one\nline\ttwo", ["line", "one", "line", "two"]),
        ("STRASSE Straße", ["strasse", "strasse"]),  # casefold, not just lower
        ("", []),
        (None, []),
    ],
)
def test_text_words(text, words):
    assert text_words(text) == words


def test_text_words_keeps_case_when_asked():
    assert text_words("The Item.", lowercase=False) == ["The", "Item"]


# --- matching -------------------------------------------------------------------------------------


def test_a_13_word_span_is_caught_with_its_item_and_ngram(index):
    span = " ".join(EVAL_WORDS[3:16])
    row = rejected_one(index, "What is this?", f"{FILLER} {span} and more words after.")
    assert row is not None
    assert (row["eval_set"], row["eval_item_id"]) == ("qa", "qa-1")
    assert row["matched_ngram"] == span
    assert json.loads(row["evidence"]) == {
        "eval_set": "qa", "item_id": "qa-1", "ngram": span, "field": "response",
    }  # fmt: skip


def test_a_12_word_overlap_is_not_caught(index):
    span = " ".join(EVAL_WORDS[3:15])
    assert rejected_one(index, "What is this?", f"{FILLER} {span} and more words after.") is None


def test_case_and_punctuation_differences_still_match(index):
    changed = " ".join(
        f'"{w.upper()}",' if i % 2 else f"({w.title()})." for i, w in enumerate(EVAL_WORDS[:13])
    )
    row = rejected_one(index, "What is this?", changed)
    assert row is not None and row["matched_ngram"] == " ".join(EVAL_WORDS[:13])


def test_case_matters_when_lowercase_is_off():
    strict = EvalNgramIndex.build(eval_items(("qa", "qa-1", "A prompt here.", EVAL_RESPONSE)),
                                  DecontamConfig(lowercase=False))  # fmt: skip
    assert rejected_one(strict, "x", EVAL_RESPONSE.upper()) is None
    assert rejected_one(strict, "x", EVAL_RESPONSE) is not None


def test_a_short_item_is_caught_whole_but_not_in_part(index):
    # The summ prompt has 11 words (< 13): contained anywhere, it is caught as one gram.
    prompt = (
        "Please: describe the standard library module for reading ZIP archives briefly, please!"
    )
    row = rejected_one(index, prompt, "An answer.")
    assert row is not None
    assert (row["eval_set"], row["eval_item_id"]) == ("summ", "summ-7")
    assert json.loads(row["evidence"])["field"] == "prompt"
    partial = "Describe the standard library module for reading zip archives."  # 9 of its 11 words
    assert rejected_one(index, partial, "An answer.") is None


def test_a_very_short_item_matches_only_a_whole_field():
    tiny = EvalNgramIndex.build(eval_items(("qa", "qa-2", "Capital of France?", "Paris.")))
    assert rejected_one(tiny, "capital of france", "Some answer.") is not None
    assert rejected_one(tiny, "What is the capital of France?", "I think it is Paris.") is None
    row = rejected_one(tiny, "Where?", "PARIS")
    assert row is not None and row["matched_ngram"] == "paris"


def test_the_first_match_is_reported_first_field_then_first_position():
    second = EVAL_WORDS[5:18]
    both = EvalNgramIndex.build(
        eval_items(
            ("b_set", "b-1", "Unrelated prompt words for the first item here.", " ".join(second)),
            ("a_set", "a-1", "Another unrelated prompt for the second item.", EVAL_RESPONSE),
        )
    )
    # The response holds a-1's words 0..12 and, overlapping, b-1's; the earlier position wins.
    row = rejected_one(both, "Nothing here.", EVAL_RESPONSE)
    assert row["eval_item_id"] == "a-1" and row["matched_ngram"] == " ".join(EVAL_WORDS[:13])
    # In the prompt, b-1's text comes first in config order, even though a-1's is in the response.
    row = rejected_one(both, " ".join(second), EVAL_RESPONSE)
    assert (row["eval_item_id"], json.loads(row["evidence"])["field"]) == ("b-1", "prompt")


def test_only_the_configured_fields_are_checked():
    items = eval_items(("s", "1", "A prompt of several words here.", EVAL_RESPONSE))
    response_only = EvalNgramIndex.build(items, DecontamConfig(fields=("response",)))
    assert rejected_one(response_only, EVAL_RESPONSE, "A clean answer.") is None
    assert rejected_one(response_only, "A clean question?", EVAL_RESPONSE) is not None


def test_a_gram_shared_by_two_items_reports_the_first_item():
    shared = EvalNgramIndex.build(
        eval_items(("s", "first", "p one", EVAL_RESPONSE), ("s", "second", "p two", EVAL_RESPONSE))
    )
    assert len(shared) == len(EVAL_WORDS) - 13 + 1 + 2  # each window once, plus the two prompts
    assert rejected_one(shared, "x", EVAL_RESPONSE)["eval_item_id"] == "first"


def test_a_hash_collision_never_flags_a_record(monkeypatch):
    # Every window hashes to 0: every record hits the table, and only equal words may count.
    monkeypatch.setattr(
        decontam, "_window_hashes", lambda words, size: (0 for _ in words[size - 1 :])
    )
    colliding = EvalNgramIndex.build(
        eval_items(("qa", "qa-1", "Tell me a story about animals.", EVAL_RESPONSE))
    )
    clean = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."
    assert rejected_one(colliding, "Nothing to see here.", clean) is None
    row = rejected_one(colliding, "Nothing to see here.", f"{FILLER} {EVAL_RESPONSE}")
    assert row is not None and row["matched_ngram"] == " ".join(EVAL_WORDS[:13])


# --- frames and details ---------------------------------------------------------------------------


def test_order_columns_and_details(index):
    hit = " ".join(EVAL_WORDS[:13])
    frame = records(
        ("clean prompt one", "clean response one"),
        ("dirty prompt", hit),
        ("clean prompt two", "clean response two"),
        ("Describe the standard library module for reading zip archives briefly please.", "x"),
        ("clean prompt three", None),
        source=["a", "b", "c", "d", "e"],
        extra_number=[1, 2, 3, 4, 5],
    )
    kept, rejected, details = find_contamination(frame, index)
    assert kept.columns == frame.columns
    assert kept["record_id"].to_list() == ["r0", "r2", "r4"]
    assert kept.equals(frame.filter(pl.col("record_id").is_in(["r0", "r2", "r4"])))
    assert rejected.columns == [*frame.columns, *decontam.EVIDENCE_COLUMNS]
    assert rejected["record_id"].to_list() == ["r1", "r3"]
    assert rejected.select(frame.columns).equals(
        frame.filter(pl.col("record_id").is_in(["r1", "r3"]))
    )
    assert rejected["eval_set"].to_list() == ["qa", "summ"]
    assert details == {"rejected_by_eval_set": {"qa": 1, "summ": 1}}


def test_empty_records_and_empty_eval_sets(index, tmp_path):
    empty = records().cast({"prompt": pl.String, "response": pl.String})
    kept, rejected, details = find_contamination(empty, index)
    assert kept.height == rejected.height == 0
    assert rejected.columns == [*empty.columns, *decontam.EVIDENCE_COLUMNS]
    assert details == {"rejected_by_eval_set": {"qa": 0, "summ": 0}}

    no_evals = EvalNgramIndex.build(read_eval_sets(tmp_path))
    assert len(no_evals) == 0
    kept, rejected, details = find_contamination(records(("p", EVAL_RESPONSE)), no_evals)
    assert (kept.height, rejected.height, details["rejected_by_eval_set"]) == (1, 0, {})


def test_missing_record_column_is_an_error(index):
    with pytest.raises(ValueError, match="response"):
        find_contamination(pl.DataFrame({"record_id": ["r0"], "prompt": ["p"]}), index)


# --- eval set files -------------------------------------------------------------------------------


def test_read_eval_sets_reads_every_jsonl_file_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"eval_set": "b", "item_id": "b-1", "prompt": "p", "response": "r"}) + "\n\n"
    )
    (tmp_path / "a.jsonl").write_text("".join(
        json.dumps({"eval_set": "a", "item_id": f"a-{i}", "prompt": "p", "response": "r",
                    "extra": 1}) + "\n"
        for i in (1, 2)
    ))  # fmt: skip
    (tmp_path / "notes.txt").write_text("not an eval set")
    frame = read_eval_sets(tmp_path)
    assert frame.columns == list(decontam.EVAL_COLUMNS)
    assert frame["item_id"].to_list() == ["a-1", "a-2", "b-1"]


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            '{"eval_set": "s", "item_id": "2", "prompt": "p"}',
            "field 'response' must be a string \\(missing\\)",
        ),
        (
            '{"eval_set": "s", "item_id": 2, "prompt": "p", "response": "r"}',
            "field 'item_id' must be a string \\(int\\)",
        ),
    ],
)
def test_read_eval_sets_names_the_file_and_line_of_a_bad_line(tmp_path, bad_line, reason):
    good = json.dumps({"eval_set": "s", "item_id": "1", "prompt": "p", "response": "r"})
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n")
    with pytest.raises(ValueError, match=f"broken.jsonl: line 3: {reason}"):
        read_eval_sets(tmp_path)


def test_read_eval_sets_needs_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_eval_sets(tmp_path / "missing")


# --- the sample corpus ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    out = tmp_path_factory.mktemp("sample")
    manifest = write_sample_corpus(out, records=4000, eval_sets_dir=out / "_eval_sets")
    frames = [
        read_landing_file(Path(f["path"]).name, (out / f["path"]).read_bytes()).records
        for f in manifest["files"]
    ]
    frame, _, _ = normalize_records(pl.concat(frames))
    return frame.rename({"id": "record_id"}), read_eval_sets(out / "_eval_sets"), manifest


@pytest.mark.parametrize("fields", [("prompt", "response"), ("response",)])
def test_sample_corpus_eval_copies_are_caught_and_clean_records_are_not(sample, fields):
    frame, evals, manifest = sample
    kept, rejected, details = find_contamination(
        frame, EvalNgramIndex.build(evals, DecontamConfig(fields=fields))
    )
    found = {
        r["record_id"]: (r["eval_set"], r["eval_item_id"]) for r in rejected.iter_rows(named=True)
    }
    copies = {e["id"]: (e["eval_set"], e["item_id"]) for e in manifest["injected"]["eval_copy"]}
    assert len(copies) >= 30
    caught = [record_id for record_id, item in copies.items() if found.get(record_id) == item]
    assert len(caught) / len(copies) >= 0.95
    assert not set(found) & set(manifest["clean_ids"])
    assert frame.height == kept.height + rejected.height
    assert sum(details["rejected_by_eval_set"].values()) == rejected.height


_MATCH_IN_ANOTHER_PROCESS = """
import pickle, sys
from pipeline_assets.lib.silver.decontam import find_contamination
index, records = pickle.loads(sys.stdin.buffer.read())
_, rejected, _ = find_contamination(records, index)
print(",".join(rejected["record_id"].to_list()))
"""


def test_an_index_sent_to_another_process_finds_what_it_finds_here():
    """Ray's workers get the index pickled, in processes whose str hashes differ from the step's."""
    index = EvalNgramIndex.build(
        eval_items(("bench", "i1", "Summarize this.", EVAL_RESPONSE), ("bench", "i2", "Q", "Paris"))
    )
    batch = records(
        ("Tell me a story.", f"{FILLER} {EVAL_RESPONSE}"),
        ("Capital of France?", "Paris"),
        ("Tell me a story.", "Nothing from any benchmark here at all, just words."),
    )
    here = find_contamination(batch, index)[1]["record_id"].to_list()
    seed = str(int(os.environ.get("PYTHONHASHSEED", "0") or 0) + 1)
    there = subprocess.run(
        [sys.executable, "-c", _MATCH_IN_ANOTHER_PROCESS],
        input=pickle.dumps((index, batch)),
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": seed},
    )
    assert here == ["r0", "r1"]
    assert there.stdout.decode().strip().split(",") == here


def test_eval_items_are_indexed_once_a_version_in_a_process(monkeypatch):
    """What silver's prepare tasks are given: each process builds the index of a version of the
    items once, and a share with no record gets the eval sets' names without a build."""
    words = "the quick brown fox jumps over the lazy dog near the old river bank today"
    items = pl.DataFrame(
        {"eval_set": ["qa", "math"], "item_id": ["q1", "m1"], "prompt": [words, "2 + 2"]}
    ).with_columns(response=pl.lit("an answer"))
    built = []
    build = EvalNgramIndex.build.__func__
    monkeypatch.setattr(
        EvalNgramIndex, "build", classmethod(lambda cls, *a: built.append(a) or build(cls, *a))
    )
    first = EvalItems(items, DecontamConfig(), "v1")
    index = first.index()
    assert EvalItems(items, DecontamConfig(), "v1").index() is index and len(built) == 1
    assert index.first_match([f"so {words} it said", "x"]).item_id == "q1"
    assert EvalItems(items, DecontamConfig(), "v2").index() is not index and len(built) == 2
    names = first.names_only()
    assert names.eval_sets == ("math", "qa") and len(names) == 0 and len(built) == 2
