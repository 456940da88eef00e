"""Bronze ingest beside its floor: ``polars.read_ndjson`` plus ``write_deltalake`` of the same rows.

The files: the sample corpus, COPIES times, as JSONL, with LONG_SHARE of the responses replaced by
long documents (LONG_MIN_CHARS to LONG_MAX_CHARS, log-uniform, made of other responses, seeded), so
the lengths are skewed like real post-training data. Two variants of the same files: ``clean`` (the
sample's malformed lines left out) and ``dirty`` (kept: about 1% of the lines, every JSON reason
code the sample injects), so bronze's exact per-line path runs too.

The floor reads the clean files with ``read_ndjson`` (it cannot read a malformed line) and commits
the rows to a Delta table with ``write_deltalake``'s defaults: the rows bronze accepts from either
variant. Floor and bronze run in the same process (the same polars and delta-rs thread pools),
interleaved, best of REPEATS each; bronze's time is the asset's own wall time, read to commit.

``ratio`` is ingest seconds over floor seconds for the clean files (target: at most TARGET);
``dirty.ratio`` is the same for the dirty files, against the same floor.
"""

from __future__ import annotations

import gzip
import io
import logging
import math
import random
import tempfile
import time
from pathlib import Path

import orjson
import polars as pl
import zstandard
from dagster import DagsterInstance, materialize
from deltalake import write_deltalake

from bench.timing import best_seconds
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.landing.batches import register_new_batch
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.lib.landing.files import read_landing_file, read_landing_file_exact
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.sample_data.corpus import write_sample_corpus

COPIES = 5  # the sample corpus, five times: about 100,000 records
LONG_SHARE = 0.02
LONG_MIN_CHARS, LONG_MAX_CHARS = 4_000, 100_000
REPEATS = 5
TARGET = 1.5
VARIANTS = ("clean", "dirty")


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = _write_corpus(root / "sample", {v: root / v / "landing" for v in VARIANTS})
        ingest = {v: _BronzeBatch(root / v) for v in VARIANTS}
        floor_runs, ingest_runs = [], {v: [] for v in VARIANTS}
        for _ in range(REPEATS):  # interleaved, so both sides see the same machine
            floor_runs.append(_floor_seconds(files["clean"], root / "floor"))
            for variant in VARIANTS:
                ingest_runs[variant].append(ingest[variant].materialize())
        read_seconds, write_seconds = min(floor_runs, key=sum)
        floor = read_seconds + write_seconds
        figures = {v: _variant_figures(files[v], min(ingest_runs[v]), floor) for v in VARIANTS}
        rows = figures["clean"]["rows"]
        mb = sum(f.stat().st_size for f in files["clean"]) / 1e6
    clean, dirty = figures["clean"], figures["dirty"]
    long_responses = clean.pop("long_responses")
    dirty.pop("long_responses")
    return {
        "rows": rows,
        "input_mb": round(mb, 1),
        "long_responses": long_responses,
        "measured": f"bronze ingest {rows / clean['ingest_seconds']:,.0f} rows/s, "
        f"{mb / clean['ingest_seconds']:,.1f} MB/s"
        f" (1% dirty lines: {dirty['ingest_over_floor']:.2f}x the floor)",
        "baseline": f"read_ndjson + write_deltalake {rows / floor:,.0f} rows/s, "
        f"{mb / floor:,.1f} MB/s",
        "floor_seconds": round(floor, 3),
        "floor_stages": {
            "read_ndjson_seconds": round(read_seconds, 3),
            "write_deltalake_seconds": round(write_seconds, 3),
        },
        "clean": clean,
        "dirty": dirty,
        "ratio": clean["ingest_over_floor"],
        "ratio_is": "ingest seconds / floor seconds (clean files)",
        "target": f"ingest <= {TARGET}x read_ndjson + write_deltalake, clean and 1% dirty",
        "target_met": clean["ingest_over_floor"] <= TARGET and dirty["ingest_over_floor"] <= TARGET,
    }


def _variant_figures(files: list[Path], ingest: tuple[float, float], floor: float) -> dict:
    """The ingest's timings for one variant, its read stage alone (fast and exact), and proof that
    the fast read gives exactly the exact path's records and quarantine."""
    ingest_seconds, write_seconds = ingest
    blobs = [(f.name, f.read_bytes()) for f in files]
    fast = [read_landing_file(name, data) for name, data in blobs]
    exact = [read_landing_file_exact(name, data) for name, data in blobs]
    quarantine = pl.concat([r.quarantine for r in fast])
    return {
        "lines": sum(r.lines_read for r in fast),
        "rows": sum(r.records.height for r in fast),
        "quarantined": quarantine.height,
        "quarantined_by_reason": dict(
            quarantine.group_by("reason").len().sort("reason").iter_rows()
        ),
        "long_responses": sum(
            r.records.filter(pl.col("response").str.len_chars() >= LONG_MIN_CHARS).height
            for r in fast
        ),
        "same_as_exact_path": all(_same(a, b) for a, b in zip(fast, exact, strict=True)),
        "ingest_seconds": round(ingest_seconds, 3),
        "ingest_over_floor": round(ingest_seconds / floor, 3),
        "stages": {
            "read_seconds": round(
                best_seconds(lambda: [read_landing_file(n, d) for n, d in blobs], REPEATS), 3
            ),
            "read_exact_path_seconds": round(
                best_seconds(lambda: [read_landing_file_exact(n, d) for n, d in blobs], REPEATS), 3
            ),
            "records_streamed_to_delta_seconds": round(write_seconds, 3),
        },
    }


