"""The sample corpus through bronze: every injected malformed line is quarantined as the
manifest says."""

from __future__ import annotations

import polars as pl

from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, materialize_bronze, register


def test_bronze_quarantines_exactly_the_injected_malformed_lines(
    instance, resources, landing_dir, tmp_path
):
    manifest = write_sample_corpus(landing_dir, records=3000, eval_sets_dir=tmp_path / "eval_sets")
    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)
    assert result.success
    assert all(check.passed for check in checks_by_name(result).values() if check.blocking)

    records = resources["lake"].read("bronze", "records")
    quarantine = resources["lake"].read("bronze", "quarantine")
    assert records.height == manifest["expected"]["bronze_rows"]
    assert quarantine.height == manifest["expected"]["quarantined"] > 0
    expected = sorted(
        (m["file"], m["line"], m["reason"]) for m in manifest["injected"]["malformed"]
    )
    assert sorted(quarantine.select("source_file", "source_line", "reason").rows()) == expected

    injected_ids = {
        e["id"]
        for kind, entries in manifest["injected"].items()
        if kind != "malformed"
        for e in entries
    }
    assert set(records["id"]) == set(manifest["clean_ids"]) | injected_ids
    by_source = dict(records.group_by("source").len().iter_rows())
    assert set(by_source) == {"annotate", "synth", "logs", "scrape"}
    assert records.filter(pl.col("source") == "logs")["extra"].str.contains("session_id").all()
