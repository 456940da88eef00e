"""A silver run killed after its tasks wrote their files and before the step committed them: the
re-run of the batch commits each table once, holds every record once, and leaves none of the dead
run's files behind. And what the flow's step does itself: no text, no reading of signatures."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import string
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.flow import StepBytes, run_flow, staging_dir
from pipeline_assets.defs.silver.lookup import bands_to_search
from pipeline_assets.lib.formats import PREFERENCE, SFT
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.decontam import EVAL_COLUMNS, DecontamConfig, EvalItems
from pipeline_assets.lib.silver.dedup import EXACT_BAND, PROMPT_BAND, lookup_in
from pipeline_assets.lib.silver.prepare import TextInKeysError
from pipeline_assets.resources.engine import RayEngine
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.silver_shares import (
    BandTargets,
    commit_band_shares,
    write_band_share,
)
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register

TABLES = ["records", "rejects", "minhash_index"]
WRITTEN = "written"


def _write_and_wait(lake_uri: str, home: str, batch_id: str, marker: str) -> None:
    """The flow up to the writes, in a child process, which then waits to be killed."""
    lake = LakeResource(uri=lake_uri)
    index = lake.scan("silver", "minhash_index")
    index_table = lake.table("silver", "minhash_index")
    run_flow(
        lake,
        RayEngine(home=home),
        FORMAT_TABLES,
        batch_id,
        "killed-run",
        SilverConfig(),
        EvalItems(
            pl.DataFrame(schema=dict.fromkeys(EVAL_COLUMNS, pl.String)), DecontamConfig(), ""
        ),
        lookup_in(index) if index is not None else None,
        bands_to_search(lake, index_table, [batch_id]) if index_table is not None else None,
    )
    Path(marker).write_text(WRITTEN)
    time.sleep(600)


def _record(i: int, text_of: int | None = None) -> dict:
    """A record of its own words (``text_of``: another record's text, an exact copy)."""
    rng = random.Random(i if text_of is None else text_of)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(60)]
    return record(i, prompt=" ".join(words[:12]) + "?", response=" ".join(words[12:]) + ".")


def _materialize(instance, resources, batch_id):
    result = materialize(
        [eval_sets, bronze, silver], partition_key=batch_id, instance=instance, resources=resources
    )
    assert result.success
    return result


def _files(lake: LakeResource, name: str, batch_id: str) -> set[str]:
    folder = Path(lake.table_uri("silver", name), f"batch_id={batch_id}")
    return {path.name for path in folder.glob("*.parquet")}


def test_a_run_killed_before_its_commits_is_committed_once_by_the_rerun(
    instance, resources, landing_dir, tmp_path
):
    lake = resources["lake"]
    write_landing_file(landing_dir, "synth", "part-0.jsonl", [_record(i) for i in range(12)])
    _materialize(instance, resources, first := register(instance, resources))
    copies = [_record(i) for i in range(12, 24)] + [_record(24, text_of=3)]  # a copy of batch 1's
    write_landing_file(landing_dir, "synth", "part-1.jsonl", copies)
    batch = register(instance, resources)
    materialize([bronze], partition_key=batch, instance=instance, resources=resources)
    versions = {name: lake.version("silver", name) for name in TABLES}

    marker = tmp_path / "marker"
    child = multiprocessing.get_context("spawn").Process(
        target=_write_and_wait, args=(lake.uri, str(tmp_path / "home"), batch, str(marker))
    )
    child.start()
    deadline = time.monotonic() + 300
    while not marker.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the child never wrote its files"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    orphans = {name: _files(lake, name, batch) for name in TABLES}
    assert all(orphans.values()), "the dead run left files in every table's partition"
    assert {name: lake.version("silver", name) for name in TABLES} == versions, "nothing committed"
    assert Path(staging_dir(lake, batch)).exists()

    _materialize(instance, resources, batch)

    bronze_rows = lake.read("bronze", "records", where=pl.col("batch_id") == batch).height
    kept = lake.read("silver", "records", where=pl.col("batch_id") == batch)
    rejects = lake.read("silver", "rejects", where=pl.col("batch_id") == batch)
    assert kept.height + rejects.height == bronze_rows == 13
    for frame in (kept, rejects, lake.read("silver", "minhash_index")):
        assert frame["record_id"].is_unique().all(), "no record twice"
    assert "exact_dup" in rejects["stage"].to_list()
    for name in TABLES:
        assert lake.version("silver", name) == versions[name] + 1, f"{name}: one commit"
        left = _files(lake, name, batch)
        assert left and not left & orphans[name], f"{name}: the dead run's files removed"
        assert left == set(
            Path(p).name for p in lake.table("silver", name).file_uris() if f"batch_id={batch}" in p
        ), f"{name}: every file left is committed"
    assert not Path(staging_dir(lake, batch)).exists(), "staged files removed once committed"
    assert lake.read("silver", "records", where=pl.col("batch_id") == first).height == 12


def _band_files(lake: LakeResource, batch_id: str) -> set[str]:
    folder = Path(lake.table_uri("silver", "minhash_bands"))
    return {
        str(p.relative_to(folder)) for p in folder.glob(f"band=*/batch_id={batch_id}/*.parquet")
    }


