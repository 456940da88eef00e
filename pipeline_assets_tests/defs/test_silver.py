"""materialize() of silver on a test instance: the sample corpus over two batches,
re-runs, checks."""

from __future__ import annotations

import random
import shutil

import polars as pl
import pytest
from dagster import (
    AssetCheckSeverity,
    AssetMaterialization,
    DagsterRunStatus,
    Definitions,
    RunRequest,
    build_sensor_context,
    materialize,
)
from deltalake import write_deltalake

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.gold.assets import read_snapshot
from pipeline_assets.defs.keys import SILVER_RECORDS
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.defs.silver.checks import (
    KEPT_BY_SOURCE,
    _kept_counts,
    _removed_counts,
    silver_checks,
)
from pipeline_assets.defs.silver.sensors import SILVER_SELECTION, silver_in_order, silver_job
from pipeline_assets.lib.silver.dedup import BAND_SCHEMA, band_entries
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import checks_by_name, materialize_bronze, register
from pipeline_assets_tests.defs.gold_helpers import build_gold

GRAPH = [eval_sets, bronze, silver, *bronze_checks, *silver_checks]


def _materialize(instance, resources, batch_id):
    return materialize(
        GRAPH, partition_key=batch_id, instance=instance, resources=resources, raise_on_error=False
    )


@pytest.fixture
def two_sample_batches(instance, resources, landing_dir, eval_sets_dir, tmp_path):
    """The sample corpus in two batches: annotate and logs first, scrape and synth (later
    copies) next."""
    staging = tmp_path / "staging"
    manifest = write_sample_corpus(staging, records=3000, eval_sets_dir=eval_sets_dir)
    batches = []
    for sources in (("annotate", "logs"), ("scrape", "synth")):
        for source in sources:
            shutil.copytree(staging / source, landing_dir / source)
        batch = register(instance, resources)
        result = _materialize(instance, resources, batch)
        assert result.success, [
            e.event_specific_data.error.message for e in result.get_step_failure_events()
        ]
        batches.append((batch, result))
    return manifest, batches


def _removed_ids(lake) -> set[str]:
    ids = dict(lake.read("bronze", "records").select("record_id", "id").iter_rows())
    return {ids[r] for r in lake.read("silver", "rejects")["record_id"]}


