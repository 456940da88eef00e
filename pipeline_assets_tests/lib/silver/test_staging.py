"""Prepare on the workers: tasks that read a batch's bronze files themselves and stage Parquet give,
through the keys, the decision and the split, exactly what ``curate_formats`` gives on the frame
the step reads today, batch after batch."""

from __future__ import annotations

import pickle
from itertools import accumulate
from pathlib import Path
from unittest.mock import ANY

import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, PREFERENCE, SFT, TURNS
from pipeline_assets.lib.silver.curation import SilverConfig, curate_formats
from pipeline_assets.lib.silver.decide import decide, from_candidates, reached_dedup
from pipeline_assets.lib.silver.dedup import (
    EXACT_BAND,
    BandMatches,
    band_entries,
    lookup_in,
    lsh_of,
    search_band,
)
from pipeline_assets.lib.silver.near_edges import pairs_in
from pipeline_assets.lib.silver.prepare import text_columns
from pipeline_assets.lib.silver.split import split
from pipeline_assets.lib.silver.staging import (
    bronze_files,
    bronze_schema,
    cut_files,
    group_files,
    prepare_files,
    read_band,
    read_keys,
    read_prepared,
    read_signed,
    stage_signatures,
    staged_tally,
)
from pipeline_assets.resources.engine import RayEngine
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets_tests.lib.silver.test_curation_blocks import _eval_index
from pipeline_assets_tests.lib.silver.test_prepare_decide import _assert_equal, _batches

TABLES = {SFT: "records", PREFERENCE: "preference_records", CONVERSATION: "conversations"}
ROWS_PER_BLOCK = 7


@pytest.fixture(autouse=True)
def _no_ray_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _write_bronze(lake: LakeResource, batches: list[dict]) -> dict:
    """Each format's batches b1 and b2, each in two appends (interleaved: b1, b2, b1, b2), so a
    batch spans several files; b1's sft exact duplicates r00040 and r00041 fall in different
    files. The tables' versions."""
    halves = [
        (fmt, frame.slice(0, _cut(frame)) if first else frame.slice(_cut(frame)))
        for first in (True, False)
        for batch in batches
        for fmt, frame in batch.items()
    ]
    for fmt, frame in halves:
        frame.write_delta(
            lake.table_uri("bronze", TABLES[fmt]),
            mode="append",
            delta_write_options={"partition_by": ["batch_id"]},
        )
    return {fmt: lake.version("bronze", TABLES[fmt]) for fmt in batches[0]}


