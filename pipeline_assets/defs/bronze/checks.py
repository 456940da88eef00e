"""Asset checks on bronze, per ingest batch: contract and quarantine rate block; volume and
freshness warn."""

import warnings
from datetime import datetime, timezone

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetRecordsFilter,
    DagsterInstance,
    MetadataValue,
    PreviewWarning,
    asset_check,
)

from pipeline_assets.contracts import QuarantineRecord
from pipeline_assets.defs.bronze.policy import IngestPolicy
from pipeline_assets.defs.check_helpers import (
    batch_contract_check,
    batch_of,
    trailing_median_result,
)
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.keys import BRONZE_QUARANTINE, BRONZE_RECORDS
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.partitions import ingest_batches, read_batch_manifest
from pipeline_assets.defs.retries import refusal
from pipeline_assets.lib.drift import against_trailing_median
from pipeline_assets.lib.landing.health import (
    WHOLE_FILE_REASONS,
    quarantine_rates,
    rows_per_mb,
    schema_drift_hints,
    unaccounted_files,
    unreadable_files,
)
from pipeline_assets.lib.landing.redelivery import ALREADY_INGESTED
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource

# Partitioned checks are a Dagster preview feature, chosen on purpose
# (docs/architecture.md, "Decisions").
warnings.filterwarnings(
    "ignore", category=PreviewWarning, message=".*partitions_def on an AssetCheckSpec"
)


_RECORD_TABLES = tuple(
    tables.bronze.path[1] for tables in FORMAT_TABLES
)  # every accepted line is in one of them


def _batch(lake: LakeResource, name: str, batch_id: str) -> pl.DataFrame:
    return batch_of(lake, "bronze", name, batch_id)


def _accepted(lake: LakeResource, batch_id: str, columns: tuple[str, ...]) -> pl.DataFrame:
    """The batch's accepted records of every format (these columns of them); a lake written before
    bronze/preference_records existed has only bronze/records."""
    records, *others = (
        lake.read("bronze", name, where=pl.col("batch_id") == batch_id) for name in _RECORD_TABLES
    )
    if records is None:
        raise refusal("bronze/records does not exist yet: materialize it first")
    return pl.concat([frame.select(columns) for frame in (records, *others) if frame is not None])


def _accepted_scan(lake: LakeResource, columns: tuple[str, ...]) -> pl.LazyFrame:
    """Every format's accepted records (these columns), lazily, over every batch."""
    return pl.concat(
        [
            scan.select(columns)
            for name in _RECORD_TABLES
            if (scan := lake.scan("bronze", name)) is not None
        ]
    )


@asset_check(
    asset=BRONZE_RECORDS,
    name="quarantine_rate",
    blocking=True,
    partitions_def=ingest_batches,
    additional_deps=[BRONZE_QUARANTINE],
    description="No source has more than the allowed share of its lines quarantined in this batch.",
)
def bronze_quarantine_rate(
    context: AssetCheckExecutionContext,
    lake: LakeResource,
    landing: LandingResource,
    ingest_policy: IngestPolicy,
) -> AssetCheckResult:
    batch_id = context.partition_key
    quarantine = _batch(lake, "quarantine", batch_id)
    superseded = _superseded_files(lake, landing, batch_id) & set(
        unreadable_files(quarantine)["source_file"]
    )
    quarantine = quarantine.filter(
        ~(pl.col("source_file").is_in(superseded) & pl.col("reason").is_in(WHOLE_FILE_REASONS))
    )
    rates = quarantine_rates(_accepted(lake, batch_id, ("source",)), quarantine)
    limit = ingest_policy.max_quarantine_rate
    over = rates.filter(pl.col("rate") > limit)
    hints = {
        h["source"]: h
        for h in schema_drift_hints(
            quarantine.filter(pl.col("source").is_in(over["source"])), landing.formats_by_source
        )
    }
    unreadable = unreadable_files(quarantine)
    messages = [_unreadable_message(row) for row in unreadable.iter_rows(named=True)]
    messages += [
        _over_limit_message(row, limit, hints.get(row["source"]))
        for row in over.iter_rows(named=True)
    ]
    passed = over.is_empty() and unreadable.is_empty()
    if superseded:
        messages.append(
            f"not read whole, but not judged here: {', '.join(sorted(superseded))} (a later "
            "version was registered in a later batch)"
        )
    return AssetCheckResult(
        passed=passed,
        severity=AssetCheckSeverity.ERROR,
        description="; ".join(messages)
        if messages
        else f"every source at or under {limit:.0%} quarantined",
        metadata={
            "max_quarantine_rate": limit,
            "worst_rate": float(rates["rate"].max() or 0.0),
            "rates_by_source": table_metadata(rates),
            "unreadable_files": table_metadata(unreadable),
            "schema_drift_hints": MetadataValue.json(list(hints.values())),
        },
    )


def _superseded_files(lake: LakeResource, landing: LandingResource, batch_id: str) -> set[str]:
    """Files of this batch that a later batch registered again. A good copy landed after a broken
    one is judged with that batch, so the broken version's loss no longer holds this batch back (the
    lines it did yield are still judged here)."""
    manifest = read_batch_manifest(lake)
    here = manifest.filter(pl.col("batch_id") == batch_id)["uri"]
    later = manifest.filter((pl.col("batch_id") > batch_id) & pl.col("uri").is_in(here.implode()))[
        "uri"
    ]
    return {landing.relative_name(uri) for uri in later}


def _unreadable_message(row: dict) -> str:
    return (
        f"source '{row['source']}': file {row['source_file']} was not read whole ({row['reason']}: "
        f"{row['detail']}); how many of its lines were lost is unknown, so the batch waits: land a "
        "good copy of the file (a new version is registered as a new batch), then materialize this "
        "batch again"
    )


