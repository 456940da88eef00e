"""Counting a landing file's units from its bytes alone, as bronze's accounting check does."""

from __future__ import annotations

import gzip
import io
import random

import orjson
import polars as pl
import pytest
import zstandard

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.landing.unit_counts import complete_lines, count_units


def _lines(n: int, start: int = 0, width: int = 40) -> bytes:
    return b"".join(
        orjson.dumps({"prompt": f"q{start + i}", "response": f"{start + i:x}" * width}) + b"\n"
        for i in range(n)
    )


def _zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize(
    ("name", "data", "units"),
    [
        ("a.jsonl", _lines(5), 5),
        ("a.jsonl", _lines(5)[:-1], 5),  # no newline at the end: still a line
        ("a.jsonl", b"", 0),
        ("a.jsonl", b"\n\n", 2),  # blank lines are units (quarantined as blank_line)
        ("a.jsonl.gz", gzip.compress(_lines(7)) + gzip.compress(_lines(3, 7)), 10),  # two members
        ("a.jsonl.zst", _zst(_lines(4)) + _zst(_lines(4, 4)), 8),  # two frames
        ("a.jsonl.gz", gzip.compress(_lines(50))[:-200], None),  # cut short: as the parser counts
        ("a.jsonl.gz", b"not gzip at all", 1),  # nothing decodes: the file is one unit
        ("a.jsonl.zst", b"not zstd at all", 1),
        ("a.csv", b"prompt,response\n", 1),
        ("a.parquet", b"PAR1 broken", 1),
    ],
)
def test_counts_agree_with_the_parser_on_every_kind_of_file(name, data, units):
    parsed = read_landing_file(name, data)
    assert count_units(name, data) == parsed.records.height + parsed.quarantine.height
    if units is not None:
        assert count_units(name, data) == units


def test_parquet_rows_come_from_the_footer():
    buffer = io.BytesIO()
    pl.DataFrame({"prompt": ["q"] * 12, "response": ["a"] * 12}).write_parquet(
        buffer, row_group_size=5
    )
    assert count_units("p.parquet", buffer.getvalue()) == 12


def test_members_larger_than_a_read_chunk_are_all_counted():
    """Two gzip members of more than a MiB each: every line of the second member counts."""
    rng = random.Random(7)
    first, second = (
        [
            orjson.dumps({"prompt": "q", "response": rng.randbytes(300).hex()}) + b"\n"
            for _ in range(3000)
        ]
        for _ in range(2)
    )
    first, second = b"".join(first), b"".join(second)
    data = gzip.compress(first, compresslevel=1) + gzip.compress(second, compresslevel=1)
    assert len(data) > 2 << 20
    assert count_units("big.jsonl.gz", data) == 6000


def test_complete_lines_count_only_newline_ended_lines_of_a_whole_stream():
    assert complete_lines("a.jsonl", _lines(3) + b'{"prompt": "unfinished') == 3
    assert complete_lines("a.jsonl.gz", gzip.compress(_lines(6))) == 6
    assert complete_lines("a.jsonl.gz", gzip.compress(_lines(6))[:-20]) == 0, (
        "a broken stream proves nothing"
    )
    assert complete_lines("a.parquet", b"PAR1") == 0


def test_the_parser_reads_every_member_of_a_large_multi_member_gzip():
    """The accounting check's count found this: the parser lost the second member's first chunk."""
    rng = random.Random(8)
    members = [
        b"".join(
            orjson.dumps({"prompt": f"q{m}-{i}", "response": rng.randbytes(300).hex()}) + b"\n"
            for i in range(3000)
        )
        for m in range(2)
    ]
    data = b"".join(gzip.compress(member, compresslevel=1) for member in members)
    parsed = read_landing_file("big.jsonl.gz", data)
    assert parsed.quarantine.is_empty() and parsed.records.height == 6000 == count_units(
        "big.jsonl.gz", data
    )