def _cut(frame: pl.DataFrame) -> int:
    return min(41, frame.height // 2)


def _today(lake: LakeResource, versions: dict, batch_ids: list[str], config: SilverConfig):
    index, results = None, []
    for batch_id in batch_ids:
        bronze = {
            fmt: lake.read("bronze", TABLES[fmt], version=v, where=pl.col("batch_id") == batch_id)
            for fmt, v in versions.items()
        }
        look_up = lookup_in(index.lazy()) if index is not None else None
        curated = curate_formats(bronze, look_up, _eval_index(), config).formats
        results.append({fmt: (c.kept, c.rejects, c.index, c.stages) for fmt, c in curated.items()})
        index = pl.concat(
            [*([index] if index is not None else []), *(c.index for c in curated.values())]
        )
    return results


def _shares(lake, engine, fmt, version, batch_id, staging: Path, config):
    """The batch's files in shares of (at least) one file each, prepared as engine tasks."""
    uri = lake.table_uri("bronze", TABLES[fmt])
    files = bronze_files(uri, version, batch_id)
    schema = bronze_schema(uri, version)
    calls = [
        (share, config, _eval_index(), fmt, str(staging), ROWS_PER_BLOCK, schema)
        for share in group_files(files, 1)
    ]
    return engine.map_tasks(prepare_files, calls, sum(f.rows for f in files))


def _staged(lake, engine, versions, batch_ids, staging: Path, config, read=None, keys_read=None):
    """Prepared, decided and split batch after batch; with ``read`` (a list), the keys are read
    without their signatures: each LSH band is searched from the staged files, and near dedup
    clusters the pairs verified on the signatures of the candidates found, staged (``read`` gets
    how many). With ``keys_read`` (a
    list) too, a format decided from candidates has its exact band searched as well and only its
    candidates' keys read (``keys_read`` gets how many, and of how many records)."""
    index, results = None, []
    for batch_id in batch_ids:
        shares = {
            fmt: _shares(lake, engine, fmt, v, batch_id, staging / batch_id, config).results
            for fmt, v in versions.items()
        }
        assert all(len(s) >= 2 for s in shares.values()), "every batch spans several files"
        look_up = lookup_in(index.lazy()) if index is not None else None
        keys = {fmt: read_keys(s, signatures=read is None) for fmt, s in shares.items()}
        assert not [c for k in keys.values() for c in k.columns if "band_key" in c]
        if read is None:
            decisions = decide(keys, look_up, config)
        else:
            searched = _searched(shares, index, config, exact=keys_read is not None)
            pairs = {
                fmt: _pairs(s, searched[fmt], index, staging / batch_id, config, fmt, read)
                for fmt, s in shares.items()
            }
            tallies = {}
            for fmt, s in shares.items():
                if keys_read is not None and from_candidates(config, fmt):
                    ids = searched[fmt].every_candidate()
                    keys[fmt] = read_keys(s, signatures=False, record_ids=ids)
                    tallies[fmt] = staged_tally(s)
                    keys_read.append((fmt, keys[fmt].height, tallies[fmt].rows))
            decisions = decide(keys, look_up, config, pairs, searched, tallies)
        cut = {
            fmt: split(read_prepared(s), decisions[fmt], config.minhash)
            for fmt, s in shares.items()
        }
        results.append({fmt: (c.kept, c.rejects, c.index, c.stages) for fmt, c in cut.items()})
        index = pl.concat(
            [*([index] if index is not None else []), *(c.index for c in cut.values())]
        )
    return results


def _searched(
    shares: dict, index: pl.DataFrame | None, config: SilverConfig, exact: bool = False
) -> dict:
    """Per format, every LSH band of its staged keys searched within the batch and in the other
    batches' band rows (``index``'s), joined; with ``exact``, the exact band too for a format
    decided from candidates."""
    bands = range(lsh_of(config.minhash).bands)
    rows = band_entries(index).lazy() if index is not None else None
    return {
        fmt: BandMatches.joined(
            [
                search_band(read_band(s, band, reached_dedup(config, fmt)), band, True, rows)
                for band in [
                    *([EXACT_BAND] if exact and from_candidates(config, fmt) else []),
                    *bands,
                ]
            ]
        )
        for fmt, s in shares.items()
    }


def _pairs(shares, found, index, staging: Path, config, fmt, read: list):
    """Near dedup's verified pairs of a format's batch: its candidates' signatures staged and
    read back (``read`` gets how many), with those of the index entries the searches found."""
    batch_id = staging.name
    staged = stage_signatures(shares, found.candidates, str(staging / f"near-{fmt.name}.parquet"))
    nodes = read_signed([staged] if staged else [])
    read.append(nodes.height)
    if index is not None:
        entries = index.join(found.entries, on=["record_id", "batch_id"], how="semi")
        nodes = pl.concat([nodes, entries.select(nodes.columns)])
    return pairs_in(nodes, batch_id, config.minhash, fmt)


def test_band_searches_of_the_staged_files_find_near_dedups_candidates_as_today(tmp_path):
    """Keys without signatures or band keys: a search of each band of the staged files, within the
    batch and in the other batches' band rows, names near dedup's candidates and the index entries
    to read, and the tables and near dedup's counters are today's, row for row."""
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    versions = _write_bronze(lake, _batches()[:2])
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=10**9)
    today = _today(lake, versions, ["b1", "b2"], config)
    read: list[int] = []
    staged = _staged(lake, engine, versions, ["b1", "b2"], tmp_path / "staging", config, read)
    _assert_equal(staged, today)
    for mine, theirs in zip(staged, today, strict=True):
        for fmt, (kept, rejects, _, stages) in theirs.items():
            assert mine[fmt][0].equals(kept) and mine[fmt][1].equals(rejects), fmt.name
            assert mine[fmt][3]["near_dedup"] == {
                **stages["near_dedup"],
                "seconds": mine[fmt][3]["near_dedup"]["seconds"],
            }, fmt.name
    against = sum(t[fmt][3]["near_dedup"]["against_other_batches"] for t in today for fmt in t)
    assert against > 0, "the second batch has near copies of the first's records"
    reached = sum(theirs[fmt][3]["near_dedup"]["rows_in"] for theirs in today for fmt in theirs)
    assert 0 < sum(read) < reached, "some signatures read, not every record's"


