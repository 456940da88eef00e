"""bronze/<format's table> for each record format (bronze/records, bronze/preference_records) and
bronze/quarantine: one ingest batch of landing files, each read by its source's record format,
contract-checked."""

import time
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import PurePosixPath

import polars as pl
from dagster import (
    AssetExecutionContext,
    AssetSpec,
    Failure,
    MaterializeResult,
    MetadataValue,
    multi_asset,
)

from pipeline_assets.contracts import QuarantineRecord, conform, polars_schema, validate
from pipeline_assets.defs.format_tables import FORMAT_TABLES, SFT_TABLES, FormatTables
from pipeline_assets.defs.keys import BRONZE_QUARANTINE
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.partitions import BATCH_MANIFEST_TABLE, ingest_batches
from pipeline_assets.defs.retries import TRANSIENT, refusal
from pipeline_assets.lib.formats import SFT, RecordFormat, text_chars
from pipeline_assets.lib.landing.batches import earlier_versions
from pipeline_assets.lib.landing.files import (
    FileReadResult,
    read_landing_file,
    rejected_file,
    with_provenance,
)
from pipeline_assets.lib.landing.redelivery import redelivered_lines, set_aside_redelivered
from pipeline_assets.lib.landing.unit_counts import count_units
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingFileGone, LandingResource, sha256_hex

_KINDS = {"delta", "polars"}


def _records_spec(tables: FormatTables) -> AssetSpec:
    return AssetSpec(
        tables.bronze,
        group_name="bronze",
        kinds=_KINDS,
        description=f"The {tables.fmt.about} of the sources whose format is {tables.fmt.name} "
        "(PIPELINE_SOURCE_FORMATS) that passed its landing contract, with provenance. Append-only "
        "per ingest batch; re-materializing a batch replaces its rows.",
    )


