"""The sample corpus's conversation source: deterministic bytes, the conversation shape, and every
injected defect recounted from the files themselves, with the stages that are to catch it (the
format's views, decontamination, the quality rules) run on what was written."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from pipeline_assets.cli.main import main
from pipeline_assets.lib.formats import CONVERSATION, ROLES, TURNS
from pipeline_assets.lib.silver.decontam import (
    DecontamConfig,
    EvalNgramIndex,
    find_contamination,
    read_eval_sets,
)
from pipeline_assets.lib.silver.quality import quality_gate
from pipeline_assets.sample_data.conversations import (
    CONVERSATION_DEFECTS,
    INJECTION_RATES,
    MALFORMED_REASONS,
    TURN_MAX_WORDS,
    add_conversation_source,
    assistant_text,
    conversation_text,
    write_conversation_source,
)
from pipeline_assets.sample_data.corpus import (
    INJECTION_RATES as SFT_INJECTION_RATES,
)
from pipeline_assets.sample_data.corpus import (
    MANIFEST_NAME,
    shingle_jaccard,
    write_sample_corpus,
)
from pipeline_assets_tests.conftest import cli_environment
from pipeline_assets_tests.sample_data.test_preferences import (
    file_digests,
    normalized,
    read_lines,
)

RECORDS = 200
CONVERSATIONS = 500  # 1% of the lines is 5: each conversation defect once
QUARANTINED = ("malformed", "invalid_conversation")
FROM_SHAREGPT = {"system": "system", "human": "user", "gpt": "assistant"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("landing")
    write_sample_corpus(out, records=RECORDS)
    return out, add_conversation_source(out, CONVERSATIONS)


@pytest.fixture(scope="module")
def section(corpus) -> dict:
    return corpus[1]["conversation"]


@pytest.fixture(scope="module")
def lines(corpus, section) -> dict[str, list[bytes]]:
    out, _ = corpus
    return {entry["path"]: read_lines(out / entry["path"]) for entry in section["files"]}


@pytest.fixture(scope="module")
def quarantined(section) -> dict[tuple[str, int], dict]:
    return {(e["file"], e["line"]): e for kind in QUARANTINED for e in section["injected"][kind]}


@pytest.fixture(scope="module")
def conversations(lines, quarantined) -> dict[str, dict]:
    """id -> every line that is not quarantined, its turns as (role, content) in ``turns`` whichever
    shape it has, and where it is as _where: (file, line)."""
    found = {}
    for path, units in lines.items():
        for number, line in enumerate(units, start=1):
            if (path, number) not in quarantined:
                obj = json.loads(line)
                assert obj["id"] not in found
                found[obj["id"]] = {**obj, "turns": turns_of(obj), "_where": (path, number)}
    return found


@pytest.fixture(scope="module")
def views(conversations) -> pl.DataFrame:
    """Every conversation's normalized turns and the format's views of them: what silver reads."""
    ids = list(conversations)
    messages = [
        [
            {"role": role, "content": content}
            for role, content in zip(
                (role for role, _ in conversations[i]["turns"]),
                normalized(*(content for _, content in conversations[i]["turns"])),
                strict=True,
            )
        ]
        for i in ids
    ]
    frame = pl.DataFrame(
        {"record_id": ids, "messages": messages},
        schema={"record_id": pl.String, "messages": TURNS},
    )
    return CONVERSATION.with_views(frame)


def turns_of(obj: dict) -> list[tuple[str, str]]:
    if "messages" in obj:
        return [(turn["role"], turn["content"]) for turn in obj["messages"]]
    return [(FROM_SHAREGPT[turn["from"]], turn["value"]) for turn in obj["conversations"]]


def broken_rules(line: bytes) -> list[tuple[str, int | None]]:
    """(reason, turn at fault or None) of every rule of DESIGN.md's a line breaks, in the order
    bronze is to check them: the first is its reason; none for a conversation. A line that is no
    object with turns breaks only the first rule that says so."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return [("invalid_json", None)]
    if not isinstance(obj, dict):
        return [("not_an_object", None)]
    key = "messages" if "messages" in obj else "conversations" if "conversations" in obj else None
    if key is None:
        return [("missing_field:messages", None)]
    turns = obj[key]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return [("wrong_type:messages", None)]
    role_key, content_key = ("role", "content") if key == "messages" else ("from", "value")
    rename = {role: role for role in ROLES} if key == "messages" else FROM_SHAREGPT
    roles = [rename.get(turn.get(role_key)) for turn in turns]
    broken = [("unknown_role", i) for i, role in enumerate(roles) if role is None]
    broken += [
        ("empty_turn", i)
        for i, turn in enumerate(turns)
        if not str(turn.get(content_key) or "").strip()
    ]
    if "assistant" not in roles:
        broken.append(("no_assistant_turn", None))
    if roles and roles[-1] != "assistant":  # DESIGN.md: it ends with an assistant turn
        broken.append(("ends_on_user_turn", len(roles) - 1))
    return broken