def test_a_decision_from_the_candidates_keys_alone_gives_todays_tables_and_counters(tmp_path):
    """sft and conversations decided from the keys of the records the band searches found,
    EXACT_BAND included (preference pairs, whose cap and contradictions look at every pair, from
    every key): the tables, in today's order, and every stage's counters are today's, though the
    decision read only some of the records' keys."""
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    versions = _write_bronze(lake, _batches()[:2])
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=10**9)
    today = _today(lake, versions, ["b1", "b2"], config)
    keys_read: list = []
    staged = _staged(
        lake, engine, versions, ["b1", "b2"], tmp_path / "staging", config, [], keys_read
    )
    _assert_equal(staged, today)
    for mine, theirs in zip(staged, today, strict=True):
        for fmt, (kept, rejects, _, stages) in theirs.items():
            assert mine[fmt][0].equals(kept) and mine[fmt][1].equals(rejects), fmt.name
            for name in ("exact_dedup", "near_dedup"):
                assert mine[fmt][3][name] == {**stages[name], "seconds": ANY}, (fmt.name, name)
    assert {fmt for fmt, *_ in keys_read} == {SFT, CONVERSATION}
    assert all(read < rows for _, read, rows in keys_read), keys_read
    removed = {
        fmt: {stage for theirs in today for stage in theirs[fmt][1]["stage"]}
        for fmt in (SFT, CONVERSATION)
    }
    assert {"exact_dup", "near_dup", "decontaminated"} <= removed[SFT], removed
    assert any(stage.startswith("quality:") for stage in removed[SFT]), removed
    assert "exact_dup" in removed[CONVERSATION], removed


def test_staged_shares_decide_and_split_to_todays_tables_batch_after_batch(tmp_path):
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    versions = _write_bronze(lake, _batches()[:2])
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=10**9)
    today = _today(lake, versions, ["b1", "b2"], config)
    staged = _staged(lake, engine, versions, ["b1", "b2"], tmp_path / "staging", config)
    _assert_equal(staged, today)
    for mine, theirs in zip(staged, today, strict=True):  # and in today's row order
        for fmt, (kept, rejects, *_) in theirs.items():
            assert mine[fmt][0].equals(kept) and mine[fmt][1].equals(rejects), fmt.name
    stages = set(today[0][SFT][1]["stage"]) | set(today[1][PREFERENCE][1]["stage"])
    assert {"exact_dup", "near_dup", "decontaminated", "contradiction"} <= stages


