"""Silver written in parallel: tasks split staged shares by the decision and write one file a table
each; the step commits each table once. The tables equal what today's path writes, batch after
batch, and the stage counters come from keys and verdicts alone."""

from __future__ import annotations

import json
import pickle
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest

from pipeline_assets.contracts import MinhashIndexEntry, SilverReject
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.lib.formats import TURNS
from pipeline_assets.lib.silver.curation import SilverConfig, curate_formats
from pipeline_assets.lib.silver.decide import decide
from pipeline_assets.lib.silver.dedup import lookup_in
from pipeline_assets.lib.silver.prepare import text_columns
from pipeline_assets.lib.silver.split import for_positions, split, split_share, stage_counters
from pipeline_assets.lib.silver.staging import (
    read_keys,
    read_prepared,
    share_positions,
    staged_counters,
)
from pipeline_assets.resources.engine import RayEngine
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.silver_shares import (
    SilverTargets,
    commit_silver_tables,
    to_contract,
    write_share_tables,
)
from pipeline_assets_tests.lib.silver.test_curation_blocks import _eval_index
from pipeline_assets_tests.lib.silver.test_prepare_decide import RUNNER_COUNTS, _batches
from pipeline_assets_tests.lib.silver.test_staging import TABLES, _shares, _write_bronze

SILVER_TABLES = [
    *(tables.silver.to_user_string() for tables in FORMAT_TABLES),
    "silver/rejects",
    "silver/minhash_index",
]


def _with_provenance(frame: pl.DataFrame) -> pl.DataFrame:
    """A fixture's rows with what bronze's contract asks beyond them (32-character ids, the
    landing file and line, the time of ingestion, a content hash), so the tables validate."""
    return frame.with_columns(
        record_id=pl.col("record_id").str.pad_start(32, "0"),
        source_file=pl.lit("landing/synth/part-0.jsonl"),
        source_line=pl.int_range(1, pl.len() + 1, dtype=pl.Int64),
        ingested_at=pl.lit(datetime(2026, 11, 21, tzinfo=UTC)).dt.cast_time_unit("us"),
        content_hash=pl.col("record_id").str.pad_start(32, "c"),
    )


@pytest.fixture(autouse=True)
def _no_ray_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _batch_partitions(curated) -> dict:
    """What the silver asset wrote before issue 37: each table's partition conformed in the step,
    every format's rejects and index entries in one frame."""

    def conformed(model, frames):
        return to_contract(model, pl.concat(frames, how="diagonal_relaxed"))

    return {
        **{
            t.silver.to_user_string(): to_contract(t.silver_contract, c.kept)
            for t, c in curated.items()
        },
        "silver/rejects": conformed(SilverReject, [c.rejects for c in curated.values()]),
        "silver/minhash_index": conformed(MinhashIndexEntry, [c.index for c in curated.values()]),
    }


def _write_today(lake: LakeResource, today: LakeResource, versions, batch_id, config):
    """Today's path: curate the batch read whole, conform, replace each table's partition. The
    stage counters per format."""
    bronze = {
        fmt: lake.read("bronze", TABLES[fmt], version=v, where=pl.col("batch_id") == batch_id)
        for fmt, v in versions.items()
    }
    index = today.scan("silver", "minhash_index")
    look_up = lookup_in(index) if index is not None else None
    curated = curate_formats(bronze, look_up, _eval_index(), config).formats
    partitions = _batch_partitions({tables: curated[tables.fmt] for tables in FORMAT_TABLES})
    for key, frame in partitions.items():
        layer, name = key.split("/")
        today.replace_partition(
            layer, name, frame, column="batch_id", value=batch_id, add_columns=True
        )
    return {fmt: batch.stages for fmt, batch in curated.items()}


def _write_staged(lake: LakeResource, engine, versions, batch_id, staging, config, run):
    """The new path: staged shares, the decision from the keys, a write task a share (through the
    engine), one commit a table. The stage counters per format, and the commits."""
    shares = {
        fmt: _shares(lake, engine, fmt, v, batch_id, staging / batch_id, config).results
        for fmt, v in versions.items()
    }
    keys = {fmt: read_keys(s) for fmt, s in shares.items()}
    index = lake.scan("silver", "minhash_index")
    decisions = decide(keys, lookup_in(index) if index is not None else None, config)
    targets = {fmt: SilverTargets(lake.uri, batch_id, fmt.name) for fmt in shares}
    calls = [
        (
            share,
            for_positions(decisions[fmt], *share_positions(share)),
            targets[fmt],
            config.minhash,
            run,
        )
        for fmt, format_shares in shares.items()
        for share in format_shares
    ]
    rows = sum(k.height for k in keys.values())
    # a first try of one task, from pickled arguments as a Ray task gets them; the engine's run
    # of the same call is its retry, which overwrites the same files
    tried = pickle.loads(pickle.dumps(write_share_tables(*pickle.loads(pickle.dumps(calls[0])))))
    written = engine.map_tasks(write_share_tables, calls, rows).results
    assert {t: a and a["path"] for t, a in tried.actions.items()} == {
        t: a and a["path"] for t, a in written[0].actions.items()
    }
    commits = commit_silver_tables(lake, written, list(targets.values()), batch_id, version=run[1])
    counters = {
        fmt: stage_counters(staged_counters(s), s[0].record_stages, decisions[fmt])
        for fmt, s in shares.items()
    }
    whole = {
        fmt: split(read_prepared(s), decisions[fmt], config.minhash) for fmt, s in shares.items()
    }
    for fmt, cut in whole.items():  # the step's counters are exactly split's of the whole batch
        assert counters[fmt] == cut.stages, fmt.name
        _assert_shares_make_the_batch(shares[fmt], decisions[fmt], cut, config)
    return counters, commits, (shares, written, list(targets.values()))