def test_silver_on_the_sample_corpus_meets_recall_and_keeps_clean_records(
    two_sample_batches, resources
):
    manifest, batches = two_sample_batches
    lake = resources["lake"]
    removed = _removed_ids(lake)
    for kind in ("exact_duplicate", "near_duplicate", "eval_copy"):
        ids = [entry["id"] for entry in manifest["injected"][kind]]
        assert sum(i in removed for i in ids) / len(ids) >= 0.95, kind
    clean = set(manifest["clean_ids"])
    assert len(clean & removed) / len(clean) <= 0.01

    rejects = lake.read("silver", "rejects")
    cross_batch = rejects.filter(
        pl.col("stage").is_in(["exact_dup", "near_dup"]) & (pl.col("batch_id") == batches[1][0])
    )
    assert (
        cross_batch["duplicate_of"]
        .str.slice(0, 10)
        .is_in(
            lake.read("silver", "records")
            .filter(pl.col("batch_id") == batches[0][0])["record_id"]
            .str.slice(0, 10)
            .implode()
        )
        .any()
    ), "copies in batch 2 are matched against batch 1's index"
    assert set(rejects["stage"].str.split(":").list.first()) == {
        "exact_dup",
        "near_dup",
        "decontaminated",
        "quality",
    }
    contaminated = rejects.filter(pl.col("stage") == "decontaminated")
    assert (
        contaminated["eval_item_id"].is_not_null().all()
        and contaminated["matched_ngram"].is_not_null().all()
    )

    for batch, result in batches:
        bronze_rows = lake.read("bronze", "records", where=pl.col("batch_id") == batch).height
        kept = lake.read("silver", "records", where=pl.col("batch_id") == batch).height
        assert bronze_rows == kept + rejects.filter(pl.col("batch_id") == batch).height
        metadata = {
            m.asset_key.to_user_string(): m.metadata
            for m in result.asset_materializations_for_node("silver")
        }
        assert metadata["silver/records"]["upstream_delta_versions"].value[
            "bronze/records"
        ] == lake.version("bronze", "records") - (0 if batch == batches[1][0] else 1)
        assert metadata["silver/records"]["silver_rows"].value == kept
        found = metadata["silver/records"]["index_entries_found"].value
        assert found == 0 if batch == batches[0][0] else found > 0, (
            "batch 2 finds batch 1's entries by band"
        )
        lookup = {
            name: metadata["silver/records"][f"index_lookup_{name}"].value
            for name in ("bands", "task_seconds", "wait_seconds")
        }
        if batch == batches[0][0]:
            assert lookup == {"bands": 0, "task_seconds": 0.0, "wait_seconds": 0.0}, (
                "nothing to look up: the first batch's band searches are within it, block work"
            )
        # what the sizer spreads: a task a band (16 LSH bands and the exact hash's), timed, in
        # this process
        else:
            assert lookup["bands"] == 17 and 0 < lookup["task_seconds"] <= lookup["wait_seconds"]
            # sft records' exact hashes are a band of the band searches: no hash is left to look
            # up by band, and only the entries found are read
            tasks = metadata["silver/records"]["index_lookup_tasks"].value
            assert tasks == "17 band searches; 0 by band, 1 reading entries", tasks
        checks = checks_by_name(result)
        assert all(
            checks[f"silver/{t}:contract"].passed
            for t in ("records", "rejects", "minhash_index", "minhash_bands")
        )
        assert checks["silver/records:pass_rate"].passed

    index = lake.read("silver", "minhash_index")
    assert set(index.columns) == {
        "record_id",
        "batch_id",
        "exact_hash",
        "signature",
        "response_signature",
        "band_keys",
        "lsh_params",
        "prompt_hash",
    }
    assert sorted(index["record_id"]) == sorted(lake.read("silver", "records")["record_id"])
    assert lake.table("silver", "minhash_bands").metadata().partition_columns == [
        "band",
        "batch_id",
    ]
    bands = lake.read("silver", "minhash_bands").select(BAND_SCHEMA.names())
    assert bands.group_by("record_id").len()["len"].unique().to_list() == [17]
    assert bands.sort("band", "record_id").equals(band_entries(index).sort("band", "record_id")), (
        "a task a band wrote exactly the rows the index's entries make"
    )


def test_rematerializing_a_silver_batch_replaces_rows_and_index_entries(
    two_sample_batches, instance, resources
):
    _, batches = two_sample_batches
    lake = resources["lake"]
    tables = ("records", "rejects", "minhash_index", "minhash_bands")
    before = {t: lake.read("silver", t).height for t in tables}
    assert _materialize(instance, resources, batches[0][0]).success
    assert {t: lake.read("silver", t).height for t in tables} == before


def test_pass_rate_collapse_blocks_and_names_the_rule(instance, resources, landing_dir):
    long = (
        "This response explains the idea in plenty of ordinary words so that it passes every "
        "rule we have here today."
    )
    for i in range(3):
        write_landing_file(
            landing_dir,
            "logs",
            f"ok{i}.jsonl",
            [record(100 * i + j, response=f"{long} Case {i} {j}.") for j in range(20)],
        )
        assert _materialize(instance, resources, register(instance, resources)).success
    short = [record(900 + j, response=f"ok {j}") for j in range(12)] + [
        record(950 + j, response=f"{long} Later {j}.") for j in range(8)
    ]
    write_landing_file(landing_dir, "logs", "bad.jsonl", short)
    result = _materialize(instance, resources, register(instance, resources))
    check = checks_by_name(result)["silver/records:pass_rate"]
    assert not check.passed and check.blocking and check.severity == AssetCheckSeverity.ERROR
    assert "source 'logs'" in check.description and "quality:min_words" in check.description
    assert "to 40%" in check.description