def entries(section: dict, kind: str) -> list[dict]:
    found = section["injected"][kind]
    wanted = int(INJECTION_RATES[kind] * CONVERSATIONS + 0.5)
    assert len(found) == section["injected_counts"][kind] == wanted, kind
    return found


def earlier(conversation: dict, original: dict) -> bool:
    return original["_where"] < conversation["_where"]  # file paths sort in landing order


# --- Determinism and the command ------------------------------------------------------------------


def test_same_conversations_and_seed_give_identical_bytes_and_another_seed_does_not(
    tmp_path, corpus, section
):
    items = [
        json.loads(line)
        for entry in corpus[1]["eval_sets"]
        for line in (corpus[0] / "_eval_sets" / entry["path"]).read_text().splitlines()
    ]
    again = write_conversation_source(tmp_path / "again", CONVERSATIONS, items, section["seed"])
    other = write_conversation_source(tmp_path / "other", CONVERSATIONS, items, seed=7)
    assert again == section
    for entry in section["files"]:
        path = entry["path"]
        assert (tmp_path / "again" / path).read_bytes() == (corpus[0] / path).read_bytes()
    assert all(
        a["sha256"] != b["sha256"] for a, b in zip(section["files"], other["files"], strict=True)
    )


def test_command_writes_conversations_beside_preference_pairs_and_prints_the_setting(
    tmp_path, corpus, section
):
    """In a fresh process with another hash seed, with preference pairs written first: the same
    conversation files, and the setting bronze needs for both added sources."""
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
            "40",
            "--conversations",
            str(CONVERSATIONS),
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
    setting = """PIPELINE_SOURCE_FORMATS='{"prefs": "preference", "chats": "conversation"}'"""
    assert setting in done.stderr
    assert json.loads(done.stdout)["conversation"] == section["expected"]
    written = file_digests(landing)
    assert {p: d for p, d in written.items() if p.startswith("chats/")} == {
        p: d for p, d in file_digests(corpus[0]).items() if p.startswith("chats/")
    }
    assert json.loads((landing / MANIFEST_NAME).read_text())["conversation"] == section
    assert section["setting"] == {"PIPELINE_SOURCE_FORMATS": {"chats": "conversation"}}


def test_zero_conversations_leave_the_corpus_as_it_was_and_markov_text_refuses_them(
    tmp_path, capsys
):
    def sample_data(*flags: str) -> int:
        before = signal.getsignal(signal.SIGTERM)
        try:
            return main(["sample-data", "--records", str(RECORDS), *flags])
        finally:
            signal.signal(signal.SIGTERM, before)  # main() routes SIGTERM for a command's lifetime

    flag = tmp_path / "flag"
    written = sample_data(
        "--conversations", "0", "--out", str(flag / "landing"), "--eval-sets-out", str(flag / "e")
    )
    assert written == 0 and "conversation" not in json.loads(capsys.readouterr().out)
    plain = tmp_path / "plain"
    write_sample_corpus(plain / "landing", records=RECORDS, eval_sets_dir=plain / "e")
    assert file_digests(flag) == file_digests(plain)
    markov = tmp_path / "markov"
    assert sample_data("--text", "markov", "--conversations", "10", "--out", str(markov)) == 2
    assert "--conversations applies to --text docstrings only" in capsys.readouterr().err
    assert not markov.exists(), "refused before anything is written"


