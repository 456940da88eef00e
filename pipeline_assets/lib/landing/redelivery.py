"""Lines an export delivers again: a landing file that grew by appending starts with every byte of
the version ingested before it, so its first lines are already in bronze under that batch.

They are set aside as ``already_ingested`` (one quarantine row each, pointing at the earlier
version), never parsed again into records, and left out of the quality and volume gates.
"""

from __future__ import annotations

import hashlib

import polars as pl

from pipeline_assets.lib.landing.files import QUARANTINE_SCHEMA, FileReadResult
from pipeline_assets.lib.landing.unit_counts import complete_lines

ALREADY_INGESTED = "already_ingested"


def redelivered_lines(
    name: str, data: bytes, previous_size: int | None, previous_checksum: str | None
) -> int:
    """How many leading lines of ``data`` the earlier version delivered whole: its newline-ended
    lines when ``data`` starts with exactly its bytes, else 0 (the file was rewritten, not
    appended)."""
    if previous_size is None or previous_checksum is None or previous_size > len(data):
        return 0
    prefix = data[:previous_size]
    if hashlib.sha256(prefix).hexdigest() != previous_checksum:
        return 0
    return complete_lines(name, prefix)


def set_aside_redelivered(result: FileReadResult, lines: int, detail: str) -> FileReadResult:
    """Lines 1..``lines`` leave records and quarantine; each becomes one ``already_ingested``
    row."""
    if lines == 0:
        return result
    redelivered = pl.DataFrame(
        {
            "source_line": pl.int_range(1, lines + 1, eager=True),
            "raw": pl.repeat("", lines, eager=True),
            "reason": pl.repeat(ALREADY_INGESTED, lines, eager=True),
            "detail": pl.repeat(detail, lines, eager=True),
        },
        schema=QUARANTINE_SCHEMA,
    )
    fresh = pl.col("source_line") > lines
    return FileReadResult(
        records=result.records.filter(fresh),
        quarantine=pl.concat(
            [redelivered, result.quarantine.filter(fresh | (pl.col("source_line") == 0))]
        ),
        lines_read=result.lines_read,
    )
