"""Readers and the landing contract against a bad-input corpus that covers every reason code."""

from __future__ import annotations

import gzip
import io

import orjson
import polars as pl
import pytest
import zstandard

from pipeline_assets.lib.landing.files import (
    landing_format,
    read_landing_file,
    read_landing_file_exact,
)
from pipeline_assets_tests.conftest import jsonl_bytes, record

GOOD = record(1, meta={"annotator": "a7"}, session="s9")

# (line bytes, expected reason) -- one case per JSON-line reason code
BAD_LINES = [
    (b'{"prompt": "cut in the mid', "invalid_json"),
    (b'["an", "array"]', "not_an_object"),
    (b"42", "not_an_object"),
    (b'{"prompt": "p"}', "missing_field:response"),
    (b'{"response": "r"}', "missing_field:prompt"),
    (b'{"prompt": null, "response": "r"}', "missing_field:prompt"),
    (b'{"prompt": 7, "response": "r"}', "wrong_type:prompt"),
    (b'{"prompt": "p", "response": ["r"]}', "wrong_type:response"),
    (b'{"prompt": "p", "response": "r", "system": 1}', "wrong_type:system"),
    (b'{"prompt": "p", "response": "r", "id": 1.5}', "wrong_type:id"),
    (b'{"prompt": "p", "response": "r", "meta": "not an object"}', "wrong_type:meta"),
    (b'{"prompt": "p", "response": "r", "created_at": 1700000000}', "wrong_type:created_at"),
    (
        b'{"prompt": "p", "response": "r", "created_at": "last tuesday"}',
        "invalid_timestamp:created_at",
    ),
    (
        b'{"prompt": "p", "response": "r", "created_at": "2026-11-01T00:00:00"}',
        "invalid_timestamp:created_at",
    ),
    (b'{"prompt": "  ", "response": "r"}', "empty_field:prompt"),
    (b'{"prompt": "p", "response": ""}', "empty_field:response"),
    (b'{"prompt": "p\xff\xfe", "response": "r"}', "invalid_utf8"),
    (b"   ", "blank_line"),
]


def _corpus() -> bytes:
    return jsonl_bytes([GOOD] + [line for line, _ in BAD_LINES] + [GOOD])


