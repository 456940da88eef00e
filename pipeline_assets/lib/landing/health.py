"""Statistics the bronze checks judge: quarantine rates, schema-drift hints, rows per input MB."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping

import orjson
import polars as pl

from pipeline_assets.lib.formats import FORMATS, SFT, format_named
from pipeline_assets.lib.landing.redelivery import ALREADY_INGESTED

# A file set aside whole, or cut short: how many of its lines were lost is unknown, so it blocks
# its batch whatever share of the batch's lines it is.
WHOLE_FILE_REASONS = ("unreadable_file", "truncated_file", "unsupported_format")


def quarantine_rates(records: pl.DataFrame, quarantine: pl.DataFrame) -> pl.DataFrame:
    """Per source: lines, quarantined, rate and the most frequent reason. Lines an appended
    export delivered again are neither: they were judged with the version that first held them."""
    quarantine = quarantine.filter(pl.col("reason") != ALREADY_INGESTED)
    accepted = records.group_by("source").agg(accepted=pl.len())
    rejected = quarantine.group_by("source").agg(quarantined=pl.len())
    top_reason = (
        quarantine.group_by("source", "reason")
        .agg(n=pl.len())
        .sort(["source", "n", "reason"], descending=[False, True, False])
        .group_by("source", maintain_order=True)
        .agg(top_reason=pl.col("reason").first())
    )
    return (
        accepted.join(rejected, on="source", how="full", coalesce=True)
        .join(top_reason, on="source", how="left")
        .with_columns(pl.col("accepted", "quarantined").fill_null(0).cast(pl.Int64))
        .with_columns(lines=pl.col("accepted") + pl.col("quarantined"))
        .with_columns(rate=pl.col("quarantined") / pl.col("lines"))
        .select("source", "lines", "accepted", "quarantined", "rate", "top_reason")
        .sort("source")
    )


def unreadable_files(quarantine: pl.DataFrame) -> pl.DataFrame:
    """One row per file that could not be read whole: source, source_file, reason, detail."""
    return (
        quarantine.filter(pl.col("reason").is_in(WHOLE_FILE_REASONS))
        .group_by("source", "source_file", maintain_order=True)
        .agg(pl.col("reason").first(), pl.col("detail").first())
        .sort("source_file")
    )


def unaccounted_files(
    lines_counted: dict[str, int], records: pl.DataFrame, quarantine: pl.DataFrame
) -> pl.DataFrame:
    """Files whose counted lines differ from the rows that reached bronze and quarantine:
    source_file, lines_counted, rows (both tables), difference (counted - rows)."""
    rows = (
        pl.concat([records.select("source_file"), quarantine.select("source_file")])
        .group_by("source_file")
        .agg(rows=pl.len())
    )
    counted = pl.DataFrame(
        {"source_file": list(lines_counted), "lines_counted": list(lines_counted.values())},
        schema={"source_file": pl.String, "lines_counted": pl.Int64},
    )
    return (
        counted.join(rows, on="source_file", how="full", coalesce=True)
        .with_columns(pl.col("lines_counted", "rows").fill_null(0).cast(pl.Int64))
        .with_columns(difference=pl.col("lines_counted") - pl.col("rows"))
        .filter(pl.col("difference") != 0)
        .sort("source_file")
    )


def schema_drift_hints(
    quarantine: pl.DataFrame, formats: Mapping[str, str] | None = None
) -> list[dict]:
    """For lines quarantined for a missing field: what most likely happened, per source and field.

    - The lines carry another record format's fields (a preference file, prompt/chosen/rejected,
      landed in an sft source, or the other way round): the fix is the source's format in
      ``PIPELINE_SOURCE_FORMATS``, not a field mapping. ``formats``: each source's format (sft
      unless named).
    - Else a renamed field: a source that renamed ``response`` to ``completion`` shows as
      ``missing_field:response`` with ``completion`` present on (nearly) every such line.
    """
    formats = dict(formats or {})
    missing = quarantine.filter(pl.col("reason").str.starts_with("missing_field:"))
    counts: Counter = Counter()
    totals: Counter = Counter()
    shaped: Counter = Counter()
    for source, reason, raw in missing.select("source", "reason", "raw").iter_rows():
        field = reason.split(":", 1)[1]
        keys = _keys(raw)
        own = format_named(formats.get(source, SFT.name))
        totals[(source, field)] += 1
        for other in (f for f in FORMATS.values() if f is not own and f.looks_like(keys)):
            shaped[(source, field, other.name)] += 1
        for key in keys - own.known:
            counts[(source, field, key)] += 1
    hints = []
    for (source, field), total in sorted(totals.items()):
        like = [(n, name) for (s, f, name), n in shaped.items() if (s, f) == (source, field)]
        candidates = [(n, key) for (s, f, key), n in counts.items() if (s, f) == (source, field)]
        if like and max(like)[0] * 2 > total:  # most of these lines are another format's records
            n, name = max(like)
            hints.append(
                {
                    "source": source,
                    "missing_field": field,
                    "record_format": name,
                    "lines": total,
                    "lines_of_that_format": n,
                    "fix": fix_format(source, name),
                }
            )
        elif candidates:
            n, key = max(candidates)
            hints.append(
                {
                    "source": source,
                    "missing_field": field,
                    "unknown_field": key,
                    "lines": total,
                    "lines_with_unknown_field": n,
                    "fix": fix_mapping(source, key, field),
                }
            )
    return hints


def fix_mapping(source: str, theirs: str, ours: str) -> str:
    return "PIPELINE_FIELD_MAPPINGS='" + json.dumps({source: {theirs: ours}}) + "'"


def fix_format(source: str, record_format: str) -> str:
    return "PIPELINE_SOURCE_FORMATS='" + json.dumps({source: record_format}) + "'"


def _keys(raw: str) -> set[str]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return set()
    return set(obj) if isinstance(obj, dict) else set()


def rows_per_mb(rows: pl.DataFrame, sizes: pl.DataFrame) -> pl.DataFrame:
    """Per (batch_id, source): bronze rows per MB of landing input.

    ``rows`` has batch_id, source (one row per record, and one per line an appended export
    delivered again, whose bytes the file's size includes); ``sizes`` has batch_id, source, size.
    """
    counted = rows.group_by("batch_id", "source").agg(rows=pl.len())
    input_mb = sizes.group_by("batch_id", "source").agg(input_mb=pl.col("size").sum() / 1e6)
    return (
        input_mb.join(counted, on=["batch_id", "source"], how="left")
        .with_columns(pl.col("rows").fill_null(0))
        .with_columns(rows_per_mb=pl.col("rows") / pl.col("input_mb"))
    )
