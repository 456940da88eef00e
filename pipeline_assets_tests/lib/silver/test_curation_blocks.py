"""Silver's block stages: the batch cut into blocks gives exactly the batch judged whole; the index
lookup by band gives exactly the batch judged against the whole index."""

from __future__ import annotations

import random
from functools import partial

import polars as pl

from pipeline_assets.lib.silver.curation import CuratedBatch, SilverConfig, curate
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import (
    BAND_SCHEMA,
    EXACT_BAND,
    PROMPT_BAND,
    band_entries,
    band_numbers,
    band_rows,
    lookup_in,
)
from pipeline_assets.lib.stages import from_row, run_in_process, run_stages, to_row
from pipeline_assets_tests.lib.silver.test_dedup import WORDS, _edited

EVAL_ANSWER = " ".join(f"benchmark{i}" for i in range(20))


def _bronze(n: int = 120, seed: int = 5) -> pl.DataFrame:
    rng = random.Random(seed)
    responses = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))) for _ in range(n)]
    responses[10] = responses[3]  # an exact duplicate
    responses[20] = _edited(responses[4], rng)  # a near duplicate
    responses[30] = f"As the benchmark says: {EVAL_ANSWER}."  # contaminated
    responses[40] = "ok"  # too short for the quality gate
    prompts = [f"Question {i}:  explain\u00a0this." for i in range(n)]
    prompts[10] = prompts[3]
    return pl.DataFrame(
        {
            "record_id": [f"r{i:05d}" for i in range(n)],
            "batch_id": "b1",
            "source": "synth",
            "system": None,
            "prompt": prompts,
            "response": responses,
        },
        schema_overrides={"system": pl.String},
    )


def _eval_index() -> EvalNgramIndex:
    return EvalNgramIndex.build(
        pl.DataFrame(
            {
                "eval_set": ["bench"],
                "item_id": ["1"],
                "prompt": ["What?"],
                "response": [EVAL_ANSWER],
            }
        )
    )


def test_blocks_of_any_size_give_the_batch_judged_whole():
    bronze, index, config = _bronze(), _eval_index(), SilverConfig()
    whole = curate(
        bronze, None, index, config, partial(run_in_process, rows_per_block=bronze.height)
    )
    blocked = curate(bronze, None, index, config, partial(run_in_process, rows_per_block=7))
    assert whole.kept.height + whole.rejects.height == bronze.height
    assert set(whole.rejects["stage"]) >= {"exact_dup", "near_dup", "decontaminated"}
    assert any(stage.startswith("quality:") for stage in whole.rejects["stage"])
    assert (
        blocked.kept.equals(whole.kept)
        and blocked.rejects.equals(whole.rejects)
        and blocked.index.equals(whole.index)
    )
    for stage in ("normalize", "decontaminate", "quality"):
        assert {k: v for k, v in blocked.stages[stage].items() if k != "seconds"} == {
            k: v for k, v in whole.stages[stage].items() if k != "seconds"
        }, stage


def assert_every_stage_accounts_for_its_rows(curated: CuratedBatch, bronze: pl.DataFrame) -> None:
    """Each stage's rows in are its kept plus rejected rows and the stage before's kept rows, each
    stage is timed, and the stages' rejected rows are the batch's rejects."""
    rows = bronze.height
    for name, counters in curated.stages.items():
        assert counters["rows_in"] == rows == counters["kept"] + counters["rejected"], name
        assert counters["seconds"] >= 0, name
        rows = counters["kept"]
    assert rows == curated.kept.height
    assert sum(c["rejected"] for c in curated.stages.values()) == curated.rejects.height


def test_every_stage_of_a_batch_counts_its_rows_and_seconds():
    bronze = _bronze()
    curated = curate(
        bronze, None, _eval_index(), SilverConfig(), partial(run_in_process, rows_per_block=7)
    )
    removing = ("exact_dedup", "near_dedup", "decontaminate", "quality")
    assert list(curated.stages) == ["normalize", "minhash", *removing, "language"]
    assert_every_stage_accounts_for_its_rows(curated, bronze)
    assert all(curated.stages[name]["rejected"] > 0 for name in removing)


