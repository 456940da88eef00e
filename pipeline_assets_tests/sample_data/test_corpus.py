"""The sample corpus: deterministic bytes, the promised shape, and every injected defect as stated.

The checks here read the files back with plain json / gzip / zstandard / polars, independently of
the pipeline's readers, so a defect that is not really there (or a clean line that is not clean)
fails here rather than in a layer test downstream.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
import zstandard
from datasketch import MinHash, MinHashLSH

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.silver.curation import SilverConfig, curate
from pipeline_assets.lib.silver.decontam import EvalNgramIndex, read_eval_sets
from pipeline_assets.sample_data.corpus import (
    RESPONSE_MAX_WORDS,
    RESPONSE_MIN_WORDS,
    SOURCES,
    write_sample_corpus,
)
from pipeline_assets.sample_data.markov_corpus import write_markov_corpus

RECORDS = 3000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("landing")
    return out, write_sample_corpus(out, records=RECORDS)


@pytest.fixture(scope="module")
def lines(corpus) -> dict[str, list]:
    """file path -> its lines (bytes, for JSON lines) or rows (dicts, for Parquet), in order."""
    out, manifest = corpus
    return {entry["path"]: read_units(out, entry) for entry in manifest["files"]}


@pytest.fixture(scope="module")
def records(corpus, lines) -> dict[str, dict]:
    """id -> every record that passes the landing contract, with where it is."""
    _, manifest = corpus
    malformed = {(e["file"], e["line"]) for e in manifest["injected"]["malformed"]}
    found = {}
    for entry in manifest["files"]:
        for number, unit in enumerate(lines[entry["path"]], start=1):
            if (entry["path"], number) not in malformed:
                obj = unit if isinstance(unit, dict) else json.loads(unit)
                found[obj["id"]] = {
                    **obj,
                    "_source": entry["source"],
                    "_where": (entry["path"], number),
                }
    return found


def read_units(out: Path, entry: dict) -> list:
    data = (out / entry["path"]).read_bytes()
    if entry["format"] == "parquet":
        return pl.read_parquet(io.BytesIO(data)).to_dicts()
    if entry["format"] == "jsonl.gz":
        data = gzip.decompress(data)
    elif entry["format"] == "jsonl.zst":
        data = zstandard.ZstdDecompressor().decompress(data)
    assert data.endswith(b"\n"), entry["path"]
    return data[:-1].split(b"\n")


def contract_violation(unit: bytes | dict) -> str | None:
    """The landing-contract reason code for one line or row, or None when it is a valid record."""
    if isinstance(unit, bytes):
        try:
            text = unit.decode("utf-8")
        except UnicodeDecodeError:
            return "invalid_utf8"
        try:
            unit = json.loads(text)
        except json.JSONDecodeError:
            return "invalid_json"
        if not isinstance(unit, dict):
            return "not_an_object"
    for field in ("prompt", "response"):
        value = unit.get(field)
        if value is None:
            return f"missing_field:{field}"
        if not isinstance(value, str):
            return f"wrong_type:{field}"
        if not value.strip():
            return f"empty_field:{field}"
    return None


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: str, b: str) -> float:
    left, right = shingles(a), shingles(b)
    return len(left & right) / len(left | right)


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


# --- Determinism ----------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path):
    first = write_sample_corpus(tmp_path / "a", records=1200)
    second = write_sample_corpus(tmp_path / "b", records=1200)
    other = write_sample_corpus(tmp_path / "c", records=1200, seed=7)

    digests = file_digests(tmp_path / "a")
    assert len(digests) == 8 + 2 + 1  # landing files, eval sets, manifest
    assert digests == file_digests(tmp_path / "b")
    assert first == second
    other_digests = file_digests(tmp_path / "c")
    assert digests.keys() == other_digests.keys()
    assert all(digests[path] != other_digests[path] for path in digests)
    assert other["seed"] == 7


def test_bytes_do_not_depend_on_the_process_or_its_hash_seed(tmp_path):
    script = (
        "import sys; from pathlib import Path; "
        "from pipeline_assets.sample_data.corpus import write_sample_corpus; "
        "write_sample_corpus(Path(sys.argv[1]), records=1200)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "fresh")], check=True, env=env, timeout=120
    )
    write_sample_corpus(tmp_path / "here", records=1200)
    assert file_digests(tmp_path / "fresh") == file_digests(tmp_path / "here")


def test_gzip_header_has_no_time_or_file_name(corpus):
    out, manifest = corpus
    for entry in manifest["files"]:
        if entry["format"] == "jsonl.gz":
            header = (out / entry["path"]).read_bytes()[:10]
            assert header[4:8] == b"\0\0\0\0"  # mtime
            assert not header[3] & 0x08  # FNAME flag


# --- Shape ----------------------------------------------------------------------------------------


def test_line_counts_sources_formats_and_checksums(corpus, lines):
    out, manifest = corpus
    files = manifest["files"]
    assert sum(entry["lines"] for entry in files) == RECORDS == manifest["records"]
    assert sum(len(lines[entry["path"]]) for entry in files) == RECORDS
    assert manifest["sources"] == list(SOURCES)
    assert {entry["format"] for entry in files} == {"jsonl", "jsonl.gz", "jsonl.zst", "parquet"}
    for source in SOURCES:
        own = [entry for entry in files if entry["source"] == source]
        assert len(own) == 2
        assert all(entry["path"].startswith(f"{source}/") for entry in own)
        assert abs(sum(entry["lines"] for entry in own) - RECORDS / 4) <= 1
        assert abs(own[0]["lines"] - own[1]["lines"]) <= 1
    for entry in files:
        assert len(lines[entry["path"]]) == entry["lines"]
        assert hashlib.sha256((out / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
        if entry["format"] != "parquet":
            assert all(line.strip() for line in lines[entry["path"]]), "blank line"
    assert json.loads((out / "_sample_manifest.json").read_text()) == manifest
    malformed = len(manifest["injected"]["malformed"])
    assert manifest["expected"] == {
        "lines": RECORDS,
        "quarantined": malformed,
        "bronze_rows": RECORDS - malformed,
    }


def test_every_valid_record_has_a_unique_id_and_the_manifest_ids_exist(corpus, records):
    _, manifest = corpus
    malformed = len(manifest["injected"]["malformed"])
    assert len(records) == RECORDS - malformed  # ids are unique, or records would collapse
    injected_ids = [
        e["id"]
        for kind, entries in manifest["injected"].items()
        if kind != "malformed"
        for e in entries
    ]
    assert len(set(injected_ids)) == len(injected_ids)
    assert set(manifest["clean_ids"]).isdisjoint(injected_ids)
    assert set(manifest["clean_ids"]) | set(injected_ids) == set(records)
    for kind, entries in manifest["injected"].items():
        for entry in entries:
            if kind != "malformed":
                record = records[entry["id"]]
                assert record["_where"] == (entry["file"], entry["line"])
                assert record["_source"] == entry["source"]


def test_clean_records_have_the_promised_lengths_and_each_source_its_style(corpus, records):
    _, manifest = corpus
    lengths = [len(records[record_id]["response"].split()) for record_id in manifest["clean_ids"]]
    assert sum(n < 30 for n in lengths) / len(lengths) >= 0.2, "many short answers"
    assert sum(n > 100 for n in lengths) / len(lengths) >= 0.03, "a tail of long ones"
    for record_id in manifest["clean_ids"]:
        record = records[record_id]
        assert RESPONSE_MIN_WORDS <= len(record["response"].split()) <= RESPONSE_MAX_WORDS, (
            record_id
        )
        assert 5 <= len(record["prompt"].split()) <= 60, record_id
        assert datetime.fromisoformat(record["created_at"]).utcoffset().total_seconds() == 0
        assert record["created_at"].endswith("Z")
        source = record["_source"]
        assert record_id.startswith(f"{source}-")
        if source == "annotate":
            assert set(record["meta"]) == {"annotator", "label_confidence"}
        elif source == "synth":
            assert record["system"] and set(record["meta"]) == {"generator", "temperature"}
        elif source == "logs":
            assert record["session_id"].startswith("sess-")
            assert record["prompt"] == record["prompt"].lower()
        else:
            assert record["url"].startswith("https://")


# --- Malformed lines ------------------------------------------------------------------------------


def test_malformed_lines_break_the_contract_exactly_as_stated_and_nothing_else_does(corpus, lines):
    _, manifest = corpus
    stated = {(e["file"], e["line"]): e["reason"] for e in manifest["injected"]["malformed"]}
    for entry in manifest["files"]:
        for number, unit in enumerate(lines[entry["path"]], start=1):
            assert contract_violation(unit) == stated.get((entry["path"], number)), (
                entry["path"],
                number,
            )
    reasons = Counter(stated.values())
    json_reasons = {"invalid_json", "not_an_object", "missing_field:response", "wrong_type:prompt",
                    "empty_field:response", "invalid_utf8"}  # fmt: skip
    assert json_reasons | {"empty_field:prompt"} == set(reasons)
    parquet_reasons = {
        e["reason"] for e in manifest["injected"]["malformed"] if e["file"].endswith(".parquet")
    }
    assert parquet_reasons == {"missing_field:response", "empty_field:prompt"}


def test_invalid_utf8_lines_are_json_but_for_their_bytes(corpus, lines):
    _, manifest = corpus
    for entry in manifest["injected"]["malformed"]:
        if entry["reason"] == "invalid_utf8":
            line = lines[entry["file"]][entry["line"] - 1]
            assert isinstance(json.loads(line.decode("utf-8", errors="ignore")), dict)


@pytest.mark.parametrize("records", [RECORDS, 101, 8])
def test_malformed_share_stays_below_three_percent_in_every_file(tmp_path, corpus, records):
    manifest = corpus[1] if records == RECORDS else write_sample_corpus(tmp_path, records=records)
    per_file = Counter(e["file"] for e in manifest["injected"]["malformed"])
    assert sum(entry["lines"] for entry in manifest["files"]) == records
    for entry in manifest["files"]:
        assert per_file[entry["path"]] < 0.03 * entry["lines"]
        if records == RECORDS:  # large enough for ~1% of each file
            assert per_file[entry["path"]] >= 1


def test_too_few_records_for_eight_files_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        write_sample_corpus(tmp_path, records=7)


# --- Duplicates and near duplicates ---------------------------------------------------------------


def test_no_two_clean_records_are_near_duplicates(corpus, records):
    _, manifest = corpus
    lsh = MinHashLSH(threshold=0.8, num_perm=128)
    signatures = {}
    for record_id in manifest["clean_ids"]:
        record = records[record_id]
        signature = MinHash(num_perm=128)
        text = f"{record['prompt']}\n{record['response']}".lower()
        signature.update_batch([" ".join(gram).encode() for gram in shingles(text)])
        lsh.insert(record_id, signature)
        signatures[record_id] = signature
    pairs = {
        tuple(sorted((record_id, other)))
        for record_id, signature in signatures.items()
        for other in lsh.query(signature)
        if other != record_id
    }
    assert not pairs, [(a, b, signatures[a].jaccard(signatures[b])) for a, b in sorted(pairs)[:5]]


def test_near_duplicates_are_close_to_their_original_but_not_equal(corpus, records):
    _, manifest = corpus
    entries = manifest["injected"]["near_duplicate"]
    assert len(entries) >= 0.025 * RECORDS
    clean = set(manifest["clean_ids"])
    for entry in entries:
        copy, original = records[entry["id"]], records[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean
        assert original["_where"] < copy["_where"] and original["created_at"] < copy["created_at"]
        assert copy["prompt"] == original["prompt"] and copy.get("system") == original.get("system")
        similarity = jaccard(original["response"], copy["response"])
        assert similarity >= 0.85, entry
        assert similarity == pytest.approx(entry["jaccard"], abs=1e-4)
        # at least one word changed, so no normalization turns it into an exact duplicate
        assert re.findall(r"\w+", copy["response"].lower()) != re.findall(
            r"\w+", original["response"].lower()
        )


def test_exact_duplicates_copy_an_earlier_clean_record_half_of_them_across_sources(corpus, records):
    _, manifest = corpus
    entries = manifest["injected"]["exact_duplicate"]
    assert len(entries) >= 0.025 * RECORDS
    clean = set(manifest["clean_ids"])
    originals = [entry["duplicate_of"] for entry in entries]
    assert len(set(originals)) == len(originals)
    for entry in entries:
        copy, original = records[entry["id"]], records[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean and entry["id"] != entry["duplicate_of"]
        assert (copy["prompt"], copy["response"], copy.get("system")) == (
            original["prompt"],
            original["response"],
            original.get("system"),
        )
        assert original["_where"] < copy["_where"] and original["created_at"] < copy["created_at"]
    across = sum(
        records[e["id"]]["_source"] != records[e["duplicate_of"]]["_source"] for e in entries
    )
    assert 0.35 <= across / len(entries) <= 0.65


# --- Eval sets and contamination ------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_items(corpus) -> dict[str, dict]:
    out, manifest = corpus
    items = {}
    for entry in manifest["eval_sets"]:
        set_items = [
            json.loads(line)
            for line in (out / "_eval_sets" / entry["path"]).read_text().splitlines()
        ]
        assert len(set_items) == entry["items"] >= 20
        name = entry["path"].removesuffix(".jsonl")
        for item in set_items:
            assert item["eval_set"] == name and item["item_id"].startswith(f"{name}-")
            assert len(item["response"].split()) >= 30
            items[item["item_id"]] = item
    assert {item["eval_set"] for item in items.values()} == {"stdlib_qa", "doc_summaries"}
    return items


def test_eval_copies_carry_their_eval_item(corpus, records, eval_items):
    _, manifest = corpus
    entries = manifest["injected"]["eval_copy"]
    assert len(entries) >= 0.008 * RECORDS
    assert len({entry["item_id"] for entry in entries}) == len(entries)
    for entry in entries:
        record, item = records[entry["id"]], eval_items[entry["item_id"]]
        assert item["eval_set"] == entry["eval_set"]
        assert normalized(item["response"]) in normalized(record["response"])
        assert normalized(item["prompt"]) in normalized(record["prompt"])


def test_clean_records_share_no_13_gram_with_any_eval_item(corpus, records, eval_items):
    _, manifest = corpus

    def grams(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + 13]) for i in range(len(words) - 12)}

    eval_grams = set().union(*(grams(item["response"]) for item in eval_items.values()))
    contaminated = [
        i for i in manifest["clean_ids"] if not grams(records[i]["response"]).isdisjoint(eval_grams)
    ]
    assert not contaminated


# --- Low quality ----------------------------------------------------------------------------------


def test_low_quality_records_are_valid_records_of_the_stated_kind(corpus, records):
    _, manifest = corpus
    entries = manifest["injected"]["low_quality"]
    assert {entry["kind"] for entry in entries} == {
        "too_short",
        "symbol_spam",
        "repeated_lines",
        "non_alpha",
    }
    for entry in entries:
        response = records[entry["id"]]["response"]
        visible = response.replace(" ", "").replace("\n", "")
        letters = sum(c.isalpha() for c in visible) / len(visible)
        if entry["kind"] == "too_short":
            assert 1 <= len(response.split()) <= 3
        elif entry["kind"] == "repeated_lines":
            response_lines = response.split("\n")
            assert len(response_lines) >= 10 and len(set(response_lines)) == 1
        else:  # symbol_spam, non_alpha
            assert letters < 0.2, response
    responses = [
        records[entry["id"]]["response"] for entry in entries if entry["kind"] != "too_short"
    ]
    assert len(set(responses)) == len(responses)


# --- Full size ------------------------------------------------------------------------------------


def test_default_size_has_the_promised_shares(tmp_path):
    manifest = write_sample_corpus(tmp_path, records=20_000)

    assert sum(entry["lines"] for entry in manifest["files"]) == 20_000
    injected = manifest["injected"]
    for kind, rate in {"exact_duplicate": 0.03, "near_duplicate": 0.03, "eval_copy": 0.01,
                       "low_quality": 0.02, "malformed": 0.01}.items():  # fmt: skip
        assert abs(len(injected[kind]) - rate * 20_000) <= 0.002 * 20_000, kind
    assert len(manifest["clean_ids"]) + sum(map(len, injected.values())) == 20_000
    assert [entry["items"] for entry in manifest["eval_sets"]] == [200, 200]
    per_file = Counter(e["file"] for e in injected["malformed"])
    assert all(per_file[entry["path"]] < 0.03 * entry["lines"] for entry in manifest["files"])
    assert Counter(e["source"] for e in injected["near_duplicate"]).keys() == set(SOURCES)


# --- Markov text: any size ------------------------------------------------------------------------
# Last in this file: the docstrings the chain learns from are parsed by then (once per process).

MARKOV_RECORDS = 2000
MARKOV_FILE_RECORDS = 150  # 500 lines a source: 4 files each, 4 shards


@pytest.fixture(scope="module")
def markov(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("markov")
    write_markov_corpus(out, records=MARKOV_RECORDS, file_records=MARKOV_FILE_RECORDS)
    return out, json.loads((out / "_sample_manifest.json").read_text())


@pytest.fixture(scope="module")
def markov_records(markov) -> pl.DataFrame:
    """Every valid record, in path order, with where it is and its place in each landing order."""
    out, manifest = markov
    frames = []
    for entry in manifest["files"]:
        result = read_landing_file(entry["path"], (out / entry["path"]).read_bytes())
        frames.append(result.records.with_columns(
            source=pl.lit(entry["source"]), file=pl.lit(entry["path"]), shard=pl.lit(entry["shard"])
        ))  # fmt: skip
    return pl.concat(frames, how="diagonal_relaxed").with_columns(
        record_id=pl.int_range(pl.len()).cast(pl.String).str.zfill(12), batch_id=pl.lit("b1")
    )


def test_markov_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path, markov):
    out, _ = markov
    write_markov_corpus(
        tmp_path / "again", records=MARKOV_RECORDS, file_records=MARKOV_FILE_RECORDS
    )
    assert file_digests(tmp_path / "again") == file_digests(out)
    write_markov_corpus(
        tmp_path / "other", records=MARKOV_RECORDS, file_records=MARKOV_FILE_RECORDS, seed=7
    )
    other = file_digests(tmp_path / "other")
    assert other.keys() == file_digests(out).keys()
    assert all(other[path] != digest for path, digest in file_digests(out).items())


def test_markov_layout_and_injected_counts_follow_the_rates(markov, markov_records):
    out, manifest = markov
    files = manifest["files"]
    assert sum(f["lines"] for f in files) == MARKOV_RECORDS and manifest["text"] == "markov"
    assert all(f["lines"] <= MARKOV_FILE_RECORDS for f in files)
    for shard in range(4):
        assert sorted(f["source"] for f in files if f["shard"] == shard) == sorted(SOURCES)
    for entry in files:
        assert hashlib.sha256((out / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    injected = manifest["injected"]
    rates = {
        "exact_duplicate": 0.03,
        "near_duplicate": 0.03,
        "eval_copy": 0.01,
        "low_quality": 0.02,
        "malformed": 0.01,
    }
    assert {kind: len(injected[kind]) for kind in rates} == {
        k: round(r * MARKOV_RECORDS) for k, r in rates.items()
    }
    assert manifest["injected_counts"] == {kind: len(entries) for kind, entries in injected.items()}
    assert manifest["clean_records"] + sum(map(len, injected.values())) == MARKOV_RECORDS
    assert markov_records.height == MARKOV_RECORDS - len(injected["malformed"])
    assert [e["items"] for e in manifest["eval_sets"]] == [20, 20]


def test_markov_clean_answers_are_distinct_and_long_tailed(markov, markov_records):
    _, manifest = markov
    injected = {
        e["id"] for kind, entries in manifest["injected"].items() for e in entries if "id" in e
    }
    clean = markov_records.filter(~pl.col("id").is_in(list(injected)))
    assert clean.height == manifest["clean_records"]
    folded = clean["response"].map_elements(
        lambda r: " ".join(r.lower().split()), return_dtype=pl.String
    )
    assert folded.n_unique() == clean.height
    words = clean["response"].str.extract_all(r"\S+").list.len()
    assert (words < 30).mean() >= 0.2 and (words > 100).mean() >= 0.03


def test_markov_duplicates_copy_a_record_that_precedes_them_in_every_landing_order(
    markov, markov_records
):
    _, manifest = markov
    place = {
        row["id"]: (row["shard"], row["file"], row["source_line"])
        for row in markov_records.select("id", "shard", "file", "source_line").iter_rows(named=True)
    }
    entries = manifest["injected"]["exact_duplicate"] + manifest["injected"]["near_duplicate"]
    for entry in entries:
        original, copy = place[entry["duplicate_of"]], place[entry["id"]]
        assert original < copy, entry  # landed shard by shard
        assert original[1:] < copy[1:], entry  # landed at once, in path order
    assert (
        sum(place[e["duplicate_of"]][0] < place[e["id"]][0] for e in entries) > 0
    )  # across shards


def test_markov_curation_removes_exactly_the_injected_records(markov, markov_records):
    out, manifest = markov
    index = EvalNgramIndex.build(read_eval_sets(out / "_eval_sets"))
    curated = curate(markov_records, None, index, SilverConfig())
    stage = dict(
        zip(
            curated.rejects["id"],
            curated.rejects["stage"].str.replace(r"quality:.*", "quality"),
            strict=True,
        )
    )
    expected = manifest["expected"]["silver_rejects"]
    for kind, stage_name in {
        "exact_duplicate": "exact_dup",
        "eval_copy": "decontaminated",
        "low_quality": "quality",
    }.items():
        assert [stage.get(e["id"]) for e in manifest["injected"][kind]] == [stage_name] * expected[
            stage_name
        ]
    near = [stage.get(e["id"]) for e in manifest["injected"]["near_duplicate"]]
    assert set(near) <= {"near_dup", None} and near.count("near_dup") >= 0.9 * len(
        near
    )  # MinHash estimates
    assert len(stage) == sum(expected.values()) - near.count(None)  # no clean record removed