def _assert_shares_make_the_batch(shares, decision, whole, config) -> None:
    """Each share split alone, concatenated in position order: the whole batch's split, row for
    row (rows ordered by share rather than by stage)."""
    parts = [
        split_share(
            read_prepared([s]), for_positions(decision, *share_positions(s)), config.minhash
        )
        for s in sorted(shares, key=lambda s: s.blocks[0].first_position)
    ]
    for name in ("kept", "rejects", "index"):
        joined = pl.concat([getattr(p, name) for p in parts], how="diagonal_relaxed")
        assert joined.columns == getattr(whole, name).columns, name
        assert joined.sort("record_id").equals(getattr(whole, name).sort("record_id")), name


def _texts(batch: dict) -> set[str]:
    """Every text a batch's records hold, long enough to be their own (a turn's content too)."""
    texts = set()
    for frame in batch.values():
        for name in text_columns() & set(frame.columns):
            column = frame[name]
            if column.dtype == TURNS:
                column = column.explode().struct.field("content")
            if column.dtype == pl.String:
                texts |= {t for t in column.drop_nulls() if len(t) >= 16}
    return texts


def test_shares_written_in_parallel_and_committed_once_give_todays_tables(tmp_path):
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    today = LakeResource(uri=str(tmp_path / "today"))
    batches = [
        {fmt: _with_provenance(frame) for fmt, frame in batch.items()} for batch in _batches()[:2]
    ]
    versions = _write_bronze(lake, batches)
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=10**9)
    for number, batch_id in enumerate(["b1", "b2"]):
        stages = _write_today(lake, today, versions, batch_id, config)
        run = (f"run{number}", 1_000 + number)
        counters, commits, (shares, written, targets) = _write_staged(
            lake, engine, versions, batch_id, tmp_path / "staging", config, run
        )
        received = pickle.dumps((shares, written))  # the prepare and write tasks' results
        texts = _texts(batches[number])
        assert len(texts) > 50 and not [t for t in texts if t.encode() in received]
        for fmt, counted in stages.items():
            assert list(counters[fmt]) == list(counted), fmt.name
            for stage, c in counted.items():
                assert {k: counters[fmt][stage][k] for k in RUNNER_COUNTS} == {
                    k: c[k] for k in RUNNER_COUNTS
                }, (fmt.name, stage)
        assert len(written) >= 2 * len(versions)  # at least two shares a format
        for share in written:  # the committing step gets ids' and hashes' bounds, no text
            for table, action in share.actions.items():
                bounds = json.loads(action["stats"])["minValues"] if action else {}
                assert not set(bounds) & text_columns(), table
                assert not action or "record_id" in bounds, table
        for table in SILVER_TABLES:
            layer, name = table.split("/")
            assert commits[table].version == number == lake.version(layer, name), table
            where = pl.col("batch_id") == batch_id
            ours = lake.read(layer, name, where=where).sort("record_id")
            theirs = today.read(layer, name, where=where).sort("record_id")
            assert ours.columns == theirs.columns, table
            assert ours.equals(theirs), table
            folder = Path(lake.table_uri(layer, name), f"batch_id={batch_id}")
            committed = {a["path"].split("/")[-1] for w in written if (a := w.actions.get(table))}
            assert {p.name for p in folder.glob("*.parquet")} == committed, table  # no strays
        again = commit_silver_tables(lake, written, targets, batch_id, version=run[1])
        for table in SILVER_TABLES:  # the retried commit finds its transaction carried
            layer, name = table.split("/")
            assert again[table].version == number == lake.version(layer, name), table
    rejects = lake.read("silver", "rejects")
    assert {"exact_dup", "near_dup", "decontaminated", "contradiction"} <= set(rejects["stage"])
    assert rejects.height == today.read("silver", "rejects").height