def _over_limit_message(row: dict, limit: float, hint: dict | None) -> str:
    message = (
        f"source '{row['source']}': {row['rate']:.1%} of {row['lines']} lines quarantined "
        f"(limit {limit:.0%}), mostly {row['top_reason']}"
    )
    if hint and "record_format" in hint:
        message += (
            f"; {hint['lines_of_that_format']} of the {hint['lines']} lines missing "
            f"'{hint['missing_field']}' have every field of the {hint['record_format']} record "
            f"format: if this source sends {hint['record_format']} records, set {hint['fix']} "
            "(with the other sources' formats) and materialize this batch again"
        )
    elif hint:
        message += (
            f"; field '{hint['missing_field']}' is missing and unknown field "
            f"'{hint['unknown_field']}' is present on {hint['lines_with_unknown_field']} of those "
            f"lines: if it is the same field, set {hint['fix']} and materialize this batch again"
        )
    return message


@asset_check(
    asset=BRONZE_RECORDS,
    name="accounting",
    blocking=True,
    partitions_def=ingest_batches,
    additional_deps=[BRONZE_QUARANTINE],
    description="Every file's lines, counted from its bytes without the parser, are rows of bronze "
    "or quarantine.",
)
def bronze_accounting(context: AssetCheckExecutionContext, lake: LakeResource) -> AssetCheckResult:
    batch_id = context.partition_key
    counted = _lines_counted(context.instance, batch_id)
    off = unaccounted_files(
        counted, _accepted(lake, batch_id, ("source_file",)), _batch(lake, "quarantine", batch_id)
    )
    return AssetCheckResult(
        passed=off.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        description="; ".join(
            f"{r['source_file']}: {r['lines_counted']} lines in the file, {r['rows']} rows in "
            "bronze and quarantine"
            for r in off.iter_rows(named=True)
        )
        or f"all {sum(counted.values())} lines of {len(counted)} file(s) are rows of bronze or "
        "quarantine",
        metadata={
            "files": len(counted),
            "lines_counted": sum(counted.values()),
            "unaccounted": table_metadata(off),
        },
    )


def _lines_counted(instance: DagsterInstance, batch_id: str) -> dict[str, int]:
    """The per-file line counts the batch's newest bronze materialization recorded."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=BRONZE_RECORDS, asset_partitions=[batch_id]), limit=1
    ).records
    if not records:
        raise refusal(f"bronze/records has no materialization for batch {batch_id}")
    return records[0].asset_materialization.metadata["lines_counted_by_file"].value


@asset_check(
    asset=BRONZE_RECORDS,
    name="volume",
    partitions_def=ingest_batches,
    description="Each source's rows per input MB is within tolerance of its trailing median.",
)
def bronze_volume(
    context: AssetCheckExecutionContext, lake: LakeResource, ingest_policy: IngestPolicy
) -> AssetCheckResult:
    batch_id = context.partition_key
    upto = pl.col("batch_id") <= batch_id
    redelivered = lake.scan("bronze", "quarantine").filter(
        upto & (pl.col("reason") == ALREADY_INGESTED)
    )
    rows = pl.concat(
        [
            scan.filter(upto).select("batch_id", "source")
            for scan in (_accepted_scan(lake, ("batch_id", "source")), redelivered)
        ]
    ).collect()
    sizes = read_batch_manifest(lake).filter(pl.col("batch_id") <= batch_id)
    judged = against_trailing_median(
        rows_per_mb(rows, sizes), batch_id, "rows_per_mb", ingest_policy.trailing_batches
    )
    return trailing_median_result(
        judged, ingest_policy.volume_tolerance, "rows/MB", "rows_per_mb_by_source"
    )


@asset_check(
    asset=BRONZE_RECORDS,
    name="freshness",
    partitions_def=ingest_batches,
    description="Each source's newest record (created_at, else ingested_at) is within the "
    "freshness SLA.",
)
def bronze_freshness(
    context: AssetCheckExecutionContext, lake: LakeResource, ingest_policy: IngestPolicy
) -> AssetCheckResult:
    newest = (
        _accepted_scan(lake, ("batch_id", "source", "created_at", "ingested_at"))
        .filter(pl.col("batch_id") <= context.partition_key)
        .group_by("source")
        .agg(newest=pl.col("created_at").max().fill_null(pl.col("ingested_at").max()))
        .collect()
    )
    now = datetime.now(timezone.utc)
    ages = newest.with_columns(
        age_hours=(pl.lit(now) - pl.col("newest")).dt.total_seconds() / 3600
    ).sort("source")
    sla = ingest_policy.freshness_sla_hours
    stale = ages.filter(pl.col("age_hours") > sla)
    return AssetCheckResult(
        passed=stale.is_empty(),
        severity=AssetCheckSeverity.WARN,
        description="; ".join(
            f"source '{r['source']}': newest record is {r['age_hours']:.1f} h old (SLA {sla:g} h)"
            for r in stale.iter_rows(named=True)
        )
        or f"every source has a record newer than {sla:g} h",
        metadata={
            "sla_hours": sla,
            "age_by_source": table_metadata(ages.with_columns(pl.col("newest").cast(pl.String))),
        },
    )


bronze_checks = [
    *(batch_contract_check(tables.bronze, tables.bronze_contract) for tables in FORMAT_TABLES),
    batch_contract_check(BRONZE_QUARANTINE, QuarantineRecord),
    bronze_quarantine_rate,
    bronze_accounting,
    bronze_volume,
    bronze_freshness,
]