def _same(a, b) -> bool:
    return (
        a.lines_read == b.lines_read
        and a.records.equals(b.records)
        and a.quarantine.equals(b.quarantine)
    )


def _floor_seconds(files: list[Path], table: Path) -> tuple[float, float]:
    """``read_ndjson`` of every file, then one ``write_deltalake`` of all their rows (defaults)."""
    start = time.perf_counter()
    frame = pl.concat([pl.read_ndjson(f) for f in files], how="diagonal_relaxed")
    read = time.perf_counter() - start
    start = time.perf_counter()
    write_deltalake(str(table), frame.to_arrow(), mode="overwrite")
    return read, time.perf_counter() - start


class _BronzeBatch:
    """One ingest batch of a landing zone, materialized again and again in one Dagster instance."""

    def __init__(self, root: Path):
        self.resources = {
            "lake": LakeResource(uri=str(root / "lake")),
            "landing": LandingResource(uri=str(root / "landing")),
        }
        self.instance = DagsterInstance.ephemeral()
        self.batch = register_new_batch(
            self.resources["landing"], self.resources["lake"], logging.getLogger("bench")
        ).batch_id
        self.instance.add_dynamic_partitions(ingest_batches.name, [self.batch])

    def materialize(self) -> tuple[float, float]:
        """The asset's wall time (read to Delta commit) and its Delta writes' (both tables). The
        records are written as the files are read, so their write's time holds the reading too."""
        result = materialize(
            [bronze], partition_key=self.batch, instance=self.instance, resources=self.resources
        )
        written = {
            m.asset_key.to_user_string(): m.metadata
            for m in result.asset_materializations_for_node("bronze")
        }
        records = written["bronze/records"]
        return records["wall_seconds"].value, sum(
            m["write_seconds"].value for m in written.values()
        )


# --- The corpus ---------------------------------------------------------------------------------


def _write_corpus(sample: Path, landings: dict[str, Path]) -> dict[str, list[Path]]:
    manifest = write_sample_corpus(sample, eval_sets_dir=sample / "_eval_sets")
    malformed = {(m["file"], m["line"]) for m in manifest["injected"]["malformed"]}
    sources = {e["path"]: _lines(sample / e["path"], e["format"]) for e in manifest["files"]}
    pool = _response_pool([line for lines in sources.values() for line in lines])
    written = {variant: [] for variant in landings}
    for entry in manifest["files"]:
        for copy in range(COPIES):
            rng = random.Random(f"{entry['path']}:{copy}")
            clean, dirty = [], []
            for number, line in enumerate(sources[entry["path"]], 1):
                if (entry["path"], number) in malformed:
                    dirty.append(line)
                    continue
                if rng.random() < LONG_SHARE:
                    line = _with_long_response(line, pool, rng)
                clean.append(line)
                dirty.append(line)
            name = f"{entry['source']}/{Path(entry['path']).name.split('.')[0]}-{copy}.jsonl"
            for variant, lines in (("clean", clean), ("dirty", dirty)):
                target = landings[variant] / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(b"".join(line + b"\n" for line in lines))
                written[variant].append(target)
    return written


def _response_pool(lines: list[bytes]) -> list[str]:
    pool = []
    for line in lines:
        try:
            response = orjson.loads(line).get("response")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(response, str) and response.strip():
            pool.append(response)
    return pool


def _with_long_response(line: bytes, pool: list[str], rng: random.Random) -> bytes:
    """The line with its response replaced by other responses joined, LONG_MIN to LONG_MAX chars."""
    record = orjson.loads(line)
    size = int(math.exp(rng.uniform(math.log(LONG_MIN_CHARS), math.log(LONG_MAX_CHARS))))
    parts, length = [], 0
    while length < size:
        parts.append(rng.choice(pool))
        length += len(parts[-1]) + 2
    record["response"] = "\n\n".join(parts)[:size]
    return orjson.dumps(record)


def _lines(path: Path, fmt: str) -> list[bytes]:
    data = path.read_bytes()
    if fmt == "parquet":
        buffer = io.BytesIO()
        pl.read_parquet(data).write_ndjson(buffer)
        data = buffer.getvalue()
    elif fmt == "jsonl.gz":
        data = gzip.decompress(data)
    elif fmt == "jsonl.zst":
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data.splitlines()
