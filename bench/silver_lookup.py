"""Silver's lookup of a batch in the index of the batches before it: by band, against the
whole index; and the sizer's lookup rate against it.

An index of INDEX_RECORDS records written as INDEX_BATCHES batches (``lookup_rate.SyntheticIndex``:
random signatures, the layout silver writes: ``silver/minhash_index`` partitioned by batch,
``silver/minhash_bands`` by band and batch), and a batch of LOOKUP_BATCH records of which COPIES
repeat an indexed record. Measured: the lookup silver does now (``look_up_by_band``: a task a band
and slice of batches, then a task a slice reading the found entries; one after the other here, as
in a step without Ray). Baseline: what silver did before, the exact hashes and the exploded band
keys of the whole index scanned in the step's process. Both in this process on all of polars'
threads, best of three runs taken in turns (this machine's speed drifts within minutes); both must
find the same records.

The sizer's rate: ``lookup_rate.measure_lookup`` on the sizer's indexes (INDEX_SIZES, up to 400,000
records) and on one of INDEX_RECORDS, in turns; the first two fitted as the sizer fits them must
predict the lookup's task seconds on the last, five times larger, within TOLERANCE.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import polars as pl
from deltalake import DeltaTable

from bench.timing import best_of_alternating
from pipeline_assets.defs.silver.lookup import BandsAt, batch_slices, look_up_by_band
from pipeline_assets.defs.silver.lookup_rate import INDEX_SIZES, SyntheticIndex, measure_lookup
from pipeline_assets.lib.delta_files import TableFiles
from pipeline_assets.lib.ops.sizing import fit_measured
from pipeline_assets.lib.silver.dedup import (
    ROWS_PER_LOOKUP_TASK,
    SIGNATURE_COLUMNS,
    _earliest_by_hash,
    _history_matches,
    band_keys,
    lsh_of,
    signature_matrix,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.resources.engine import RayEngine

INDEX_RECORDS = 2_000_000
INDEX_BATCHES = 20
LOOKUP_BATCH = 100_000
TARGET_RATIO = (
    1.0  # in one process: no slower than the scan it replaces; its gain is that the tasks spread
)
TOLERANCE = 0.30  # the sizer's rate against the lookup measured here


def run(
    index_records: int = INDEX_RECORDS, batches: int = INDEX_BATCHES, batch_rows: int = LOOKUP_BATCH
) -> dict:
    config = MinHashConfig()
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = SyntheticIndex(Path(tmp), config)
        synthetic.grow_to(index_records, rows_per_batch=index_records // batches)
        batch = synthetic.batch(batch_rows)
        lookup = synthetic.lookup_of(batch)
        index_uri, bands_uri = synthetic.index_uri, synthetic.bands_uri
        index, bands = DeltaTable(index_uri), DeltaTable(bands_uri)

        in_process = RayEngine(
            home=tmp, min_rows=batch_rows + 1
        )  # as a step without RAY_ADDRESS runs this batch
        slices = batch_slices(index, [], ROWS_PER_LOOKUP_TASK)

        def by_band() -> pl.DataFrame:
            entries, _ = look_up_by_band(
                lookup.wanted,
                in_process,
                batch_rows,
                BandsAt(TableFiles(bands), bands.version(), slices),
                TableFiles(index),
            )
            return entries

        def whole_index() -> set[str]:
            scan = pl.scan_delta(index)
            params = lsh_of(config)
            keys = band_keys(signature_matrix(batch[SIGNATURE_COLUMNS[0]], config), params)
            near = _history_matches(scan, keys, params, config)
            exact = _earliest_by_hash(scan, batch["exact_hash"])
            return set(near["record_id"]) | set(exact["kept_record_id"])

        found, baseline_found = set(by_band()["record_id"]), whole_index()
        measured, baseline = best_of_alternating(by_band, whole_index)
    assert found == baseline_found == lookup.copies, "both ways find exactly the copied records"
    *sizer_points, (_, tasks) = measure_lookup((*INDEX_SIZES, index_records), batch_rows)[0]
    fit = fit_measured(sizer_points)
    predicted = fit.seconds(1, index_records)
    sizer_error = abs(predicted / tasks - 1)
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
        "whole-index scan in one process, finding the same records; and the sizer's rate (below)",
        "target_met": baseline / measured >= TARGET_RATIO and sizer_error <= TOLERANCE,
        "sizer": {
            "measured_on": [list(point) for point in sizer_points],
            "fit": f"{fit.fixed_seconds:.3f} s + {fit.seconds_per_unit * 1e6:.3f} us an indexed "
            "record",
            "predicted_task_seconds": predicted,
            "measured_task_seconds": tasks,
            "error": predicted / tasks - 1,
            "target": f"the sizer's lookup fit within {TOLERANCE:.0%} of the task seconds "
            f"measured on {index_records:,} records",
            "target_met": sizer_error <= TOLERANCE,
        },
    }