def test_drift_check_reports_a_shift_in_response_length(instance, resources, landing_dir):
    rng = random.Random(5)
    words = [
        f"{stem}{i}" for stem in ("data", "model", "token", "layer", "query") for i in range(400)
    ]

    def responses(
        batch: int, shortest: int, longest: int
    ) -> list[dict]:  # distinct texts: no duplicates
        return [
            record(
                1000 * batch + j,
                response=" ".join(rng.choice(words) for _ in range(rng.randint(shortest, longest))),
            )
            for j in range(600)
        ]

    for batch in range(3):
        write_landing_file(landing_dir, "synth", f"b{batch}.jsonl", responses(batch, 40, 120))
        result = _materialize(instance, resources, register(instance, resources))
        assert result.success
        assert checks_by_name(result)["silver/records:drift"].passed
    assert "stable" in checks_by_name(result)["silver/records:drift"].description
    write_landing_file(landing_dir, "synth", "short.jsonl", responses(9, 8, 20))
    result = _materialize(instance, resources, register(instance, resources))
    drift = checks_by_name(result)["silver/records:drift"]
    assert not drift.passed and drift.severity == AssetCheckSeverity.ERROR and not drift.blocking
    assert "q_words PSI" in drift.description
    assert result.success, "drift reports; it does not stop the run"


def test_the_pass_rate_and_volume_counts_come_from_silvers_metadata_not_its_rows(
    two_sample_batches, instance, resources
):
    """The checks count each batch's kept rows by source and rejects by source and stage from its
    latest silver materialization: the tables' counts, read without reading a row. A batch whose
    materialization holds no counts (recorded before they were) is counted from its partition."""
    lake = resources["lake"]
    (first, _), (second, _) = two_sample_batches[1]
    kept_rows = pl.concat(
        [
            lake.scan("silver", t.fmt.silver_table).select("batch_id", "source")
            for t in FORMAT_TABLES
        ]
    )
    from_rows = kept_rows.group_by("batch_id", "source").agg(kept=pl.len().cast(pl.Int64))
    rejects = lake.scan("silver", "rejects").group_by("batch_id", "source", "stage")
    removed_rows = rejects.agg(removed=pl.len().cast(pl.Int64)).collect()
    order = ["batch_id", "source"]
    assert _kept_counts(instance, lake, second).sort(order).equals(from_rows.collect().sort(order))
    removed = _removed_counts(instance, lake, second).sort([*order, "stage"])
    assert removed.equals(removed_rows.sort([*order, "stage"])) and removed.height > 4
    assert _kept_counts(instance, lake, first)["batch_id"].unique().to_list() == [first]

    said = pl.DataFrame({"source": ["annotate"], "rows": [7]}).cast({"rows": pl.UInt32})
    told = AssetMaterialization(
        SILVER_RECORDS, partition=first, metadata={KEPT_BY_SOURCE: table_metadata(said)}
    )
    instance.report_runless_asset_event(told)
    annotate = (pl.col("batch_id") == first) & (pl.col("source") == "annotate")
    in_records = lake.scan("silver", "records").filter(annotate).select(pl.len()).collect().item()
    in_all = from_rows.filter(annotate).collect()["kept"].item()
    recounted = _kept_counts(instance, lake, second).filter(annotate)["kept"].item()
    assert in_records > 7 and recounted == in_all - in_records + 7, "the metadata's, not the rows'"
    instance.report_runless_asset_event(AssetMaterialization(SILVER_RECORDS, partition=first))
    assert _kept_counts(instance, lake, second).sort(order).equals(from_rows.collect().sort(order))


def test_volume_warns_when_a_source_triples(instance, resources, landing_dir):
    rng = random.Random(8)
    words = [f"word{i}" for i in range(3000)]

    def rows(start: int, count: int) -> list[dict]:
        return [
            record(start + j, response=" ".join(rng.choice(words) for _ in range(40)))
            for j in range(count)
        ]

    for batch in range(3):
        write_landing_file(landing_dir, "scrape", f"b{batch}.jsonl", rows(1000 * batch, 20))
        assert checks_by_name(_materialize(instance, resources, register(instance, resources)))[
            "silver/records:volume"
        ].passed
    write_landing_file(landing_dir, "scrape", "big.jsonl", rows(9000, 60))
    volume = checks_by_name(_materialize(instance, resources, register(instance, resources)))[
        "silver/records:volume"
    ]
    assert not volume.passed and volume.severity == AssetCheckSeverity.WARN
    assert "source 'scrape': 60 rows vs trailing median 20 (+200%)" in volume.description


