"""The sample corpus as the benchmarks use it: clean, normalized records with ids and sources."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.silver.normalize import normalize_records
from pipeline_assets.sample_data.corpus import SAMPLE_RECORDS, write_sample_corpus


def sample_records(root: Path, records: int = SAMPLE_RECORDS) -> pl.DataFrame:
    """Writes the corpus under root (eval sets in root/eval) and returns its accepted records."""
    manifest = write_sample_corpus(root / "landing", records=records, eval_sets_dir=root / "eval")
    frames = [
        read_landing_file(
            f["path"], (root / "landing" / f["path"]).read_bytes()
        ).records.with_columns(source=pl.lit(f["source"]))
        for f in manifest["files"]
    ]
    frame = pl.concat(frames).with_columns(
        record_id=pl.int_range(pl.len()).cast(pl.String).str.zfill(32), batch_id=pl.lit("b1")
    )
    return normalize_records(frame)[0]
