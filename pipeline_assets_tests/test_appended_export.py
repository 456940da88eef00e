"""An export that grows is not an incident: `pipeline-assets run` after 300 lines are appended to an
ingested 1,000-line file takes exactly those 300 lines through silver and into the next snapshot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import polars as pl

from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.sample_data.corpus import write_sample_corpus

DATA_LAYERS = 'key:"bronze/*" or key:"silver/*" or key:"gold/*"'


def _clean_records(scratch: Path, home: Path, count: int) -> list[bytes]:
    """``count`` distinct sample-corpus records that curation keeps, as JSON lines of one source."""
    manifest = write_sample_corpus(
        scratch, records=int(count * 1.2), eval_sets_dir=home / "reference" / "eval_sets"
    )
    clean_ids = set(manifest["clean_ids"])
    lines = []
    for entry in manifest["files"]:
        path = scratch / entry["path"]
        for row in read_landing_file(path.name, path.read_bytes()).records.iter_rows(named=True):
            if row["id"] in clean_ids:
                lines.append(
                    orjson.dumps(
                        {k: row[k] for k in ("id", "system", "prompt", "response") if row[k]}
                    )
                    + b"\n"
                )
    assert len(lines) >= count
    return lines[:count]


def _run(home: Path) -> subprocess.CompletedProcess:
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))
    }
    environment.update(PIPELINE_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli.main", "run", "--select", DATA_LAYERS],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_appended_lines_flow_and_the_old_ones_are_not_ingested_twice(tmp_path):
    home = tmp_path / "home"
    lines = _clean_records(tmp_path / "sample", home, 1300)
    export = home / "landing" / "logs" / "export.jsonl"
    export.parent.mkdir(parents=True)
    export.write_bytes(b"".join(lines[:1000]))
    first = _run(home)
    assert first.returncode == 0, first.stderr

    with export.open("ab") as growing:
        growing.write(b"".join(lines[1000:]))
    second = _run(home)
    assert second.returncode == 0, second.stderr
    assert "FAILED" not in second.stderr

    lake = home / "lake"
    bronze = pl.read_delta(str(lake / "bronze" / "records"))
    batches = sorted(bronze["batch_id"].unique())
    assert len(batches) == 2
    new = bronze.filter(pl.col("batch_id") == batches[1])
    assert sorted(new["source_line"]) == list(range(1001, 1301)), (
        "only the appended lines are new records"
    )
    quarantine = pl.read_delta(str(lake / "bronze" / "quarantine")).filter(
        pl.col("batch_id") == batches[1]
    )
    assert quarantine.height == 1000 and set(quarantine["reason"]) == {"already_ingested"}

    silver = pl.read_delta(str(lake / "silver" / "records")).filter(
        pl.col("batch_id") == batches[1]
    )
    rejects = pl.read_delta(str(lake / "silver" / "rejects")).filter(
        pl.col("batch_id") == batches[1]
    )
    assert silver.height + rejects.height == 300, "silver judges exactly the new lines"
    assert not rejects["stage"].str.contains("dedup").any(), (
        "no new line is taken for a copy of an old one"
    )
    assert silver.height >= 295, (
        "the sample's clean records pass curation (a rare one fails a quality rule)"
    )

    gold = pl.read_delta(str(lake / "gold" / "sequences"))
    in_gold = gold["record_ids"].explode()
    assert set(silver["record_id"]) <= set(in_gold), "the new records are in the next snapshot"
    assert in_gold.n_unique() == pl.read_delta(str(lake / "silver" / "records")).height, (
        "each silver record once"
    )