def test_band_files_of_a_run_killed_before_the_bands_commit_are_removed_by_the_rerun(
    instance, resources, landing_dir
):
    lake = resources["lake"]
    write_landing_file(landing_dir, "synth", "part-0.jsonl", [_record(i) for i in range(12)])
    _materialize(instance, resources, batch := register(instance, resources))
    bands = lake.read("silver", "minhash_bands").sort("band", "record_id")
    version = lake.version("silver", "minhash_bands")
    committed = _band_files(lake, batch)
    assert len(committed) == 17, "a file a band but the prompt band (no pairs)"

    # what a run killed between its band tasks and the bands commit leaves
    targets = BandTargets(lake.uri, batch, lake.version("silver", "minhash_index"))
    dead = [write_band_share(targets, band, "dead-run") for band in (EXACT_BAND, 0, 15)]
    assert write_band_share(targets, PROMPT_BAND, "dead-run") is None, "no pair: no file"
    assert _band_files(lake, batch) == committed | {action["path"] for action in dead}

    rerun = _materialize(instance, resources, batch)

    assert lake.version("silver", "minhash_bands") == version + 1, "one commit"
    assert lake.read("silver", "minhash_bands").sort("band", "record_id").equals(bands)
    table = lake.table_uri("silver", "minhash_bands")
    current = {
        str(Path(uri).relative_to(table))
        for uri in lake.table("silver", "minhash_bands").file_uris()
        if f"batch_id={batch}" in uri
    }
    assert len(current) == 17 and not current & committed, "the rerun's own files"
    assert _band_files(lake, batch) == committed | current, (
        "the dead run's files removed; the first run's stay for time travel"
    )
    started = instance.get_run_record_by_id(rerun.run_id).create_timestamp.timestamp()
    again = commit_band_shares(lake, [], batch, int(started * 1000))
    assert again.version == version + 1 == lake.version("silver", "minhash_bands"), (
        "the rerun's bands commit retried: carried already, nothing committed"
    )


def test_a_frame_with_text_never_enters_the_step():
    counted = StepBytes()
    keys = pl.DataFrame({"record_id": ["a"], "exact_hash": [1]})
    assert counted.frame("keys", keys) is keys and counted.bytes == keys.estimated_size()
    for text in ({"response": ["an answer"]}, {"meta": ['{"k": 1}']}):
        with pytest.raises(TextInKeysError):
            counted.frame("verdicts", pl.DataFrame({"record_id": ["a"], **text}))
    assert counted.by_kind == {"keys": keys.estimated_size()}


class _MappedEngine(RayEngine):
    """The engine, noting each function it maps and how many calls it was given."""

    def map_tasks(self, function, calls, batch_rows, shared=()):
        MAPPED.append((function.__name__, len(calls)))
        return super().map_tasks(function, calls, batch_rows, shared)


MAPPED: list[tuple[str, int]] = []


def test_the_candidates_keys_are_read_by_a_task_a_share_and_their_pairs_by_a_task_a_band(
    instance, resources, landing_dir, tmp_path
):
    """sft records are decided from their candidates: the step receives the keys of a near copy,
    an exact copy and their originals, not the other records' (read by a task a share), and near
    dedup's verified pair, built from the candidates' signatures by a task an LSH band: no
    signature reaches the step."""
    lake = resources["lake"]
    near_copy = dict(_record(5), response=_record(5)["response"].replace(".", " again."))
    exact_copy = _record(12, text_of=7)
    write_landing_file(
        landing_dir,
        "synth",
        "part-0.jsonl",
        [*(_record(i) for i in range(12)), near_copy, exact_copy],
    )
    batch = register(instance, resources)
    materialize([eval_sets, bronze], partition_key=batch, instance=instance, resources=resources)
    MAPPED.clear()
    flow = run_flow(
        lake,
        _MappedEngine(home=str(tmp_path / "home")),
        FORMAT_TABLES,
        batch,
        "a-run",
        SilverConfig(),
        EvalItems(
            pl.DataFrame(schema=dict.fromkeys(EVAL_COLUMNS, pl.String)), DecontamConfig(), ""
        ),
        None,
        None,
    )
    sft = next(b for t, b in flow.formats.items() if t.fmt is SFT)
    staged = [calls for name, calls in MAPPED if name == "stage_share_signatures"]
    paired = [calls for name, calls in MAPPED if name == "pair_band"]
    assert staged == [len(sft.shares)] and paired == [16], MAPPED  # sft's: no other has candidates
    assert flow.step_bytes.by_kind["near pairs"] > 0, "the near pair, received"
    assert not [kind for kind in flow.step_bytes.by_kind if "signature" in kind], flow.step_bytes
    verdicts = pl.concat([b.decision.verdicts.select("removed_by") for b in flow.formats.values()])
    assert {"near_dedup", "exact_dedup"} <= set(verdicts["removed_by"].drop_nulls())
    assert sft.bronze_rows == 14 and sft.keys.height == 4, sft.keys
    assert sft.decision.kept_rows() == 12
    searched = [calls for name, calls in MAPPED if name == "search_share_band"]
    keys_read = [calls for name, calls in MAPPED if name == "read_share_keys"]
    # sft's and conversations' (no row: no band), a task a band: the exact band and the 16 LSH ones
    assert searched == [17] and sum(keys_read) == sum(
        len(b.shares) for t, b in flow.formats.items() if t.fmt is not PREFERENCE
    ), MAPPED