def _sensor_says(instance):
    """What silver_in_order decides on its next tick: a RunRequest or a SkipReason."""
    resources = {"batch_gates": batch_gates()}
    with build_sensor_context(instance=instance, resources=resources) as context:
        return silver_in_order(context)


def _silver_as_the_sensor_orders(instance, resources) -> list[str]:
    """The daemon's loop, in the foreground: run what silver_in_order requests until it
    requests nothing."""
    ran = []
    while isinstance(request := _sensor_says(instance), RunRequest):
        result = materialize(
            GRAPH,
            selection=SILVER_SELECTION,
            partition_key=request.partition_key,
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )
        assert result.success, [
            e.event_specific_data.error.message for e in result.get_step_failure_events()
        ]
        assert checks_by_name(result)["silver/records:pass_rate"].passed, (
            "the job runs silver's checks"
        )
        ran.append(request.partition_key)
    return ran


def _texts(rng: random.Random, count: int, start: int) -> list[dict]:
    words = [f"{stem}{i}" for stem in ("river", "stone", "cloud", "field") for i in range(300)]
    return [
        record(start + j, response=" ".join(rng.choice(words) for _ in range(30)))
        for j in range(count)
    ]


def test_a_blocked_batch_neither_holds_silver_back_nor_decides_dedup(
    instance, resources, landing_dir
):
    """Three batches registered at once, the middle one blocked by a renamed field, the third
    resending some of its records: those reach silver; once the mapping is fixed and the middle
    batch re-run, its copies are the ones rejected, and the next snapshot holds each record once."""
    rng = random.Random(13)
    vendor = _texts(rng, 10, 100)
    write_landing_file(landing_dir, "logs", "a.jsonl", _texts(rng, 10, 0))
    first = register(instance, resources)
    renamed = [
        {("completion" if k == "response" else k): v for k, v in row.items()} for row in vendor
    ]
    write_landing_file(landing_dir, "vendor", "b.jsonl", renamed)
    middle = register(instance, resources)
    resent = vendor[:4]  # the vendor resends four records with the right field name
    write_landing_file(landing_dir, "vendor", "c.jsonl", _texts(rng, 10, 200) + resent)
    third = register(instance, resources)
    quarantine_rate = {
        batch: checks_by_name(materialize_bronze(instance, resources, batch))[
            "bronze/records:quarantine_rate"
        ]
        for batch in (first, middle, third)
    }
    assert [quarantine_rate[batch].passed for batch in (first, middle, third)] == [
        True,
        False,
        True,
    ]

    assert _silver_as_the_sensor_orders(instance, resources) == [first, third], (
        "the blocked batch holds nothing back"
    )
    lake = resources["lake"]
    kept = lake.read("silver", "records", where=pl.col("batch_id") == third)
    assert set(kept["prompt"]) >= {row["prompt"] for row in resent}, (
        "no record that never reaches gold rejects them"
    )

    mapped = LandingResource(
        uri=str(landing_dir), field_mappings={"vendor": {"completion": "response"}}
    )
    assert checks_by_name(materialize_bronze(instance, resources, middle, landing=mapped))[
        "bronze/records:quarantine_rate"
    ].passed
    assert _silver_as_the_sensor_orders(instance, resources) == [middle]
    rejects = lake.read("silver", "rejects", where=pl.col("batch_id") == middle)
    assert sorted(rejects["prompt"]) == sorted(row["prompt"] for row in resent)
    assert set(rejects["stage"]) == {"exact_dup"}
    assert set(rejects["duplicate_of"]) <= set(kept["record_id"]), (
        "the re-run batch yields to the copies kept before"
    )

    assert build_gold(instance, resources, GRAPH).success
    in_snapshot = read_snapshot(lake, "gold-v0")["record_ids"].explode()
    silver = lake.read("silver", "records")
    prompts = silver.filter(pl.col("record_id").is_in(in_snapshot.implode()))["prompt"]
    assert prompts.is_in([row["prompt"] for row in vendor]).sum() == len(vendor), (
        "each vendor record exactly once"
    )
    assert prompts.n_unique() == prompts.len()


