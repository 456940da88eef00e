"""The sample corpus's preference source: deterministic bytes, the landing contract, and every
injected defect recounted from the files themselves rather than taken from the manifest's word."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import unicodedata
from collections import Counter
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
import zstandard

from pipeline_assets.cli.main import main
from pipeline_assets.lib.formats import PREFERENCE
from pipeline_assets.lib.landing.contract import Rejected, validate_landing_object
from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.silver.decontam import (
    DecontamConfig,
    EvalNgramIndex,
    read_eval_sets,
    text_words,
)
from pipeline_assets.lib.silver.normalize import normalize_text
from pipeline_assets.sample_data.corpus import MANIFEST_NAME, shingle_jaccard, write_sample_corpus
from pipeline_assets.sample_data.preferences import (
    ANSWER_MAX_WORDS,
    INJECTION_RATES,
    LARGEST_PROMPT_PAIRS,
    PROMPT_PAIR_CAP,
    add_preference_source,
    dedup_text,
    rejected_answer,
    write_preference_source,
)
from pipeline_assets_tests.conftest import cli_environment

RECORDS = 200
PAIRS = 300
PAIR_TEXT = ("prompt", "chosen", "rejected")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("landing")
    write_sample_corpus(out, records=RECORDS)
    return out, add_preference_source(out, PAIRS)


@pytest.fixture(scope="module")
def section(corpus) -> dict:
    return corpus[1]["preference"]


@pytest.fixture(scope="module")
def lines(corpus, section) -> dict[str, list[bytes]]:
    """file path -> its lines, in order."""
    out, _ = corpus
    return {entry["path"]: read_lines(out / entry["path"]) for entry in section["files"]}


@pytest.fixture(scope="module")
def pairs(section, lines) -> dict[str, dict]:
    """id -> every pair that is not a malformed line, with where it is as _where: (file, line)."""
    malformed = {(entry["file"], entry["line"]) for entry in section["injected"]["malformed"]}
    found = {}
    for path, units in lines.items():
        for number, line in enumerate(units, start=1):
            if (path, number) not in malformed:
                obj = json.loads(line)
                assert obj["id"] not in found
                found[obj["id"]] = {**obj, "_where": (path, number)}
    return found


@pytest.fixture(scope="module")
def eval_items(corpus) -> pl.DataFrame:
    return read_eval_sets(corpus[0] / "_eval_sets")


def read_lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if path.name.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompress(data)
    assert data.endswith(b"\n")
    return data[:-1].split(b"\n")


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in root.rglob("*")
        if path.is_file()
    }


def normalized(*texts: str) -> list[str]:
    return (
        pl.DataFrame({"text": list(texts)}).select(normalize_text(pl.col("text")))["text"].to_list()
    )


def entries(section: dict, kind: str) -> list[dict]:
    found = section["injected"][kind]
    assert len(found) == section["injected_counts"][kind] == round(INJECTION_RATES[kind] * PAIRS), (
        kind
    )
    return found


def earlier(pair: dict, original: dict) -> bool:
    return original["_where"] < pair["_where"]  # file paths sort in landing order


# --- Determinism and the opt-in -------------------------------------------------------------------


def test_same_pairs_and_seed_give_identical_bytes_and_another_seed_does_not(
    tmp_path, corpus, section
):
    items = [
        json.loads(line)
        for name in ("stdlib_qa", "doc_summaries")
        for line in (corpus[0] / "_eval_sets" / f"{name}.jsonl").read_text().splitlines()
    ]
    again = write_preference_source(tmp_path / "again", PAIRS, items, seed=section["seed"])
    other = write_preference_source(tmp_path / "other", PAIRS, items, seed=7)
    assert again == section
    written = {
        entry["path"]: (corpus[0] / entry["path"]).read_bytes() for entry in section["files"]
    }
    assert {path: (tmp_path / "again" / path).read_bytes() for path in written} == written
    assert all(
        a["sha256"] != b["sha256"] for a, b in zip(section["files"], other["files"], strict=True)
    )


def test_zero_preference_pairs_leave_the_corpus_as_it_was(tmp_path, capsys):
    flag = tmp_path / "flag"
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert (
            main(
                [
                    "sample-data",
                    "--records",
                    str(RECORDS),
                    "--preference-pairs",
                    "0",
                    "--out",
                    str(flag / "landing"),
                    "--eval-sets-out",
                    str(flag / "eval"),
                ]
            )
            == 0
        )
    finally:
        signal.signal(signal.SIGTERM, before)  # main() routes SIGTERM for a command's lifetime
    write_sample_corpus(
        tmp_path / "plain" / "landing", records=RECORDS, eval_sets_dir=tmp_path / "plain" / "eval"
    )
    assert file_digests(tmp_path / "flag") == file_digests(tmp_path / "plain")
    assert "preference" not in json.loads(capsys.readouterr().out)


def test_command_writes_the_pairs_and_prints_the_setting(tmp_path, corpus, section):
    """In a fresh process with another hash seed: the bytes this process writes, and the setting
    bronze needs."""
    landing = tmp_path / "landing"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline_assets.cli.main",
            "sample-data",
            "--records",
            str(RECORDS),
            "--preference-pairs",
            str(PAIRS),
            "--out",
            str(landing),
            "--eval-sets-out",
            str(tmp_path / "eval"),
        ],
        env=cli_environment(tmp_path, PYTHONHASHSEED="12345"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert """PIPELINE_SOURCE_FORMATS='{"prefs": "preference"}'""" in done.stderr
    assert json.loads(done.stdout)["preference"] == section["expected"]
    assert sorted(p.name for p in (landing / "prefs").iterdir()) == [
        "prefs-000.jsonl",
        "prefs-001.jsonl.zst",
    ]
    here = file_digests(corpus[0])
    assert {
        path: digest for path, digest in file_digests(landing).items() if path != MANIFEST_NAME
    } == {
        path: digest
        for path, digest in here.items()
        if not path.startswith(("_eval_sets", MANIFEST_NAME))
    }
    assert json.loads((landing / MANIFEST_NAME).read_text()) == corpus[1]


# --- The landing contract -------------------------------------------------------------------------


def test_files_hold_the_stated_lines_and_sources(corpus, section, lines):
    _, manifest = corpus
    assert [entry["path"] for entry in section["files"]] == [
        "prefs/prefs-000.jsonl",
        "prefs/prefs-001.jsonl.zst",
    ]
    assert (
        sum(entry["lines"] for entry in section["files"]) == section["expected"]["lines"] == PAIRS
    )
    for entry in section["files"]:
        units = lines[entry["path"]]
        assert len(units) == entry["lines"]
        assert (
            hashlib.sha256((corpus[0] / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
        )
    assert section["setting"] == {"PIPELINE_SOURCE_FORMATS": {"prefs": "preference"}}
    assert manifest["expected"] == {
        "lines": RECORDS,
        "quarantined": manifest["expected"]["quarantined"],
        "bronze_rows": RECORDS - manifest["expected"]["quarantined"],
    }, "sft's own"


def test_every_line_meets_the_contract_but_the_malformed_ones_which_break_it_as_stated(
    section, lines
):
    malformed = {
        (entry["file"], entry["line"]): entry["reason"]
        for entry in section["injected"]["malformed"]
    }
    assert sorted(malformed.values()) == [
        "empty_field:chosen",
        "invalid_json",
        "missing_field:rejected",
    ]
    for path, units in lines.items():
        pairs_here = 0
        for number, line in enumerate(units, start=1):
            reason = malformed.get((path, number))
            if reason is None:
                validate_landing_object(json.loads(line), {}, PREFERENCE)
                pairs_here += 1
            elif reason == "invalid_json":
                with pytest.raises(json.JSONDecodeError):
                    json.loads(line)
            else:
                with pytest.raises(Rejected) as rejected:
                    validate_landing_object(json.loads(line), {}, PREFERENCE)
                assert rejected.value.reason == reason
        assert pairs_here == next(
            entry["pairs"] for entry in section["files"] if entry["path"] == path
        )
    assert section["expected"]["quarantined"] == len(malformed)
    assert section["expected"]["bronze_rows"] == PAIRS - len(malformed)


def test_bronze_reader_quarantines_exactly_the_malformed_lines(corpus, section):
    quarantined = []
    for entry in section["files"]:
        read = read_landing_file(
            entry["path"], (corpus[0] / entry["path"]).read_bytes(), record_format=PREFERENCE
        )
        assert read.records.height == entry["pairs"] and read.lines_read == entry["lines"]
        where = read.quarantine.select("source_line", "reason").rows()
        quarantined += [(entry["path"], line, reason) for line, reason in where]
    assert sorted(quarantined) == sorted(
        (e["file"], e["line"], e["reason"]) for e in section["injected"]["malformed"]
    )


def test_every_pair_is_clean_or_injected_exactly_once(section, pairs):
    injected = [
        entry["id"]
        for kind, found in section["injected"].items()
        if kind != "malformed"
        for entry in found
    ]
    assert Counter(injected + section["clean_ids"]) == Counter(list(pairs))
    assert len(section["clean_ids"]) > 0.8 * PAIRS


# --- Clean pairs ----------------------------------------------------------------------------------


def test_clean_pairs_are_modest_scored_and_timestamped(section, pairs):
    clean = [pairs[i] for i in section["clean_ids"]]
    for pair in clean:
        for side in ("chosen", "rejected"):
            assert 20 <= len(pair[side].split()) <= ANSWER_MAX_WORDS, pair["id"]
        assert datetime.fromisoformat(pair["created_at"]).utcoffset().total_seconds() == 0
        if "score_chosen" in pair:
            assert pair["score_chosen"] > pair["score_rejected"], pair["id"]
    scored = sum("score_chosen" in pair for pair in clean)
    assert 0.75 * len(clean) < scored < len(clean)


def test_rejected_is_the_chosen_answer_reversed_and_shortened(section, pairs):
    for pair in (pairs[i] for i in section["clean_ids"]):
        chosen, rejected = pair["chosen"], pair["rejected"]
        assert rejected == rejected_answer(chosen)
        left_out = Counter(chosen.split()) - Counter(rejected.split())
        assert not Counter(rejected.split()) - Counter(chosen.split()), "no word of its own"
        assert 2 <= sum(left_out.values()) <= max(2, 0.1 * len(chosen.split()))
        assert len(set(normalized(chosen, rejected))) == 2


def test_prompts_with_several_pairs_and_one_over_the_cap(section, pairs):
    by_prompt: dict[str, list[str]] = {}
    for pair_id in section["clean_ids"]:
        by_prompt.setdefault(pairs[pair_id]["prompt"], []).append(pair_id)
    groups = sorted((ids for ids in by_prompt.values() if len(ids) > 1), key=len, reverse=True)
    assert [sorted(ids) for ids in groups] == [sorted(ids) for ids in section["prompt_groups"]]
    assert len(groups[0]) == LARGEST_PROMPT_PAIRS and all(2 <= len(ids) <= 4 for ids in groups[1:])
    assert 0.12 < len(groups) / len(by_prompt) < 0.28
    for ids in groups:
        assert len({pairs[i]["chosen"] for i in ids}) == len(ids)
    every_prompt = Counter(pair["prompt"] for pair in pairs.values())
    over = {
        prompt: n - PROMPT_PAIR_CAP for prompt, n in every_prompt.items() if n > PROMPT_PAIR_CAP
    }
    assert (
        over == {pairs[groups[0][0]]["prompt"]: 3}
        and section["expected"]["pairs_over_prompt_cap"] == 3
    )


# --- Injected defects -----------------------------------------------------------------------------


def test_exact_duplicates_copy_an_earlier_clean_pair(section, pairs):
    clean = set(section["clean_ids"])
    for entry in entries(section, "exact_duplicate"):
        copy, original = pairs[entry["id"]], pairs[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean and earlier(copy, original)
        assert [copy[k] for k in PAIR_TEXT] == [original[k] for k in PAIR_TEXT]


def test_near_duplicates_edit_prompt_and_chosen_and_stay_close(section, pairs):
    clean = set(section["clean_ids"])
    for entry in entries(section, "near_duplicate"):
        copy, original = pairs[entry["id"]], pairs[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean and earlier(copy, original)
        assert copy["prompt"] != original["prompt"] and copy["chosen"] != original["chosen"]
        assert copy["rejected"] == original["rejected"]
        jaccard = shingle_jaccard(
            *(dedup_text(p["prompt"], p["chosen"], p["rejected"]) for p in (original, copy))
        )
        assert jaccard >= 0.85 and jaccard == pytest.approx(entry["jaccard"], abs=1e-4)
        assert shingle_jaccard(original["chosen"], copy["chosen"]) >= 0.85
        assert len(set(normalized(original["chosen"], copy["chosen"]))) == 2, (
            "not an exact duplicate"
        )


def test_contradictions_swap_an_earlier_clean_pair(section, pairs):
    clean = set(section["clean_ids"])
    found = entries(section, "contradiction")
    for entry in found:
        swapped, original = pairs[entry["id"]], pairs[entry["contradicts"]]
        assert entry["contradicts"] in clean and earlier(swapped, original)
        assert swapped["prompt"] == original["prompt"]
        assert (swapped["chosen"], swapped["rejected"]) == (
            original["rejected"],
            original["chosen"],
        )
    assert len({entry["contradicts"] for entry in found}) == len(found)


def test_ties_have_equal_scores(section, pairs):
    for entry in entries(section, "tie"):
        pair = pairs[entry["id"]]
        assert pair["score_chosen"] == pair["score_rejected"] == entry["score"]
        assert len(set(normalized(pair["chosen"], pair["rejected"]))) == 2
    ties = [
        p["id"]
        for p in pairs.values()
        if "score_chosen" in p and p["score_chosen"] == p["score_rejected"]
    ]
    assert sorted(ties) == sorted(entry["id"] for entry in section["injected"]["tie"])


def test_chosen_equals_rejected_after_normalization_only(section, pairs):
    found = entries(section, "chosen_equals_rejected")
    assert {entry["variant"] for entry in found} == {"whitespace", "crlf", "nfd"}
    for entry in found:
        chosen, rejected = pairs[entry["id"]]["chosen"], pairs[entry["id"]]["rejected"]
        assert chosen != rejected and len(set(normalized(chosen, rejected))) == 1
        if entry["variant"] == "crlf":
            assert "\r\n" in rejected
        elif entry["variant"] == "nfd":
            assert unicodedata.normalize("NFC", rejected) == chosen
    equal = [
        p["id"] for p in pairs.values() if len(set(normalized(p["chosen"], p["rejected"]))) == 1
    ]
    assert sorted(equal) == sorted(entry["id"] for entry in found)


def test_eval_copies_are_caught_by_decontamination_and_nothing_else_is(section, pairs, eval_items):
    index = EvalNgramIndex.build(eval_items, DecontamConfig(fields=PREFERENCE.decontaminate))
    responses = dict(zip(eval_items["item_id"], eval_items["response"], strict=True))
    found = entries(section, "eval_copy")
    for entry in found:
        pair = pairs[entry["id"]]
        match = index.first_match([pair.get(name) or "" for name in PREFERENCE.decontaminate])
        assert match is not None and (match.eval_set, match.item_id) == (
            entry["eval_set"],
            entry["item_id"],
        )
        assert match.field == "prompt"
        item_words, chosen_words = (
            text_words(responses[entry["item_id"]]),
            text_words(pair["chosen"]),
        )
        assert item_words[:13] == chosen_words[:13], "the chosen answer copies 13 words and more"
    copies = {entry["id"] for entry in found}
    caught = {
        i
        for i, p in pairs.items()
        if index.first_match([p.get(name) or "" for name in PREFERENCE.decontaminate])
    }
    assert caught == copies


def test_low_quality_chosen_answers_are_of_the_stated_kind(section, pairs):
    found = entries(section, "low_quality")
    assert {entry["kind"] for entry in found} == {
        "too_short",
        "symbol_spam",
        "repeated_lines",
        "non_alpha",
    }
    for entry in found:
        chosen = pairs[entry["id"]]["chosen"]
        visible = "".join(chosen.split())
        if entry["kind"] == "too_short":
            assert 1 <= len(chosen.split()) <= 3
        elif entry["kind"] == "repeated_lines":
            assert len(set(chosen.split("\n"))) == 1 and chosen.count("\n") >= 9
        else:
            assert sum(c.isalpha() for c in visible) < 0.2 * len(visible)
        assert len(pairs[entry["id"]]["rejected"].split()) >= 20, (
            "a real answer lost to a useless one"
        )