@pytest.mark.parametrize(
    "name, pack",
    [
        ("f.jsonl", lambda b: b),
        ("f.jsonl.gz", lambda b: gzip.compress(b, mtime=0)),
        ("f.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_every_json_line_reason_code_in_every_json_format(name, pack):
    result = read_landing_file(name, pack(_corpus()))
    assert result.records["source_line"].to_list() == [1, len(BAD_LINES) + 2]
    assert result.quarantine["reason"].to_list() == [reason for _, reason in BAD_LINES]
    assert result.quarantine["source_line"].to_list() == list(range(2, len(BAD_LINES) + 2))
    assert (
        result.lines_read == result.records.height + result.quarantine.height == len(BAD_LINES) + 2
    )


def test_quarantine_keeps_the_line_verbatim_and_explains():
    result = read_landing_file(
        "f.jsonl", jsonl_bytes([b'{"prompt": 7, "response": "r"}', b'{"prompt": "p\xff"}'])
    )
    first, second = result.quarantine.iter_rows(named=True)
    assert first["raw"] == '{"prompt": 7, "response": "r"}'
    assert "must be a string, got number" in first["detail"]
    assert second["raw"] == '{"prompt": "p\ufffd"}'  # the undecodable byte shown as U+FFFD
    assert second["reason"] == "invalid_utf8" and "not UTF-8" in second["detail"]


def test_accepted_record_keeps_optional_fields_meta_and_extra():
    result = read_landing_file("f.jsonl", jsonl_bytes([GOOD, record(2, id=17, system="sys")]))
    first, second = result.records.iter_rows(named=True)
    assert first["meta"] == '{"annotator":"a7"}'
    assert first["extra"] == '{"session":"s9"}'
    assert str(first["created_at"]) == "2026-11-20 10:00:00+00:00"
    assert second["id"] == "17" and second["system"] == "sys" and second["extra"] is None
    assert first["content_hash"] != second["content_hash"] and len(first["content_hash"]) == 32


def test_field_mapping_renames_a_source_field():
    line = {"prompt": "p", "completion": "c"}
    assert read_landing_file("f.jsonl", jsonl_bytes([line])).quarantine["reason"].to_list() == [
        "missing_field:response"
    ]
    mapped = read_landing_file("f.jsonl", jsonl_bytes([line]), {"completion": "response"})
    assert mapped.records["response"].to_list() == ["c"] and mapped.quarantine.is_empty()


@pytest.mark.parametrize(
    "name, pack",
    [
        ("f.jsonl.gz", lambda b: gzip.compress(b, mtime=0)),
        ("f.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_truncated_compressed_file_keeps_complete_lines(name, pack):
    packed = pack(jsonl_bytes([record(i, response="word " * 200) for i in range(400)]))
    result = read_landing_file(name, packed[: len(packed) * 2 // 3])
    assert 0 < result.records.height < 400
    last = result.quarantine.row(-1, named=True)
    assert last["reason"] == "truncated_file" and "cut short" in last["detail"]
    assert last["source_line"] == result.records.height + 1
    assert result.lines_read == result.records.height + result.quarantine.height


def test_unreadable_and_unsupported_files_are_one_quarantined_unit():
    for name, data, reason in [
        ("f.jsonl.gz", b"not gzip at all", "unreadable_file"),
        ("f.jsonl.zst", b"not zstd at all", "unreadable_file"),
        ("f.parquet", b"PAR1 broken", "unreadable_file"),
        ("f.csv", b"prompt,response\n", "unsupported_format"),
    ]:
        result = read_landing_file(name, data)
        assert result.records.is_empty()
        assert result.quarantine.select("source_line", "reason").rows() == [(0, reason)], name
        assert result.lines_read == 1


def test_parquet_rows_are_validated_like_lines():
    frame = pl.DataFrame(
        {
            "prompt": ["p1", "  ", None, "p4"],
            "response": ["r1", "r2", "r3", None],
            "url": ["u1", "u2", "u3", "u4"],
        }
    )
    buffer = io.BytesIO()
    frame.write_parquet(buffer)
    result = read_landing_file("f.parquet", buffer.getvalue())
    assert result.records.select("source_line", "extra").rows() == [(1, '{"url":"u1"}')]
    assert result.quarantine.select("source_line", "reason").rows() == [
        (2, "empty_field:prompt"),
        (3, "missing_field:prompt"),
        (4, "missing_field:response"),
    ]
    assert result.quarantine["raw"][0] == '{"prompt":"  ","response":"r2","url":"u2"}'


def test_landing_format_by_suffix():
    assert [
        landing_format(n) for n in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "a.json")
    ] == ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", None]


def test_running_out_of_memory_while_reading_parquet_is_not_a_bad_file(monkeypatch):
    """A MemoryError says nothing about the file: it must stop the run, not quarantine the file as
    unreadable. polars cannot be made to run out of memory here on demand, so read_parquet is
    replaced by one that does."""

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the row groups")

    frame = pl.DataFrame({"prompt": ["p"], "response": ["r"]})
    buffer = io.BytesIO()
    frame.write_parquet(buffer)
    monkeypatch.setattr(pl, "read_parquet", out_of_memory)
    with pytest.raises(MemoryError):
        read_landing_file("f.parquet", buffer.getvalue())


def test_content_hash_is_blake3_of_what_the_record_says():
    """BLAKE3-128 of system, prompt and response joined by U+001F: the same text hashes the same
    from any file, line or path (a missing system is an empty one), and the stored values stay
    what they are (a change of algorithm must change this test)."""
    lines = [record(1, system=None), record(2, system=""), record(3, system="s")]
    lines = [{**line, "prompt": "p", "response": "r"} for line in lines]
    fast = read_landing_file("a.jsonl", jsonl_bytes(lines)).records["content_hash"].to_list()
    exact = read_landing_file_exact("b.jsonl", jsonl_bytes(lines)).records["content_hash"].to_list()
    assert (
        fast
        == exact
        == ["487f2c98ea62676d85a0c6193325a788"] * 2 + ["0a1571afea35715e47acd3c81d47f84b"]
    )


def test_values_past_what_bronze_can_store_are_quarantined_not_crashed():
    """A timestamp whose offset leaves year 1..9999 in UTC, and meta or an unknown field nested
    deeper than orjson writes, each quarantine their line; the lines around them are kept."""
    deep = b"[" * 300 + b"]" * 300
    lines = [
        orjson.dumps(record(1, created_at="0001-01-01T00:30:00+01:00")),
        b'{"prompt": "p", "response": "r", "meta": {"x": ' + deep + b"}}",
        orjson.dumps(record(3)),
        b'{"prompt": "p", "response": "r", "trace": ' + deep + b"}",
    ]
    for read in (read_landing_file, read_landing_file_exact):
        result = read("f.jsonl", jsonl_bytes(lines))
        assert result.records["source_line"].to_list() == [3]
        assert result.quarantine["reason"].to_list() == [
            "invalid_timestamp:created_at",
            "too_deep:meta",
            "too_deep:extra",
        ]
        assert "outside the years 1 to 9999" in result.quarantine["detail"][0]


def pair(i: int, **fields) -> dict:
    base = {
        "id": f"p{i}",
        "prompt": f"Question {i}?",
        "chosen": f"A careful answer {i}.",
        "rejected": f"A sloppy answer {i}.",
        "score_chosen": 8,
        "score_rejected": 2.5,
    }
    return {k: v for k, v in {**base, **fields}.items() if v is not ...}


PREFERENCE_BAD_LINES = [
    (orjson.dumps(pair(2, rejected=...)), "missing_field:rejected"),
    (orjson.dumps(pair(3, chosen="  ")), "empty_field:chosen"),
    (orjson.dumps(pair(4, score_chosen="high")), "wrong_type:score_chosen"),
    (orjson.dumps(pair(5, score_rejected=True)), "wrong_type:score_rejected"),
    (
        orjson.dumps(record(6)),
        "missing_field:chosen",
    ),  # an sft record landed in a preference source
]


@pytest.mark.parametrize("read", [read_landing_file, read_landing_file_exact])
def test_a_preference_file_is_read_by_the_preference_contract(read):
    from pipeline_assets.lib.formats import PREFERENCE

    good = [
        pair(1, session="s1"),
        pair(7, score_chosen=None, score_rejected=..., system="Be kind."),
    ]
    data = jsonl_bytes([good[0], *(line for line, _ in PREFERENCE_BAD_LINES), good[1]])
    result = read("p.jsonl", data, None, PREFERENCE)
    assert result.records.columns == [
        "source_line",
        "prompt_messages",
        "prompt",
        "chosen",
        "rejected",
        "system",
        "score_chosen",
        "score_rejected",
        "id",
        "created_at",
        "meta",
        "extra",
        "content_hash",
    ]
    assert result.records.select(
        "source_line", "score_chosen", "score_rejected", "system", "extra"
    ).rows() == [(1, 8.0, 2.5, None, '{"session":"s1"}'), (7, None, None, "Be kind.", None)]
    assert result.quarantine["reason"].to_list() == [reason for _, reason in PREFERENCE_BAD_LINES]
    assert "unknown field(s) present: response" in result.quarantine["detail"][-1], (
        "what an sft record brought instead"
    )
    assert result.lines_read == 7


def test_a_preference_parquet_file_is_read_row_by_row():
    from pipeline_assets.lib.formats import PREFERENCE

    buffer = io.BytesIO()
    pl.DataFrame([pair(1), pair(2, chosen=""), pair(3, score_rejected=None)]).write_parquet(buffer)
    result = read_landing_file("p.parquet", buffer.getvalue(), None, PREFERENCE)
    assert result.records.select("id", "score_rejected").rows() == [("p1", 2.5), ("p3", None)]
    assert result.quarantine.select("source_line", "reason").rows() == [(2, "empty_field:chosen")]


def test_a_pairs_content_hash_covers_both_answers():
    from pipeline_assets.lib.formats import PREFERENCE

    hashes = (
        read_landing_file(
            "p.jsonl",
            jsonl_bytes([pair(1), pair(1, rejected="Another answer."), pair(1)]),
            None,
            PREFERENCE,
        )
        .records["content_hash"]
        .to_list()
    )
    assert hashes[0] == hashes[2] != hashes[1]
