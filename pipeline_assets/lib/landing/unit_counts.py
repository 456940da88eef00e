"""How many units (lines, rows, or the file itself) a landing file holds, counted without the
parser.

Bronze's accounting check compares this count with the rows that reached bronze and quarantine,
so the two must not share code: lines are the newline bytes of the decompressed stream, counted
chunk by chunk (memory bounded by the chunk), and Parquet rows come from the file's footer.

The unit rules are the landing contract's: a line that ends the stream without a newline is a
line; a compressed stream that breaks off leaves one more unit (what is left of its last line);
a file that cannot be decoded at all, or is not a landing format, is one unit.
"""

from __future__ import annotations

import io
import zlib

import pyarrow.parquet as pq
import zstandard

_CHUNK = 1 << 20


def count_units(name: str, data: bytes) -> int:
    if name.endswith(".parquet"):
        return _parquet_rows(data)
    if name.endswith(".jsonl"):
        return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if name.endswith(".jsonl.gz"):
        return _count_stream(_gunzip_chunks(data))
    if name.endswith(".jsonl.zst"):
        return _count_stream(_unzstd_chunks(data))
    return 1


def _parquet_rows(data: bytes) -> int:
    try:
        return pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
    except Exception:  # no readable footer: the file is one unit
        return 1


def _count_stream(chunks) -> int:
    newlines, last = 0, b""
    try:
        for chunk in chunks:
            if chunk:
                newlines, last = newlines + chunk.count(b"\n"), chunk[-1:]
    except (EOFError, OSError, zlib.error, zstandard.ZstdError):
        return (
            newlines + 1 if last else 1
        )  # the broken tail is one more unit; nothing decoded: the file
    return newlines + (1 if last not in (b"", b"\n") else 0)


def _gunzip_chunks(data: bytes):
    yield from _members(data, lambda: zlib.decompressobj(wbits=31), "gzip member")


def _unzstd_chunks(data: bytes):
    yield from _members(data, lambda: zstandard.ZstdDecompressor().decompressobj(), "zstd frame")


def _members(data: bytes, new_inflater, what: str):
    """Decompressed chunks of every member (gzip) or frame (zstd) in turn."""
    view, position = memoryview(data), 0
    while position < len(data):
        inflater, consumed = new_inflater(), 0
        while not inflater.eof and position + consumed < len(data):
            piece = view[position + consumed : position + consumed + _CHUNK]
            consumed += len(piece)
            yield inflater.decompress(piece)
        if not inflater.eof:
            raise EOFError(f"{what} cut short")
        position += consumed - len(inflater.unused_data)


def complete_lines(name: str, data: bytes) -> int:
    """Newline-ended lines of a JSON-lines file whose stream decodes whole; 0 for anything else."""
    if name.endswith(".jsonl"):
        return data.count(b"\n")
    chunks = (
        _gunzip_chunks(data)
        if name.endswith(".jsonl.gz")
        else _unzstd_chunks(data)
        if name.endswith(".jsonl.zst")
        else ()
    )
    try:
        return sum(chunk.count(b"\n") for chunk in chunks)
    except (EOFError, OSError, zlib.error, zstandard.ZstdError):
        return 0