def test_a_block_result_crosses_a_process_boundary_as_one_row():
    from pipeline_assets.lib.silver.curation import after_dedup

    block = _bronze().with_columns(exact_hash=pl.lit("h"), cluster_id=pl.col("record_id"))
    result = run_stages(after_dedup(SilverConfig(), _eval_index()), block)
    back = from_row(to_row(result))
    assert back.kept.equals(result.kept) and back.counters == result.counters
    assert back.removed.keys() == result.removed.keys()
    assert all(back.removed[name].equals(frame) for name, frame in result.removed.items())


def test_a_later_batch_finds_only_entries_sharing_a_key_and_is_judged_as_against_the_whole_index():
    """The band lookup hands dedup the other batches' entries sharing one of the batch's keys (exact
    hash or LSH band), and the batch is judged exactly as against every entry of the index."""
    config, eval_index = SilverConfig(), _eval_index()
    first = curate(_bronze(), None, eval_index, config)
    rng = random.Random(8)
    originals = first.kept.sort("record_id")
    later = pl.DataFrame(
        {
            "record_id": [f"s{i:05d}" for i in range(40)],
            "batch_id": "b2",
            "source": "synth",
            "system": None,
            "prompt": [f"Other question {i}." for i in range(40)],
            "response": [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(40)],
        },
        schema_overrides={"system": pl.String},
    ).with_columns(
        prompt=pl.Series(
            [
                originals["prompt"][0],
                originals["prompt"][1],
                *[f"Other question {i}." for i in range(2, 40)],
            ]
        ),
        response=pl.Series(
            [
                originals["response"][0],
                _edited(originals["response"][1], rng),
                *[" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(38)],
            ]
        ),
    )
    asked = []

    def counting(look_up):
        def wrapped(wanted, also=None):
            found = look_up(wanted, also)
            asked.append((wanted, found))
            return found

        return wrapped

    by_band = curate(later, counting(lookup_in(first.index.lazy())), eval_index, config)
    ((wanted, found),) = asked
    assert (
        set(wanted["band"].unique()) == {EXACT_BAND, *range(16)}
        and wanted.height == wanted.unique().height
    )
    assert sorted(found["record_id"]) == sorted(
        originals["record_id"][:2]
    )  # not the index's other 100-odd entries
    rejected = by_band.rejects.filter(pl.col("stage").is_in(["exact_dup", "near_dup"])).sort(
        "record_id"
    )
    assert rejected.select("record_id", "stage", "duplicate_of").rows() == [
        ("s00000", "exact_dup", originals["record_id"][0]),
        ("s00001", "near_dup", originals["record_id"][1]),
    ]
    assert by_band.index_lookup["entries_found"] == 2

    whole = curate(
        later, lambda wanted, also: first.index, eval_index, config
    )  # every entry, matching or not
    assert whole.kept.equals(by_band.kept) and whole.rejects.equals(by_band.rejects)


def test_the_band_table_holds_an_exact_key_and_one_key_a_band_for_every_entry():
    index = curate(_bronze(), None, _eval_index(), SilverConfig()).index
    bands = band_entries(index)
    assert bands.height == 17 * index.height and bands.schema == BAND_SCHEMA
    entry = index.row(0, named=True)
    mine = bands.filter(pl.col("record_id") == entry["record_id"]).sort("band")
    assert mine["band_key"].to_list() == [int(entry["exact_hash"][:15], 16), *entry["band_keys"]]


def test_the_band_table_written_a_band_at_a_time_is_the_table_written_at_once():
    index = curate(_bronze(), None, _eval_index(), SilverConfig()).index
    hashes = pl.Series([f"{i:032x}" if i % 3 else None for i in range(index.height)])
    index = index.with_columns(prompt_hash=hashes)  # pairs' prompts: some records have one
    lsh_bands = index["band_keys"].list.len().unique().item()
    by_band = [band_rows(index.lazy(), band).collect() for band in band_numbers(lsh_bands)]
    assert all(rows.schema == BAND_SCHEMA for rows in by_band)
    assert [rows["band"].unique().to_list() for rows in by_band if rows.height] == [
        [band] for band in band_numbers(lsh_bands)
    ]
    assert by_band[-1].height == hashes.drop_nulls().len() and PROMPT_BAND == by_band[-1][0, "band"]
    whole = band_entries(index)
    assert pl.concat(by_band).sort("band", "record_id").equals(whole.sort("band", "record_id"))
