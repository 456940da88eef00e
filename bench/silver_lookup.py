"""Silver's lookup of a batch in the index of the batches before it: by band, against the
whole index.

An index of INDEX_RECORDS records written as INDEX_BATCHES batches (random signatures, the layout
silver writes: ``silver/minhash_index`` partitioned by batch, ``silver/minhash_bands`` by band and
batch), and a batch of LOOKUP_BATCH records of which COPIES repeat an indexed record. Measured: the
lookup silver does now (``look_up_by_band``: a task a band and slice of batches, then a task a slice
reading the found entries; one after the other here, as in a step without Ray). Baseline: what
silver did before, the exact hashes and the exploded band keys of the whole index scanned in the
step's process. Both in this process on all of polars' threads, best of three; both must find the
same records.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import polars as pl
from deltalake import DeltaTable, write_deltalake

from bench.timing import best_seconds
from pipeline_assets.defs.silver.lookup import (
    BANDS_PARTITIONED_BY,
    BandsAt,
    batch_slices,
    look_up_by_band,
)
from pipeline_assets.lib.silver.dedup import (
    HISTORY_SCHEMA,
    ROWS_PER_LOOKUP_TASK,
    SIGNATURE_COLUMNS,
    _earliest_by_hash,
    _history_matches,
    _signature_matrix,
    band_entries,
    band_keys,
    lsh_of,
    wanted_keys,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.resources.engine import RayEngine

INDEX_RECORDS = 2_000_000
INDEX_BATCHES = 20
LOOKUP_BATCH = 100_000
COPIES = 1_000
TARGET_RATIO = (
    1.0  # in one process: no slower than the scan it replaces; its gain is that the tasks spread
)


def run(
    index_records: int = INDEX_RECORDS, batches: int = INDEX_BATCHES, batch_rows: int = LOOKUP_BATCH
) -> dict:
    config = MinHashConfig()
    with tempfile.TemporaryDirectory() as tmp:
        index_uri, bands_uri = str(Path(tmp) / "minhash_index"), str(Path(tmp) / "minhash_bands")
        copies = _write_index(index_uri, bands_uri, index_records, batches, config)
        batch = _batch(copies, batch_rows, config)
        index, bands = DeltaTable(index_uri), DeltaTable(bands_uri)
        wanted = wanted_keys(batch, config)

        in_process = RayEngine(
            home=tmp, min_rows=batch_rows + 1
        )  # as a step without RAY_ADDRESS runs this batch
        slices = batch_slices(index, [], ROWS_PER_LOOKUP_TASK)

        def by_band() -> pl.DataFrame:
            entries, _ = look_up_by_band(
                wanted,
                in_process,
                batch_rows,
                BandsAt(bands_uri, None, bands.version(), slices),
                (index_uri, None, index.version()),
            )
            return entries

        def whole_index() -> set[str]:
            scan = pl.scan_delta(index)
            params = lsh_of(config)
            keys = band_keys(_signature_matrix(batch[SIGNATURE_COLUMNS[0]], config), params)
            near = _history_matches(scan, keys, params, config)
            exact = _earliest_by_hash(scan, batch["exact_hash"])
            return set(near["record_id"]) | set(exact["kept_record_id"])

        found, baseline_found = set(by_band()["record_id"]), whole_index()
        measured, baseline = best_seconds(by_band), best_seconds(whole_index)
    assert found == baseline_found == set(copies["record_id"]), (
        "both ways find exactly the copied records"
    )
    per_record = lambda seconds: seconds / index_records * 1e6  # noqa: E731
    return {
        "index_records": index_records,
        "lookup_batch": batch_rows,
        "measured": f"by band: {measured:.2f} s ({per_record(measured):.3f} us an indexed record), "
        f"{len(found):,} entries found",
        "baseline": f"whole index scanned: {baseline:.2f} s ({per_record(baseline):.3f} us an "
        "indexed record)",
        "ratio": baseline / measured,
        "seconds_per_indexed_record": measured / index_records,
        "target": f"the lookup by band, its tasks run one after the other, >= {TARGET_RATIO}x the "
        "whole-index scan in one "
        "process, finding the same records",
        "target_met": baseline / measured >= TARGET_RATIO,
    }


def _write_index(
    index_uri: str, bands_uri: str, records: int, batches: int, config: MinHashConfig
) -> pl.DataFrame:
    """The index as silver writes it, batch by batch; returns the entries the lookup
    batch copies."""
    params = lsh_of(config)
    rng = np.random.default_rng(0)
    per_batch = records // batches
    copied = []
    for number in range(batches):
        sigs = rng.integers(0, 2**32, (per_batch, config.num_perm), dtype=np.uint64).astype(
            np.uint32
        )
        entries = pl.DataFrame(
            {
                "record_id": [f"{number:08x}{i:024x}" for i in range(per_batch)],
                "batch_id": f"b{number:04d}",
                "exact_hash": [f"{rng.integers(0, 2**63):016x}{i:016x}" for i in range(per_batch)],
                "signature": [row.astype("<u4").tobytes() for row in sigs],
                "response_signature": [row.astype("<u4").tobytes() for row in sigs[:, ::-1]],
                "band_keys": band_keys(sigs, params).tolist(),
                "lsh_params": params.label(config),
                "prompt_hash": None,  # preference pairs' prompts only
            },
            schema=HISTORY_SCHEMA,
        )
        write_deltalake(index_uri, entries.to_arrow(), mode="append", partition_by=["batch_id"])
        write_deltalake(
            bands_uri,
            band_entries(entries).to_arrow(),
            mode="append",
            partition_by=list(BANDS_PARTITIONED_BY),
        )
        copied.append(entries.sample(COPIES // batches, seed=number))
    return pl.concat(copied)


def _batch(copies: pl.DataFrame, rows: int, config: MinHashConfig) -> pl.DataFrame:
    """``rows`` new records, ``copies`` among them: hashes and signatures are all a lookup reads."""
    rng = np.random.default_rng(1)
    fresh = rows - copies.height
    sigs = rng.integers(0, 2**32, (fresh, config.num_perm), dtype=np.uint64).astype(np.uint32)
    new = pl.DataFrame(
        {
            "exact_hash": [f"{rng.integers(0, 2**63):016x}{i:016x}" for i in range(fresh)],
            SIGNATURE_COLUMNS[0]: [row.astype("<u4").tobytes() for row in sigs],
        }
    )
    return pl.concat(
        [new, copies.select("exact_hash", pl.col("signature").alias(SIGNATURE_COLUMNS[0]))]
    )