@multi_asset(
    specs=[
        *(_records_spec(tables) for tables in FORMAT_TABLES),
        AssetSpec(
            BRONZE_QUARANTINE,
            description="Every landing line that failed the contract, verbatim, with a reason code "
            "and detail.",
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
    manifest_version = lake.version(*BATCH_MANIFEST_TABLE)
    manifest = lake.read(
        *BATCH_MANIFEST_TABLE, version=manifest_version, where=pl.col("batch_id") <= batch_id
    )
    files = (
        pl.DataFrame()
        if manifest is None
        else manifest.filter(pl.col("batch_id") == batch_id).sort("uri")
    )
    if files.is_empty():
        raise refusal(
            f"ingest batch {batch_id} has no registered landing files (manifest "
            f"v{manifest_version})"
        )
    files = files.join(
        earlier_versions(manifest, batch_id), on="uri", how="left"
    )  # what an appended file grew from
    entries = list(files.iter_rows(named=True))
    read = _BatchRead(
        context, batch_id, entries, [landing.relative_name(entry["uri"]) for entry in entries]
    )
    # The sft records of each file are written as they are read: Delta encodes one chunk while the
    # next is parsed.
    commits = {
        SFT: lake.replace_partition_streaming(
            *SFT_TABLES.bronze.path,
            read.record_chunks(_ingest_files(landing, entries, read.source_files)),
            polars_schema(SFT_TABLES.bronze_contract),
            column="batch_id",
            value=batch_id,
            rows_per_group=_BatchRead.CHUNK_ROWS,
        )
    }
    for tables in FORMAT_TABLES:
        if tables.fmt is not SFT:
            commits[tables.fmt] = lake.replace_partition(
                *tables.bronze.path,
                read.held_records(tables.fmt),
                column="batch_id",
                value=batch_id,
                add_columns=True,  # a table written before its contract gained prompt_messages
            )
    quarantine = validate(
        conform(pl.concat(read.quarantine_parts), QuarantineRecord), QuarantineRecord
    )
    quarantine_commit = lake.replace_partition(
        "bronze", "quarantine", quarantine, column="batch_id", value=batch_id
    )

    accounting = pl.DataFrame(read.per_file)
    shared = {
        "batch_id": batch_id,
        "files": len(read.per_file),
        "lines_read": int(accounting["lines_read"].sum()),
        "lines_counted": int(accounting["lines_counted"].sum()),
        "already_ingested": int(accounting["already_ingested"].sum()),
        "lines_counted_by_file": MetadataValue.json(
            dict(zip(accounting["source_file"], accounting["lines_counted"]))
        ),
        "per_file_accounting": table_metadata(accounting),
    }
    upstream = {"landing/manifest": manifest_version}
    for tables in FORMAT_TABLES:
        record_format = tables.fmt
        rows = read.rows_by_source[record_format.name]
        yield MaterializeResult(
            asset_key=tables.bronze,
            metadata={
                **delta_write_metadata(
                    commits[record_format],
                    polars_schema(tables.bronze_contract),
                    upstream_versions=upstream,
                    input_bytes=read.input_bytes,
                    stopwatch=stopwatch,
                ),
                **shared,
                "input_chars": read.chars[record_format.name],
                "rows_by_source": table_metadata(
                    pl.DataFrame(
                        {"source": list(rows), "rows": list(rows.values())},
                        schema={"source": pl.String, "rows": pl.UInt32},
                    ).sort("source")
                ),
            },
        )
    yield MaterializeResult(
        asset_key=BRONZE_QUARANTINE,
        metadata={
            **delta_write_metadata(
                quarantine_commit,
                polars_schema(QuarantineRecord),
                upstream_versions=upstream,
                input_bytes=read.input_bytes,
                stopwatch=stopwatch,
            ),
            **shared,
            "quarantined_by_reason": table_metadata(
                quarantine.group_by("source", "reason").len("rows").sort("source", "reason")
            ),
        },
    )


_CONTRACTS = {
    tables.fmt.name: tables.bronze_contract for tables in FORMAT_TABLES
}  # each format's bronze table


class _BatchRead:
    """A batch's files read in order into contract-checked chunks of records, with what the
    metadata and the accounting need of them tallied on the way."""

    CHUNK_ROWS = (
        10_000  # records validated at once: the contract's fixed cost per call, against overlap
    )
    PROGRESS_SECONDS = 5.0  # a progress line at most this often
    FILES_NAMED = 20  # files with lines set aside a progress line names

    def __init__(
        self,
        context: AssetExecutionContext,
        batch_id: str,
        entries: list[dict],
        source_files: list[str],
    ):
        self.context, self.batch_id, self.entries, self.source_files = (
            context,
            batch_id,
            entries,
            source_files,
        )
        self.ingested_at = datetime.now(timezone.utc)
        self.quarantine_parts: list[pl.DataFrame] = []
        self.per_file: list[dict] = []
        self.rows_by_source: dict[str, dict[str, int]] = {
            name: {} for name in _CONTRACTS
        }  # format -> source -> rows
        self.held_parts: dict[RecordFormat, list[pl.DataFrame]] = {
            tables.fmt: [] for tables in FORMAT_TABLES
        }
        self.input_bytes = 0
        self.chars = dict.fromkeys(_CONTRACTS, 0)
        self.logged_at = time.monotonic()
        self.files_named: list[str] = []  # files that set lines aside since the last progress line
        self.files_not_named = 0

    def record_chunks(self, ingests: Iterator["FileIngest"]) -> Iterator[pl.DataFrame]:
        pending, pending_rows, chunks = [], 0, 0
        for ordinal, (entry, source_file, ingest) in enumerate(
            zip(self.entries, self.source_files, ingests)
        ):
            records = self._add(ordinal, entry, source_file, ingest)
            if ingest.record_format is not SFT:
                self.held_parts[ingest.record_format].append(
                    records
                )  # few next to sft's: kept for one commit
                continue
            pending.append(records)
            pending_rows += records.height
            if pending_rows >= self.CHUNK_ROWS:
                yield self._checked(pending)
                pending, pending_rows, chunks = [], 0, chunks + 1
        if pending_rows or not chunks:  # a batch with no records still writes its (empty) partition
            yield self._checked(pending)

    def _add(
        self, ordinal: int, entry: dict, source_file: str, ingest: "FileIngest"
    ) -> pl.DataFrame:
        records, quarantined = with_provenance(
            ingest.result,
            source=entry["source"],
            source_file=source_file,
            file_ordinal=ordinal,
            batch_id=self.batch_id,
            ingested_at=self.ingested_at,
        )
        self.input_bytes += ingest.size
        self.quarantine_parts.append(quarantined)
        self.per_file.append(_file_accounting(source_file, entry["source"], ingest))
        if records.height:
            by_source = self.rows_by_source[ingest.record_format.name]
            by_source[entry["source"]] = by_source.get(entry["source"], 0) + records.height
        self._log(source_file, ingest, last=ordinal == len(self.entries) - 1)
        return records

    def _log(self, source_file: str, ingest: "FileIngest", last: bool) -> None:
        """Progress every PROGRESS_SECONDS and at the end, with a line for each file read since that
        set lines aside: one event a file would flood the run's log (and its event storage) on a
        batch of many files. Every file's counts are in the metadata (per_file_accounting)."""
        if ingest.result.quarantine.height and len(self.files_named) < self.FILES_NAMED:
            self.files_named.append(_describe(source_file, ingest))
        elif ingest.result.quarantine.height:
            self.files_not_named += 1
        if not last and time.monotonic() - self.logged_at < self.PROGRESS_SECONDS:
            return
        accepted = sum(
            rows for by_source in self.rows_by_source.values() for rows in by_source.values()
        )
        set_aside = sum(part.height for part in self.quarantine_parts)
        progress = (
            f"{len(self.per_file)} of {len(self.entries)} file(s) read: {accepted} record(s) "
            f"accepted, {set_aside} set aside"
        )
        more = [
            f"and {self.files_not_named} more file(s) with lines set aside (per_file_accounting "
            "lists them)"
        ]
        self.context.log.info(
            "\n  ".join([progress, *self.files_named, *(more if self.files_not_named else [])])
        )
        self.files_named, self.files_not_named, self.logged_at = [], 0, time.monotonic()

    def held_records(self, record_format: RecordFormat) -> pl.DataFrame:
        """The records of a format other than sft, contract-checked (read after
        ``record_chunks``)."""
        return self._checked(self.held_parts[record_format], record_format)

    def _checked(
        self, parts: list[pl.DataFrame], record_format: RecordFormat = SFT
    ) -> pl.DataFrame:
        contract = _CONTRACTS[record_format.name]
        frame = conform(pl.concat(parts), contract) if parts else polars_schema(contract).to_frame()
        frame = validate(frame, contract)
        self.chars[record_format.name] += text_chars(frame)
        return frame


@dataclass(frozen=True)
class FileIngest:
    record_format: RecordFormat  # its source's
    result: FileReadResult
    size: int  # bytes read
    lines_counted: int  # units in the file by lib.landing.unit_counts, independent of the parser
    already_ingested: int  # leading lines an earlier version of the file delivered


def _ingest_files(
    landing: LandingResource, entries: list[dict], source_files: list[str]
) -> Iterator[FileIngest]:
    """Each registered file's ingest, in order, read ahead by one thread while this one validates
    and hands chunks to the Delta writer. One reader: its per-line work holds the GIL, so a second
    one gains nothing and starves the validation and the writer of the GIL. A file's checksum is
    computed on another thread while it is parsed (hashlib lets go of the GIL)."""
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="bronze-read") as reader,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="bronze-checksum") as checksums,
    ):
        yield from reader.map(
            partial(_ingest_registered_file, landing, checksums), entries, source_files
        )


