"""The fast path for JSON lines and Parquet rows gives exactly what the exact per-line path gives.

Generated files mix clean records (every optional field, ids as numbers, unknown fields, offsets,
escapes, whitespace only Python strips) with a bad line of every reason code and the odd corners of
JSON (duplicate keys, lone surrogates, invalid UTF-8 inside values, numbers orjson reads as floats,
nesting, CRLF, blank lines, a missing last newline): record for record and reason for reason, the
default reader and ``read_landing_file_exact`` must agree.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from datetime import datetime, timezone

import orjson
import polars as pl
import pytest

from pipeline_assets.lib.landing.fast_reader import LineBuffer, split_clean_lines, split_clean_rows
from pipeline_assets.lib.landing.files import read_landing_file, read_landing_file_exact
from pipeline_assets_tests.conftest import jsonl_bytes, record

TEXTS = [
    "How does item 7 work?",
    "  leading and trailing  ",
    "ünïcödé ✓ 中文",
    "tab\there\nand a newline",
    'a "quote" and a \\ backslash',
    "emoji 😀 and \u2028 a line separator",
    "\x1c\x1dx",
    "\u200b",
    "word " * 900,
]
BLANKS = ["", " ", "\t\n", "\x1c\x1f", "\u3000\xa0", "\x85"]  # all strip to nothing in Python
TIMESTAMPS = [
    "2026-11-20T10:00:00Z",
    "2026-11-20T10:00:00+05:30",
    "2026-11-20T10:00:00.5-00:30",
    "2026-11-20T10:00:00.123456+23:59",
    "2024-02-29T00:00:00Z",
    "2026-11-20 10:00:00Z",
    "2026-11-20T10:00:00.1234567Z",
    "2026-11-20T10:00Z",
    "2026-11-20T10:00:00+0530",
    "20261120T100000Z",
    "2026-11-20T10:00:00,5Z",  # forms Python reads but the fast path leaves to the exact one
    "2026-11-20T10:00:00",
    "2026-02-30T00:00:00Z",
    "2026-11-20T24:00:00Z",
    "2026-11-20T23:59:60Z",
    "2026-11-20T10:00:00z",
    "2026-11-20T10:00:00+24:00",
    "last tuesday",
    "",
    "0001-01-01T00:00:00-01:00",
    "9999-12-31T23:59:59+01:00",
    "0002-01-01T00:00:00Z",
    "9998-12-30T12:00:00-11:00",
    "２０２６-11-20T10:00:00Z",
    "0001-01-01T12:00:00+01:00",
    "9999-12-31T12:00:00-01:00",
    "0000-12-31T23:00:00-02:00",
]
IDS = ["r1", "", 17, -3, 0, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 1.5, True, None, [1]]
METAS = [
    {"annotator": "a7", "label_confidence": 0.99},
    {"nested": {"deep": [1, 2.5, None, "ü"]}},
    {},
    {"big": 10**30, "e": 1e20, "f": 1.0},
    None,
    "not an object",
    [1, 2],
    3,
]
UNKNOWN_NAMES = ["session_id", "url", "tags", "x-y", "u0", "ñame", "completion"]
UNKNOWN_VALUES = ["s-1", 'ü"\\', 3, 2.5, None, True, [1, {"a": None}], {"k": "v"}, 10**25]
RAW_BAD_LINES = [
    b"",
    b"   ",
    b"\r",
    b"\t",
    b'{"prompt": "cut in the mid',
    b"[1, 2]",
    b"42",
    b'"a string"',
    b"null",
    b'\xef\xbb\xbf{"prompt": "p", "response": "r"}',
    b'{"prompt": "p", "response": "r"} trailing',
    b'{"prompt": "p", "response": "r"}{"prompt": "p", "response": "r"}',
    b'{"prompt": "p", "response": NaN}',
    b'{"prompt": "p\xff", "response": "r"}',
    b'{"prompt": "p", "response": "r", "meta": {"a": "\xfe"}}',
    b'{"prompt": "p", "response": "r", "session_id": "\xc3"}',
    b'{"prompt": "p", "response": "r", "session_id": "a\x01b"}',
    b'{"prompt": "p", "response": "r", "session_id": "\xed\xa0\x80"}',
    b'{"prompt": "p", "response": "r", "url": "\\u00e9\\/"}',
    b'{"prompt": "\\ud800", "response": "r"}',
    b'{"prompt": "p", "response": "r", "meta": {"a": "\\udc00"}}',
    b'{"prompt": "p", "response": "r",}',
    b'{"prompt": "p", "response": "r", "meta": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    b'{"prompt": "p", "response": "r", "meta": {"a": ' + b"[" * 200 + b"]" * 200 + b"}}",
    b'{"prompt": "p", "response": "r", "meta": {"a": ' + b"[" * 253 + b"]" * 253 + b"}}",
    b'{"prompt": "p", "response": "r", "tags": ' + b"[" * 253 + b"]" * 253 + b"}",
    b'{"prompt": "a", "prompt": "b", "response": "r"}',
    b'{"prompt": "", "response": "r", "prompt": "p"}',
    b'{"prompt": "p", "response": "r", "meta": {"a": 1}, "meta": null}',
    b'{"prompt": "p", "response": "r", "x": 1, "x": 2, "y": 3}',
    b'{"pr\\u006fmpt": "p", "response": "r"}',
    b'{"prompt": "p", "response": "r", "id": -0}',
    b'{"prompt": "p", "response": "r", "id": 1e3}',
    b'{"prompt": "p", "response": "r", "created_at": null, "system": null, "meta": null, '
    b'"id": null}',
    b'{"prompt": "p", "response": "r", "\\u00f1": 1}',
    b'{"prompt": "p", "response": "r", "\xff": 1}',
]


def _value(rng: random.Random, choices: list):
    return rng.choice(choices)


def _random_record(rng: random.Random, mapped: bool) -> dict:
    fields = {}
    text_pool = TEXTS if rng.random() < 0.85 else TEXTS + BLANKS + [7, None, ["x"], True]
    fields["completion" if mapped and rng.random() < 0.7 else "response"] = _value(rng, text_pool)
    if rng.random() < 0.97:
        fields["prompt"] = _value(rng, text_pool)
    for name, pool, share in (
        ("system", TEXTS + [None, 1], 0.3),
        ("id", IDS, 0.5),
        ("created_at", TIMESTAMPS + [None, 1700000000], 0.6),
        ("meta", METAS, 0.4),
    ):
        if rng.random() < share:
            fields[name] = _value(rng, pool)
    for name in rng.sample(UNKNOWN_NAMES, k=rng.choice([0, 0, 1, 1, 2, 3])):
        fields[name] = _value(rng, UNKNOWN_VALUES)
    keys = list(fields)
    rng.shuffle(keys)
    return {key: fields[key] for key in keys}


def _serialize(rng: random.Random, obj: dict) -> bytes:
    style = rng.randrange(4)
    if style == 0:
        return json.dumps(
            obj, ensure_ascii=False, separators=(",", ":")
        ).encode()  # as orjson writes
    if style == 1:
        return json.dumps(obj, ensure_ascii=True).encode()  # \uXXXX escapes, surrogate pairs
    if style == 2:
        return json.dumps(obj, ensure_ascii=False, indent=None, separators=(" , ", " : ")).encode()
    duplicated = next(iter(obj), None)  # a key given twice: the last value counts
    if duplicated is None:
        return b"{}"
    first = json.dumps({duplicated: _value(rng, TEXTS + [None, 3])})[1:-1]
    return ("{" + first + ", " + json.dumps(obj)[1:]).encode()


def _random_file(seed: int) -> tuple[bytes, dict[str, str]]:
    rng = random.Random(seed)
    mapped = rng.random() < 0.25
    lines = []
    for _ in range(rng.randrange(1, 60)):
        if rng.random() < 0.15:
            line = _value(rng, RAW_BAD_LINES)
        else:
            line = _serialize(rng, _random_record(rng, mapped))
        if rng.random() < 0.1:
            line += b"\r"
        lines.append(line)
    data = b"\n".join(lines) + (b"\n" if rng.random() < 0.8 else b"")
    return data, ({"completion": "response"} if mapped else {})


# Lines past what bronze stores (orjson writes no deeper than 254 levels; a UTC offset can push year
# 1 or 9999 out of datetime's range): the fast path leaves them to the exact path, which quarantines
# them, so either path gives the same reason.
PAST_WHAT_BRONZE_STORES = [
    (
        b'{"prompt": "p", "response": "r", "meta": {"a": ' + b"[" * 254 + b"]" * 254 + b"}}",
        "too_deep:meta",
    ),
    (
        b'{"prompt": "p", "response": "r", "meta": {"a": ' + b"[" * 1021 + b"]" * 1021 + b"}}",
        "too_deep:meta",
    ),
    (
        b'{"prompt": "p", "response": "r", "tags": ' + b"[" * 254 + b"]" * 254 + b"}",
        "too_deep:extra",
    ),
    (
        b'{"prompt": "p", "response": "r", "created_at": "0001-01-01T00:00:00+01:00"}',
        "invalid_timestamp:created_at",
    ),
    (
        b'{"prompt": "p", "response": "r", "created_at": "9999-12-31T23:59:59-01:00"}',
        "invalid_timestamp:created_at",
    ),
]


@pytest.mark.parametrize("line, reason", PAST_WHAT_BRONZE_STORES)
def test_a_line_past_what_bronze_stores_is_quarantined_alike_on_both_paths(line, reason):
    data = jsonl_bytes([record(1), line])
    fast, exact = read_landing_file("f.jsonl", data), read_landing_file_exact("f.jsonl", data)
    assert fast.quarantine.equals(exact.quarantine) and fast.records.equals(exact.records)
    assert exact.quarantine["reason"].to_list() == [reason] and exact.records.height == 1


@pytest.mark.parametrize("seed", range(400))
def test_fast_path_matches_the_exact_path(seed):
    data, mapping = _random_file(seed)
    name = "f.jsonl"
    if seed % 10 == 0:
        name, data = "f.jsonl.gz", gzip.compress(data, mtime=0)
        if seed % 20 == 0:
            data = data[: len(data) * 3 // 4]  # cut short: a truncated_file line at the end
    fast, exact = (
        read_landing_file(name, data, mapping),
        read_landing_file_exact(name, data, mapping),
    )
    assert fast.records.equals(exact.records)
    assert fast.quarantine.equals(exact.quarantine)
    assert fast.lines_read == exact.lines_read


def test_clean_lines_take_the_fast_path_only():
    rng = random.Random(7)
    rows = [
        record(
            i,
            id=rng.choice(["r1", 17, None]),
            system=rng.choice(["sys", None]),
            created_at=rng.choice(TIMESTAMPS[:5]),
            meta=rng.choice(METAS[:3]),
            session_id=f"s{i % 5}",
        )
        for i in range(200)
    ]
    lines = jsonl_bytes(rows).split(b"\n")[:-1]
    clean = split_clean_lines(lines)
    assert clean.other_lines == []
    assert clean.records.height == 200
    assert clean.records.equals(
        read_landing_file_exact("f.jsonl", jsonl_bytes(rows)).records.drop("content_hash")
    )


def test_only_the_suspect_lines_take_the_exact_path():
    lines = jsonl_bytes(
        [record(1), b'{"prompt": 7}', record(3), b"", record(5, created_at="2026-11-20 10:00:00Z")]
    )
    assert split_clean_lines(lines.split(b"\n")[:-1]).other_lines == [2, 4, 5]


def test_a_mapped_field_takes_the_fast_path():
    lines = [
        orjson.dumps({"prompt": "p", "completion": "c"}),
        orjson.dumps({"prompt": "p", "response": "r", "completion": "c"}),
    ]
    clean = split_clean_lines(lines, {"completion": "response"})
    assert clean.other_lines == []
    assert clean.records.select("response", "extra").rows() == [
        ("c", None),
        ("r", '{"completion":"c"}'),
    ]


ONE_EXTRA_FIELD_VALUES = [
    b'"plain"',
    '"ü ✓"'.encode(),
    b'"a\\u00e9"',
    b'"a\\"b"',
    b'"a\\/b"',
    b'"a\x01b"',
    b'"a\x7fb"',
    b'"\xff"',
    b'"\xed\xa0\x80"',
    b'"a\\ud800"',
    b'""',
    b"1.0",
    b"1e2",
    b"-0",
    b"null",
    b"true",
    b'{"a": 1}',
    b"[1 ,2]",
]


@pytest.mark.parametrize("value", ONE_EXTRA_FIELD_VALUES)
def test_one_extra_field_is_written_as_the_exact_path_writes_it(value):
    """A file whose lines bring one unknown field takes a shortcut for plain strings:
    same result."""
    data = b"".join(
        b'{"prompt": "p", "response": "r", "session_id": ' + v + b"}\n"
        for v in (b'"s-1"', value, b'"s-1"')
    )
    fast, exact = read_landing_file("f.jsonl", data), read_landing_file_exact("f.jsonl", data)
    assert fast.records.equals(exact.records)
    assert fast.quarantine.equals(exact.quarantine)


PARQUET_TEXTS = TEXTS + BLANKS + [None, 'a "quote"\\ \x01 control \x7f', "\u2028"]


def _random_parquet(seed: int) -> tuple[bytes, dict[str, str]]:
    """A Parquet file of text columns (the fast path's), now and then with a column of a type
    only the exact path reads (booleans, floats, timestamps, a struct meta, integer extras)."""
    rng = random.Random(seed)
    height = rng.randrange(1, 40)
    mapped = rng.random() < 0.2

    def texts(pool):
        return [rng.choice(pool) for _ in range(height)]

    def mostly_clean_texts():
        return pl.Series(
            [rng.choice(TEXTS if rng.random() < 0.8 else PARQUET_TEXTS) for _ in range(height)],
            dtype=pl.String,
        )

    columns = {"prompt": mostly_clean_texts(), "response": mostly_clean_texts()}
    if mapped:
        columns["completion"] = mostly_clean_texts()
        if rng.random() < 0.6:
            del columns["response"]
    if rng.random() < 0.05:
        del columns["prompt"]
    optional = {
        "system": lambda: pl.Series(texts(TEXTS + [None]), dtype=pl.String),
        "id": lambda: rng.choice(
            [
                pl.Series(texts(["r1", "", None]), dtype=pl.String),
                pl.Series([rng.randrange(-(2**63), 2**63) for _ in range(height)], dtype=pl.Int64),
                pl.Series([rng.randrange(2**64) for _ in range(height)], dtype=pl.UInt64),
                pl.Series(texts([True, False]), dtype=pl.Boolean),
                pl.Series(texts([1.5, None]), dtype=pl.Float64),
            ]
        ),
        "created_at": lambda: rng.choice(
            [
                pl.Series(texts(TIMESTAMPS + [None]), dtype=pl.String),
                pl.Series(
                    texts([datetime(2026, 11, 1, tzinfo=timezone.utc), None]),
                    dtype=pl.Datetime("us", "UTC"),
                ),
                pl.Series(texts([datetime(2026, 11, 1), None]), dtype=pl.Datetime("us")),
            ]
        ),
        "meta": lambda: rng.choice(
            [
                pl.Series([None] * height, dtype=pl.Null),
                pl.Series(
                    texts([{"a": 1, "b": "x\u00e9"}, {"a": None, "b": None}, None]),
                    dtype=pl.Struct({"a": pl.Int64, "b": pl.String}),
                ),
                pl.Series(texts(["not an object", None]), dtype=pl.String),
                pl.DataFrame({"a": texts(["2.50", None]), "raw": texts([b"\x01", None])})
                .select(pl.struct(pl.col("a").cast(pl.Decimal(10, 2)), "raw"))
                .to_series(),
            ]
        ),
        "url": lambda: pl.Series(texts(PARQUET_TEXTS), dtype=pl.String),
        "tags": lambda: rng.choice(
            [
                pl.Series([None] * height, dtype=pl.Null),
                pl.Series(texts([1, None, -(2**63)]), dtype=pl.Int64),
                pl.Series(texts([0.1, 1e300, float("nan"), None]), dtype=pl.Float64),
                pl.Series(texts([True, None]), dtype=pl.Boolean),
                pl.Series(texts([[1, 2], [], None]), dtype=pl.List(pl.Int64)),
                pl.Series(
                    texts([datetime(2026, 11, 1, 12, tzinfo=timezone.utc), None]),
                    dtype=pl.Datetime("us", "UTC"),
                ),
                pl.Series(texts([datetime(2026, 11, 1, 12), None]), dtype=pl.Datetime("ns")),
                pl.Series(texts([b"\x00\xff", None]), dtype=pl.Binary),
                pl.Series(texts(["1.50", None]), dtype=pl.String).cast(pl.Decimal(10, 2)),
            ]
        ),
    }
    for name in rng.sample(list(optional), k=rng.randrange(len(optional) + 1)):
        columns[name] = optional[name]()
    names = list(columns)
    rng.shuffle(names)
    buffer = io.BytesIO()
    pl.DataFrame({name: columns[name] for name in names}).write_parquet(buffer)
    return buffer.getvalue(), ({"completion": "response"} if mapped else {})


@pytest.mark.parametrize("seed", range(300))
def test_parquet_fast_path_matches_the_exact_path(seed):
    data, mapping = _random_parquet(seed)
    fast, exact = (
        read_landing_file("f.parquet", data, mapping),
        read_landing_file_exact("f.parquet", data, mapping),
    )
    assert fast.records.equals(exact.records)
    assert fast.quarantine.equals(exact.quarantine)
    assert fast.lines_read == exact.lines_read


def test_text_parquet_takes_the_fast_path():
    frame = pl.DataFrame(
        {"id": [1, 2], "prompt": ["p1", " "], "response": ["r1", "r2"], "url": ["u1", None]}
    )
    clean = split_clean_rows(frame)
    assert clean.other_lines == [2]
    assert clean.records.select("id", "extra").rows() == [("1", '{"url":"u1"}')]
    assert (
        split_clean_rows(frame.with_columns(id=pl.lit(True))) is None
    )  # a boolean id: the exact path


@pytest.mark.parametrize("seed", range(200))
def test_a_line_buffer_holds_the_lines_split_gives(seed):
    rng = random.Random(seed)
    text = b"".join(
        rng.choice([b"\n", b"\r\n", b"{", b"}", b"x", b" ", b"\r"])
        for _ in range(rng.randrange(0, 40))
    )
    for keep_tail in (True, False):
        lines = text.split(b"\n")
        tail = lines.pop()
        if keep_tail and tail:
            lines.append(tail)
        buffer = LineBuffer(text, keep_tail=keep_tail)
        assert [buffer[i] for i in range(len(buffer))] == lines
        for start, stop in buffer.object_runs():
            assert bytes(buffer.span(start, stop)) == b"\n".join(lines[start:stop])
        shaped = [i for start, stop in buffer.object_runs() for i in range(start, stop)]
        assert shaped == [
            i
            for i, line in enumerate(lines)
            if len(line.removesuffix(b"\r")) >= 2
            and line[:1] == b"{"
            and line.removesuffix(b"\r")[-1:] == b"}"
        ]


# Lines that start with "{" and end with "}", so they sit in a run decoded in one call, but that a
# run refuses: each must be found, and the run's other lines kept with their own line numbers.
REFUSED_IN_A_RUN = {
    "an unbalanced object, refused only at the next line's {": b'{"prompt": "p", "response": "r", '
    b'"meta": {"a": 1}',
    "two objects on one line": b'{"prompt": "p", "response": "r"} {"prompt": "q", "response": "s"}',
    "invalid UTF-8, which names no byte of the run": b'{"prompt": "p\xff", "response": "r"}',
    "nesting past msgspec's limit": b'{"prompt": "p", "response": "r", "meta": {"a": '
    + b"[" * 1100
    + b"]" * 1100
    + b"}}",
    "a wrong type": b'{"prompt": 7, "response": "r"}',
    "an unknown field first met here": b'{"prompt": "p", "response": "r", "session_id": "s-9"}',
    "a lone surrogate": b'{"prompt": "\\ud800", "response": "r"}',
}


@pytest.mark.parametrize("line", REFUSED_IN_A_RUN.values(), ids=REFUSED_IN_A_RUN.keys())
@pytest.mark.parametrize("at", [0, 1, 6, 63, 64, 99])  # the run is decoded in pieces of 64 lines
def test_a_line_a_run_refuses_is_decided_alone_and_the_rest_of_the_run_kept(line, at):
    lines = [jsonl_bytes([record(i)]).rstrip(b"\n") for i in range(100)]
    lines[at] = line
    data = b"\n".join(lines) + b"\n"
    assert LineBuffer(data).object_runs() == [(0, 100)]
    fast, exact = read_landing_file("f.jsonl", data), read_landing_file_exact("f.jsonl", data)
    assert fast.records.equals(exact.records) and fast.quarantine.equals(exact.quarantine)
    kept = set(exact.records["source_line"])
    assert set(range(1, 101)) - kept <= {at + 1}, "every line but the refused one is kept"