# --- Files, shapes and turns ----------------------------------------------------------------------


def test_files_hold_the_stated_lines_and_a_share_of_the_second_in_the_sharegpt_shape(
    corpus, section, lines, quarantined
):
    assert [entry["path"] for entry in section["files"]] == [
        "chats/chats-000.jsonl",
        "chats/chats-001.jsonl.zst",
    ]
    assert sum(entry["lines"] for entry in section["files"]) == CONVERSATIONS
    for entry in section["files"]:
        units = lines[entry["path"]]
        assert len(units) == entry["lines"] == CONVERSATIONS // 2
        here = [where for where in quarantined if where[0] == entry["path"]]
        assert entry["conversations"] == entry["lines"] - len(here)
        sharegpt = {
            number
            for number, line in enumerate(units, start=1)
            if b'"conversations": ' in line and b'"messages": ' not in line
        }
        assert sharegpt == set(entry["sharegpt_lines"]), entry["path"]
    first, second = section["files"]
    assert first["sharegpt_lines"] == []
    assert 0.35 < len(second["sharegpt_lines"]) / second["lines"] < 0.65
    assert section["expected"] == {
        "lines": CONVERSATIONS,
        "quarantined": len(quarantined),
        "bronze_rows": CONVERSATIONS - len(quarantined),
    }