def test_silver_in_order_requests_the_oldest_pending_batch_once(instance, resources, landing_dir):
    batches = []
    for name in ("a", "b", "c"):
        write_landing_file(
            landing_dir, "logs", f"{name}.jsonl", [record(100 * len(batches) + i) for i in range(5)]
        )
        batches.append(register(instance, resources))
    first, second, third = batches
    assert f"batch {first}: bronze not materialized yet" in _sensor_says(instance).skip_message

    for batch in (first, second):
        assert materialize_bronze(instance, resources, batch).success
    request = _sensor_says(instance)
    assert request.partition_key == first
    assert _sensor_says(instance).run_key == request.run_key, (
        "the same state, the same run key: launched once"
    )

    job = Definitions(
        assets=GRAPH[:3], asset_checks=GRAPH[3:], jobs=[silver_job], resources=resources
    ).resolve_job_def(silver_job.name)
    queued = instance.create_run_for_job(
        job,
        status=DagsterRunStatus.NOT_STARTED,
        tags={"dagster/partition": first},
        asset_selection=set(SILVER_SELECTION.resolve(job.asset_layer.asset_graph)),
    )
    assert f"silver of batch {first} is queued or running" in _sensor_says(instance).skip_message
    instance.report_run_canceled(queued)
    assert _sensor_says(instance).partition_key == second, (
        "a silver run that ended without silver excludes its batch"
    )

    assert _silver_as_the_sensor_orders(instance, resources) == [second]
    assert f"batch {third}: bronze not materialized yet" in _sensor_says(instance).skip_message


def test_silver_run_by_hand_out_of_order_fails_at_once_naming_the_batches_it_needs(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "logs", "a.jsonl", [record(i) for i in range(5)])
    first = register(instance, resources)
    write_landing_file(landing_dir, "logs", "b.jsonl", [record(10 + i) for i in range(5)])
    second = register(instance, resources)
    for batch in (first, second):
        assert materialize(
            [bronze, *bronze_checks], partition_key=batch, instance=instance, resources=resources
        ).success
    result = materialize(
        GRAPH,
        partition_key=second,
        instance=instance,
        resources=resources,
        selection=[silver],
        raise_on_error=False,
    )
    assert not result.success
    [failure] = result.get_step_failure_events()
    message = failure.event_specific_data.error.message
    assert f"{first} (silver missing or older than bronze)" in message
    assert resources["lake"].read("silver", "records") is None, "nothing is written"
    assert (
        _materialize(instance, resources, first).success
        and _materialize(instance, resources, second).success
    )


def test_pipeline_assets_run_redoes_silver_older_than_its_bronze_before_later_batches(
    instance, resources, landing_dir
):
    from pipeline_assets.cli.headless import run_stale, stale_partitions

    defs = Definitions(
        assets=[eval_sets, bronze, silver],
        asset_checks=[*bronze_checks, *silver_checks],
        resources=resources,
    )
    write_landing_file(landing_dir, "logs", "a.jsonl", [record(i) for i in range(5)])
    first = register(instance, resources)
    assert _materialize(instance, resources, first).success
    assert materialize_bronze(
        instance, resources, first
    ).success  # by hand, say from the UI: silver is now older
    write_landing_file(landing_dir, "logs", "b.jsonl", [record(10 + i) for i in range(5)])
    second = register(instance, resources)

    plan = stale_partitions(defs, instance, list(defs.resolve_asset_graph().get_all_asset_keys()))
    assert [k.to_user_string() for k in plan[first]] == [
        "silver/conversations",
        "silver/minhash_bands",
        "silver/minhash_index",
        "silver/preference_pairs",
        "silver/records",
        "silver/rejects",
    ]
    assert list(plan) == [first, second]
    outcome = run_stale(defs, instance, None)
    assert outcome.ok, outcome.failed_runs + outcome.failed_blocking_checks
    assert "every batch is done or excluded" in _sensor_says(instance).skip_message


