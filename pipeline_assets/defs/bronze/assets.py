"""bronze/records and bronze/quarantine: one ingest batch of landing files, contract-checked."""


from datetime import datetime, timezone
from pathlib import PurePosixPath

import polars as pl
from dagster import AssetExecutionContext, AssetSpec, MaterializeResult, multi_asset

from pipeline_assets.contracts import BronzeRecord, QuarantineRecord, conform, polars_schema, validate
from pipeline_assets.defs.keys import BRONZE_QUARANTINE, BRONZE_RECORDS
from pipeline_assets.defs.landing.registry import MANIFEST_TABLE, batch_files
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.retries import TRANSIENT
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.lib.landing_files import FileReadResult, read_landing_file, rejected_file, with_provenance
from pipeline_assets.lib.sizing import text_chars
from pipeline_assets.resources import LakeResource, LandingResource, sha256_hex

_KINDS = {"delta", "polars"}


@multi_asset(
    specs=[
        AssetSpec(
            BRONZE_RECORDS,
            description="Landing records that passed the landing contract, with provenance. "
            "Append-only per ingest batch; re-materializing a batch replaces its rows.",
            group_name="bronze",
            kinds=_KINDS,
        ),
        AssetSpec(
            BRONZE_QUARANTINE,
            description="Every landing line that failed the contract, verbatim, with a reason code and detail.",
            group_name="bronze",
            kinds=_KINDS,
        ),
    ],
    partitions_def=ingest_batches,
    retry_policy=TRANSIENT,  # landing reads and Delta writes, on S3 too
)
def bronze(context: AssetExecutionContext, lake: LakeResource, landing: LandingResource):
    stopwatch = Stopwatch()
    batch_id = context.partition_key
    manifest_version = lake.version(*MANIFEST_TABLE)
    files = batch_files(lake, batch_id, version=manifest_version)
    if files.is_empty():
        raise ValueError(f"ingest batch {batch_id} has no registered landing files (manifest v{manifest_version})")

    ingested_at = datetime.now(timezone.utc)
    record_parts, quarantine_parts, per_file = [], [], []
    input_bytes = 0
    for ordinal, entry in enumerate(files.iter_rows(named=True)):
        result, size = _read_registered_file(landing, entry)
        input_bytes += size
        source_file = landing.relative_name(entry["uri"])
        records, quarantined = with_provenance(
            result,
            source=entry["source"],
            source_file=source_file,
            file_ordinal=ordinal,
            batch_id=batch_id,
            ingested_at=ingested_at,
        )
        record_parts.append(records)
        quarantine_parts.append(quarantined)
        per_file.append(_file_accounting(source_file, entry["source"], result))
        context.log.info(_describe(source_file, result))

    records = validate(conform(pl.concat(record_parts), BronzeRecord), BronzeRecord)
    quarantine = validate(conform(pl.concat(quarantine_parts), QuarantineRecord), QuarantineRecord)
    records_commit = lake.replace_partition("bronze", "records", records, column="batch_id", value=batch_id)
    quarantine_commit = lake.replace_partition("bronze", "quarantine", quarantine, column="batch_id", value=batch_id)

    accounting = pl.DataFrame(per_file)
    shared = {
        "batch_id": batch_id,
        "files": len(per_file),
        "lines_read": int(accounting["lines_read"].sum()),
        "input_chars": text_chars(records),
        "per_file_accounting": table_metadata(accounting),
    }
    upstream = {"landing/manifest": manifest_version}
    yield MaterializeResult(
        asset_key=BRONZE_RECORDS,
        metadata={
            **delta_write_metadata(
                records_commit, polars_schema(BronzeRecord),
                upstream_versions=upstream, input_bytes=input_bytes, stopwatch=stopwatch,
            ),
            **shared,
            "rows_by_source": table_metadata(records.group_by("source").len("rows").sort("source")),
        },
    )
    yield MaterializeResult(
        asset_key=BRONZE_QUARANTINE,
        metadata={
            **delta_write_metadata(
                quarantine_commit, polars_schema(QuarantineRecord),
                upstream_versions=upstream, input_bytes=input_bytes, stopwatch=stopwatch,
            ),
            **shared,
            "quarantined_by_reason": table_metadata(
                quarantine.group_by("source", "reason").len("rows").sort("source", "reason")
            ),
        },
    )


def _read_registered_file(landing: LandingResource, entry: dict) -> tuple[FileReadResult, int]:
    """Read the file version the manifest registered; a file that is gone or changed is quarantined."""
    name = PurePosixPath(entry["uri"]).name
    try:
        data = landing.read_bytes(entry["uri"])
    except Exception as exc:  # a missing local file, an S3 error: the batch's accounting must still close
        return rejected_file("unreadable_file", f"cannot read the registered file: {exc}"), 0
    checksum = sha256_hex(data)
    if checksum != entry["checksum"]:
        return rejected_file("unreadable_file", 
            f"bytes changed since registration (sha256 {entry['checksum'][:12]} -> {checksum[:12]}); "
            "the landing sensor registers the new version as a new batch"
        ), len(data)
    return read_landing_file(name, data, landing.mapping_for(entry["source"])), len(data)


def _file_accounting(source_file: str, source: str, result: FileReadResult) -> dict:
    return {
        "source_file": source_file,
        "source": source,
        "lines_read": result.lines_read,
        "bronze_rows": result.records.height,
        "quarantined": result.quarantine.height,
        "balanced": result.lines_read == result.records.height + result.quarantine.height,
    }


def _describe(source_file: str, result: FileReadResult) -> str:
    reasons = result.quarantine.group_by("reason").len().sort("len", descending=True)
    top = ", ".join(f"{r} {n}" for r, n in reasons.iter_rows()) or "none"
    return (
        f"{source_file}: {result.lines_read} lines read, {result.records.height} accepted, "
        f"{result.quarantine.height} quarantined ({top})"
    )
