"""Silver's index lookup measured on an index large enough to show its rate a row.

A calibration's own lookups search a few thousand earlier rows. Their seconds are the tasks' fixed
cost (opening files), whatever the index size, so a rate a row fitted on them is noise, and the
sizer multiplies it by the rows a large corpus searches (10^14 for a billion records). Measured
here instead: the lookup silver runs (``look_up_by_band``, its tasks one after the other in this
process, as in a step without Ray) of a batch of LOOKUP_BATCH records against indexes of
INDEX_SIZES records, written as silver writes them (random signatures; COPIES of the indexed
records repeated in the batch, so entries are found and read as in a real lookup), the fastest of
``kept_rates.REPEATS`` lookups at each size, the sizes taken in turns.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from deltalake import DeltaTable, write_deltalake

from pipeline_assets.defs.silver import lookup
from pipeline_assets.defs.silver.kept_rates import fastest_in_turns, fingerprint, kept_or_measured
from pipeline_assets.defs.silver.lookup import (
    BANDS_PARTITIONED_BY,
    BandsAt,
    batch_slices,
    look_up_by_band,
)
from pipeline_assets.lib import delta_files
from pipeline_assets.lib.delta_files import TableFiles
from pipeline_assets.lib.silver import dedup
from pipeline_assets.lib.silver.dedup import (
    ROWS_PER_LOOKUP_TASK,
    SIGNATURE_COLUMNS,
    band_entries,
    index_entries,
    signature_series,
    wanted_keys,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.resources.engine import RayEngine

INDEX_SIZES = (100_000, 400_000)  # indexed records the lookup is measured against
ROWS_PER_BATCH = 50_000  # indexed records a synthetic batch holds (a partition of the index)
LOOKUP_BATCH = 100_000
COPIES = 1_000  # indexed records the looked-up batch repeats


@dataclass(frozen=True)
class LookupRate:
    """What ``measure_lookup`` measured, and on what."""

    points: list[tuple[int, float]]  # (indexed records, the lookup tasks' seconds)
    bands: int  # the bands the lookup searched (a task each a slice of the index)
    measured_on: str  # the code and machine: a rate measured on others is measured again


def lookup_rate(
    cache: Path,
    config: MinHashConfig,
    log: Callable[[str], object] = print,
    index_sizes: tuple[int, ...] = INDEX_SIZES,
    batch_rows: int = LOOKUP_BATCH,
) -> LookupRate:
    """The lookup's rate from ``cache`` when it was measured by this code on this machine with
    ``config``, ``index_sizes`` and ``batch_rows``, else measured now (a minute or so) and kept
    there."""
    measured_on = (
        f"{fingerprint((lookup, dedup, delta_files, sys.modules[__name__]), config)}; indexes of "
        f"{', '.join(map(str, index_sizes))} records; batches of {batch_rows}"
    )

    def measure() -> LookupRate:
        log(
            f"measuring silver's index lookup on synthetic indexes of "
            f"{', '.join(f'{size:,}' for size in index_sizes)} records (once for this code and "
            f"machine; kept in {cache.name})"
        )
        points, bands = measure_lookup(index_sizes, batch_rows, config)
        return LookupRate([list(point) for point in points], bands, measured_on)

    return kept_or_measured(cache, LookupRate, measured_on, measure)


def measure_lookup(
    index_sizes: tuple[int, ...] = INDEX_SIZES,
    batch_rows: int = LOOKUP_BATCH,
    config: MinHashConfig = MinHashConfig(),
) -> tuple[list[tuple[int, float]], int]:
    """(indexed records, the lookup tasks' seconds) for each of ``index_sizes``, in order (an
    index of each size, each with a batch of its own, the fastest of lookups in turns:
    ``fastest_in_turns``), and the bands searched."""
    with tempfile.TemporaryDirectory(prefix="lookup-rate-") as tmp:
        engine = RayEngine(home=tmp, min_rows=batch_rows + 1)  # this process, one task at a time
        lookups = []
        for number, size in enumerate(index_sizes):
            index = SyntheticIndex(Path(tmp) / str(number), config, seed=number)
            index.grow_to(size)
            lookups.append((index, index.lookup_of(index.batch(batch_rows))))
        seconds = fastest_in_turns(
            [functools.partial(index.look_up, lookup, engine) for index, lookup in lookups]
        )
    bands = lookups[0][1].wanted["band"].n_unique()
    return list(zip(index_sizes, seconds, strict=True)), bands


@dataclass(frozen=True)
class Lookup:
    """A batch as its lookup reads it, made once for every time it is looked up."""

    wanted: pl.DataFrame  # the (band, band_key) rows it looks up (``wanted_keys``)
    rows: int
    copies: frozenset[str]  # the record ids of the indexed entries it repeats: found, or refused


class SyntheticIndex:
    """``silver/minhash_index`` and ``silver/minhash_bands`` as silver writes them, of random
    records, a batch partition at a time."""

    def __init__(self, root: Path, config: MinHashConfig, seed: int = 0):
        self.index_uri, self.bands_uri = str(root / "minhash_index"), str(root / "minhash_bands")
        self.config = config
        self.rows = 0
        self._batches = 0
        self._rng = np.random.default_rng(seed)
        self._copied: list[pl.DataFrame] = []

    def grow_to(self, rows: int, rows_per_batch: int = ROWS_PER_BATCH) -> None:
        while self.rows < rows:
            height = min(rows_per_batch, rows - self.rows)
            entries = index_entries(self._records(height, f"b{self.rows:012d}"), self.config)
            write_deltalake(
                self.index_uri, entries.to_arrow(), mode="append", partition_by=["batch_id"]
            )
            write_deltalake(
                self.bands_uri,
                band_entries(entries).to_arrow(),
                mode="append",
                partition_by=list(BANDS_PARTITIONED_BY),
            )
            self._copied.append(entries.sample(min(COPIES, height), seed=self.rows))
            self.rows += height

    def batch(self, rows: int) -> pl.DataFrame:
        """``rows`` records to look up (exact hashes and signatures: all a lookup reads), COPIES of
        them indexed records."""
        copies = pl.concat(self._copied).sample(min(COPIES, rows), seed=self.rows)
        fresh = self._records(rows - copies.height, "new")
        return pl.concat(
            [
                fresh.select("exact_hash", SIGNATURE_COLUMNS[0]),
                copies.select("exact_hash", pl.col("signature").alias(SIGNATURE_COLUMNS[0])),
            ]
        )

    def lookup_of(self, batch: pl.DataFrame) -> Lookup:
        return Lookup(
            wanted_keys(batch, self.config),
            batch.height,
            frozenset(self.copies(batch)["record_id"]),
        )

    def look_up(self, lookup: Lookup, engine: RayEngine) -> float:
        """The seconds of the tasks of one ``lookup``, which must find every copy."""
        index, bands = DeltaTable(self.index_uri), DeltaTable(self.bands_uri)
        entries, tasks = look_up_by_band(
            lookup.wanted,
            engine,
            lookup.rows,
            BandsAt(
                TableFiles(bands), bands.version(), batch_slices(index, [], ROWS_PER_LOOKUP_TASK)
            ),
            TableFiles(index),
        )
        found = set() if entries is None else set(entries["record_id"])
        missed = lookup.copies - found
        if missed:
            raise AssertionError(f"the lookup missed {len(missed)} indexed records")
        return float(tasks["task_seconds"])

    def copies(self, batch: pl.DataFrame) -> pl.DataFrame:
        """The index entries ``batch`` repeats."""
        return pl.concat(self._copied).join(batch.select("exact_hash"), on="exact_hash", how="semi")

    def _records(self, rows: int, batch_id: str) -> pl.DataFrame:
        sigs = self._rng.integers(0, 2**32, (rows, self.config.num_perm), dtype=np.uint32)
        ids = bronze_record_ids(self._batches, rows)
        self._batches += 1
        return pl.DataFrame(
            {
                "record_id": ids,
                "batch_id": pl.repeat(batch_id, rows, eager=True),
                "exact_hash": random_hashes(self._rng, rows),
                SIGNATURE_COLUMNS[0]: signature_series(SIGNATURE_COLUMNS[0], sigs),
                SIGNATURE_COLUMNS[1]: signature_series(SIGNATURE_COLUMNS[1], sigs[:, ::-1]),
            }
        )


def bronze_record_ids(batch: int, rows: int) -> pl.Series:
    """``rows`` record ids as bronze names the lines of a batch's first file."""
    prefix = f"{batch:010x}{0:06x}"
    return pl.select(
        pl.lit(prefix) + pl.int_range(1, rows + 1).cast(pl.String).str.zfill(16)
    ).to_series()


def random_hashes(rng: np.random.Generator, rows: int) -> pl.Series:
    """``rows`` random exact hashes: 32-character hex strings of 16 bytes each."""
    data = rng.bytes(16 * rows)
    return signature_series("", np.frombuffer(data, dtype="<u4").reshape(rows, 4)).bin.encode("hex")