def test_answers_to_one_shared_prompt_survive_and_an_older_index_takes_response_signatures(
    instance, resources, landing_dir
):
    """Batch 1's index is rewritten as tables were before responses were signed, and before the
    index had a table by band: batch 2 adds batch 1's keys to silver/minhash_bands, still dedups
    against it (on prompt + response), keeps every different answer to its own shared prompt, and
    the index gains the column."""
    rng = random.Random(11)
    words = [
        f"{stem}{i}" for stem in ("data", "model", "token", "layer", "query") for i in range(400)
    ]

    def answers(start: int, count: int) -> list[dict]:
        context = " ".join(rng.choice(words) for _ in range(600))
        return [
            record(
                start + j, prompt=context, response=" ".join(rng.choice(words) for _ in range(40))
            )
            for j in range(count)
        ]

    first = answers(0, 20)
    write_landing_file(landing_dir, "synth", "b1.jsonl", first)
    assert _materialize(instance, resources, register(instance, resources)).success
    lake = resources["lake"]
    legacy = lake.read("silver", "minhash_index").drop("response_signature")
    write_deltalake(
        lake.table_uri("silver", "minhash_index"),
        legacy.to_arrow(),
        mode="overwrite",
        schema_mode="overwrite",
        partition_by=["batch_id"],
    )
    shutil.rmtree(lake.table_uri("silver", "minhash_bands"))

    write_landing_file(
        landing_dir, "synth", "b2.jsonl", answers(100, 20) + [{**first[3], "id": "copy"}]
    )
    batch = register(instance, resources)
    result = _materialize(instance, resources, batch)
    assert result.success and checks_by_name(result)["silver/minhash_index:contract"].passed
    assert lake.read("silver", "records", where=pl.col("batch_id") == batch).height == 20
    rejects = lake.read("silver", "rejects", where=pl.col("batch_id") == batch)
    assert rejects["stage"].to_list() == ["exact_dup"]
    assert lake.read("silver", "minhash_bands").group_by("batch_id").len().sort("batch_id")[
        "len"
    ].to_list() == [17 * 20, 17 * 20]
    index = lake.read("silver", "minhash_index")
    assert index.group_by("batch_id").agg(pl.col("response_signature").is_null().all()).sort(
        "batch_id"
    )[:, 1].to_list() == [True, False]


def test_the_lookup_cuts_the_other_batches_into_slices_by_their_indexed_records(tmp_path):
    from deltalake import DeltaTable

    from pipeline_assets.defs.silver.lookup import batch_slices

    uri = str(tmp_path / "minhash_index")
    for batch, rows in (("b1", 6), ("b2", 5), ("b3", 4), ("b4", 9)):
        write_deltalake(
            uri,
            pl.DataFrame(
                {"record_id": [f"{batch}-{i}" for i in range(rows)], "batch_id": batch}
            ).to_arrow(),
            mode="append",
            partition_by=["batch_id"],
        )
    index = DeltaTable(uri)
    assert batch_slices(index, [], 10) == [["b1"], ["b2", "b3"], ["b4"]]
    assert batch_slices(index, ["b2"], 10) == [["b1", "b3"], ["b4"]]
    assert batch_slices(index, [], 100) == [["b1", "b2", "b3", "b4"]]


def test_a_silver_run_asks_the_event_log_once_which_batches_are_blocked(
    instance, resources, landing_dir, monkeypatch
):
    """Whether earlier batches are settled, and which ones dedup leaves out, come from one query of
    the batch gates (it was asked three times a run)."""
    write_landing_file(landing_dir, "logs", "a.jsonl", [record(i) for i in range(20)])
    batch = register(instance, resources)
    assert _materialize(instance, resources, batch).success
    storage = instance.event_log_storage
    real_query = storage.get_asset_check_partition_info
    asked = []

    def counted_query(keys, *args, **kwargs):
        asked.append(keys)
        return real_query(keys, *args, **kwargs)

    monkeypatch.setattr(storage, "get_asset_check_partition_info", counted_query)
    rerun = materialize(
        GRAPH, selection=[silver], partition_key=batch, instance=instance, resources=resources
    )
    assert rerun.success
    assert len(asked) == 1 and set(asked[0]) == set(resources["batch_gates"].check_keys())