def _ingest_registered_file(
    landing: LandingResource, checksums: Executor, entry: dict, source_file: str
) -> FileIngest:
    """Read the file version the manifest registered (from the start of a file that grew by
    appending since). A file that is gone or otherwise changed is one quarantined unit; a read that
    fails for any other reason fails the step, to be retried."""
    name = PurePosixPath(entry["uri"]).name
    record_format = landing.format_for(entry["source"])
    try:
        data = landing.read_bytes(entry["uri"])
    except LandingFileGone as gone:
        return FileIngest(
            record_format,
            rejected_file("unreadable_file", f"the registered file is gone: {gone}", record_format),
            0,
            1,
            0,
        )
    except (
        Exception
    ) as exc:  # an I/O error, a timeout, an object-store 5xx or throttle, MemoryError
        raise Failure(
            description=f"reading landing file {source_file} failed ({type(exc).__name__}: {exc}); "
            "nothing of this batch was written, and the step is retried",
        ) from exc
    registered = (
        data[: entry["size"]] if len(data) > entry["size"] else data
    )  # a file that grew: its start
    checksum = checksums.submit(sha256_hex, registered)
    result = read_landing_file(
        name, registered, landing.mapping_for(entry["source"]), record_format
    )
    if checksum.result() != entry["checksum"]:
        changed = rejected_file(
            "unreadable_file",
            f"bytes changed since registration (sha256 {entry['checksum'][:12]} -> "
            f"{sha256_hex(data)[:12]}); the landing sensor registers the new version as a new "
            "batch",
            record_format,
        )
        return FileIngest(record_format, changed, len(data), 1, 0)
    redelivered = redelivered_lines(
        name, registered, entry["previous_size"], entry["previous_checksum"]
    )
    if redelivered:
        result = set_aside_redelivered(
            result,
            redelivered,
            f"delivered before by version {entry['previous_checksum'][:12]} of this file in batch "
            f"{entry['previous_batch']}",
        )
    return FileIngest(
        record_format, result, len(registered), count_units(name, registered), redelivered
    )


def _file_accounting(source_file: str, source: str, ingest: FileIngest) -> dict:
    return {
        "source_file": source_file,
        "source": source,
        "lines_counted": ingest.lines_counted,
        "lines_read": ingest.result.lines_read,
        "bronze_rows": ingest.result.records.height,
        "quarantined": ingest.result.quarantine.height - ingest.already_ingested,
        "already_ingested": ingest.already_ingested,
    }


def _describe(source_file: str, ingest: FileIngest) -> str:
    result = ingest.result
    reasons = result.quarantine.group_by("reason").len().sort("len", descending=True)
    top = ", ".join(f"{r} {n}" for r, n in reasons.iter_rows()) or "none"
    return (
        f"{source_file}: {ingest.lines_counted} lines counted, {result.records.height} accepted, "
        f"{result.quarantine.height} set aside ({top})"
    )