def test_every_conversation_has_two_to_four_exchanges_and_ends_on_the_assistant(conversations):
    exchanges = Counter()
    for conversation in conversations.values():
        roles = [role for role, _ in conversation["turns"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2), conversation["id"]
        assert 2 <= len(roles) // 2 <= 4
        exchanges[len(roles) // 2] += 1
        assert all(content.strip() for _, content in conversation["turns"])
        assert set(conversation["meta"]) == {"channel"} and conversation["created_at"]
    assert all(n > 0.2 * len(conversations) for n in exchanges.values()), exchanges
    opened_by_system = sum(c["turns"][0][0] == "system" for c in conversations.values())
    assert 0.15 < opened_by_system / len(conversations) < 0.35
    shapes = Counter("messages" in c for c in conversations.values())
    assert shapes[False] > 0.15 * len(conversations), "ShareGPT lines are conversations too"


def test_clean_answers_are_unused_prose_of_bounded_length(section, conversations):
    answers = Counter()
    for conversation in (conversations[i] for i in section["clean_ids"]):
        for role, content in conversation["turns"]:
            if role == "assistant":
                assert 6 <= len(content.split()) <= TURN_MAX_WORDS, conversation["id"]
                answers[content] += 1
    assert max(answers.values()) == 1, "every answer's text is used once"


def test_every_line_is_a_conversation_but_the_quarantined_ones_which_break_as_stated(
    section, lines, quarantined
):
    for path, units in lines.items():
        for number, line in enumerate(units, start=1):
            entry = quarantined.get((path, number))
            broken = broken_rules(line)
            if entry is None:
                assert broken == [], (path, number)
                continue
            assert broken[0] == (entry["reason"], entry.get("turn")), (path, number)
            # one rule broken, whichever order bronze checks them in; a conversation with no
            # answer ends on its question as well
            also = {"no_assistant_turn": ["ends_on_user_turn"]}.get(entry["reason"], [])
            assert [reason for reason, _ in broken[1:]] == also, (path, number)
    assert sorted(e["reason"] for e in entries(section, "invalid_conversation")) == sorted(
        CONVERSATION_DEFECTS
    )
    assert {e["reason"] for e in entries(section, "malformed")} == set(MALFORMED_REASONS)


def test_every_conversation_is_clean_or_injected_exactly_once(section, conversations):
    injected = [
        entry["id"]
        for kind, found in section["injected"].items()
        if kind not in QUARANTINED
        for entry in found
    ]
    assert Counter(injected + section["clean_ids"]) == Counter(list(conversations))
    assert len(section["clean_ids"]) > 0.85 * CONVERSATIONS
    assert {k: v for k, v in INJECTION_RATES.items() if k in SFT_INJECTION_RATES} == (
        SFT_INJECTION_RATES
    ), "the sft records' rates"


# --- Injected defects -----------------------------------------------------------------------------


def test_the_texts_compared_here_are_the_format_views_silver_reads(conversations, views):
    for row in views.head(50).iter_rows(named=True):
        turns = [(t["role"], t["content"]) for t in row["messages"]]
        assert row["conversation"] == conversation_text(turns)
        assert row["assistant_turns"] == assistant_text(turns)


def test_exact_duplicates_copy_an_earlier_clean_conversation(section, conversations):
    clean = set(section["clean_ids"])
    for entry in entries(section, "exact_duplicate"):
        copy, original = conversations[entry["id"]], conversations[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean and earlier(copy, original)
        assert copy["turns"] == original["turns"] and copy["id"] != original["id"]


def test_near_duplicates_edit_assistant_turns_only_and_stay_close(section, conversations):
    clean = set(section["clean_ids"])
    for entry in entries(section, "near_duplicate"):
        copy, original = conversations[entry["id"]], conversations[entry["duplicate_of"]]
        assert entry["duplicate_of"] in clean and earlier(copy, original)
        changed = [i for i, turn in enumerate(copy["turns"]) if turn != original["turns"][i]]
        assert changed == entry["edited_turns"] and changed
        assert all(copy["turns"][i][0] == "assistant" for i in changed)
        assert len(copy["turns"]) == len(original["turns"])
        answers = shingle_jaccard(assistant_text(original["turns"]), assistant_text(copy["turns"]))
        whole = shingle_jaccard(
            conversation_text(original["turns"]), conversation_text(copy["turns"])
        )
        assert answers >= 0.85 and answers == pytest.approx(entry["jaccard"], abs=1e-4)
        assert whole >= 0.85 and whole == pytest.approx(entry["conversation_jaccard"], abs=1e-4)
        assert normalized(assistant_text(original["turns"])) != normalized(
            assistant_text(copy["turns"])
        ), "not an exact duplicate"


def test_eval_copies_are_caught_by_decontamination_in_their_turn_and_nothing_else_is(
    corpus, section, views
):
    eval_items = read_eval_sets(corpus[0] / "_eval_sets")
    index = EvalNgramIndex.build(eval_items, DecontamConfig(fields=CONVERSATION.decontaminate))
    _, rejected, _ = find_contamination(views, index, CONVERSATION.decontaminate)
    caught = {row["record_id"]: row for row in rejected.iter_rows(named=True)}

    found = entries(section, "eval_copy")
    assert {entry["place"] for entry in found} == {"user_turn", "assistant_turn"}
    assert caught.keys() == {entry["id"] for entry in found}
    for entry in found:
        row = caught[entry["id"]]
        evidence = json.loads(row["evidence"])
        assert (row["eval_set"], row["eval_item_id"]) == (entry["eval_set"], entry["item_id"])
        assert evidence["field"] == f"messages[{entry['turn']}]", "the turn the copy is in"
        role = row["messages"][entry["turn"]]["role"]
        assert role == ("user" if entry["place"] == "user_turn" else "assistant")


def test_low_quality_conversations_and_only_they_fail_the_quality_rules(section, views):
    found = entries(section, "low_quality")
    assert {entry["kind"] for entry in found} == {
        "too_short",
        "symbol_spam",
        "repeated_lines",
        "non_alpha",
    }
    _, rejected, _ = quality_gate(views, judged=CONVERSATION.judged)
    assert sorted(rejected["record_id"]) == sorted(entry["id"] for entry in found)
    turns = {row["record_id"]: row["messages"] for row in views.iter_rows(named=True)}
    for entry in found:
        roles = [turn["role"] for turn in turns[entry["id"]]]
        assert entry["turns"] == [i for i, role in enumerate(roles) if role == "assistant"]