def test_files_in_order_give_the_rows_lake_read_gives(tmp_path):
    lake = LakeResource(uri=str(tmp_path / "lake"))
    version = _write_bronze(lake, [{SFT: b[SFT]} for b in _batches()[:2]])[SFT]
    uri = lake.table_uri("bronze", "records")
    files = bronze_files(uri, version, "b1")
    read = lake.read("bronze", "records", version=version, where=pl.col("batch_id") == "b1")
    assert [f.rows for f in files] in ([41, 79], [79, 41])
    assert [f.first_position for f in files] == [0, files[0].rows]
    schema = bronze_schema(uri, version)
    whole = pl.concat(
        [
            pl.read_parquet(f.uri).with_columns(batch_id=pl.lit("b1")).select(schema.names())
            for f in files
        ]
    )
    assert whole.equals(read)
    assert bronze_files(uri, version, "b9") == []
    empty = prepare_files([], SilverConfig(), _eval_index(), SFT, str(tmp_path / "s"), 7, schema)
    assert empty.rows == 0 and read_keys([empty]).height == 0


def test_files_cut_into_pieces_prepare_to_what_whole_files_prepare(tmp_path):
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    version = _write_bronze(lake, [{SFT: b[SFT]} for b in _batches()[:1]])[SFT]
    uri = lake.table_uri("bronze", "records")
    files, schema = bronze_files(uri, version, "b1"), bronze_schema(uri, version)
    pieces = cut_files(files, 10)
    # 41 and 79 rows: five and eight pieces, each within its file
    assert sorted(p.rows for p in pieces) == [1, 9, *[10] * 11] and len(files) == 2
    assert [p.first_position for p in pieces] == [0, *accumulate(p.rows for p in pieces[:-1])]
    assert {p.skip for p in pieces} == set(range(0, 80, 10))

    def staged(shares, folder):
        calls = [
            (s, config, _eval_index(), SFT, str(tmp_path / folder), 10, schema) for s in shares
        ]
        return read_prepared([prepare_files(*call) for call in calls])

    whole, cut = staged([files], "whole"), staged(group_files(pieces, 10), "cut")
    assert len(group_files(pieces, 10)) == 12  # a short piece takes the next one along
    assert cut.keys.equals(whole.keys) and cut.staged.equals(whole.staged)


def test_a_retried_share_overwrites_its_own_files_and_keys_files_hold_no_text(tmp_path):
    lake, config = LakeResource(uri=str(tmp_path / "lake")), SilverConfig()
    batches = [{fmt: b[fmt] for fmt in (SFT, CONVERSATION)} for b in _batches()[:2]]
    versions = _write_bronze(lake, batches)
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=10**9)
    for fmt, version in versions.items():
        staging = tmp_path / "staging" / fmt.name
        uri = lake.table_uri("bronze", TABLES[fmt])
        files, schema = bronze_files(uri, version, "b1"), bronze_schema(uri, version)
        call = (files[:1], config, _eval_index(), fmt, str(staging), ROWS_PER_BLOCK, schema)
        first = prepare_files(*call)
        written = sorted(staging.iterdir())
        assert len(written) == 2 * len(first.blocks)
        again = engine.map_tasks(prepare_files, [call], files[0].rows).results[0]
        assert sorted(staging.iterdir()) == written
        assert [(b.records, b.keys, b.rows) for b in again.blocks] == [
            (b.records, b.keys, b.rows) for b in first.blocks
        ]
        keys = read_keys([again])
        assert keys.height == keys["record_id"].n_unique() == files[0].rows
        # as a Ray task gets it: pickled, the format a copy (band keys are salted by format)
        prepare_files(*pickle.loads(pickle.dumps(call)))
        assert read_keys([again]).equals(keys)
        with pytest.raises(ValueError, match="overlap"):
            read_keys([first, again])
        for block in again.blocks:
            schema = pl.read_parquet_schema(block.keys)
            assert not set(schema) & text_columns() and TURNS not in schema.values()
            assert set(pl.read_parquet_schema(block.records)) & text_columns()


def test_a_registered_format_is_itself_after_crossing_a_process_boundary():
    import pickle
    from dataclasses import replace

    from pipeline_assets.lib.formats import FORMATS

    for fmt in FORMATS.values():
        assert pickle.loads(pickle.dumps(fmt)) is fmt
    unregistered = replace(FORMATS["sft"], name="custom")
    assert pickle.loads(pickle.dumps(unregistered)) == unregistered
