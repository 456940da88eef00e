"""materialize() of bronze on a test instance: accounting, provenance, re-runs, schema
drift, checks."""

from __future__ import annotations

import polars as pl
from dagster import AssetCheckSeverity, asset, materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.keys import BRONZE_QUARANTINE, BRONZE_RECORDS
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.lib.delta_files import partition_slices
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets_tests.conftest import jsonl_bytes, record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import (
    batch_rows,
    checks_by_name,
    materialize_bronze,
    register,
)


def _mixed_landing(landing_dir):
    write_landing_file(
        landing_dir, "annotate", "a.jsonl", [record(i) for i in range(40)] + [b'{"prompt": "cut']
    )
    write_landing_file(
        landing_dir,
        "synth",
        "s.jsonl.zst",
        [record(100 + i, system="Be brief.") for i in range(30)],
    )
    write_landing_file(
        landing_dir, "logs", "l.jsonl.gz", [record(200 + i, session_id=f"s{i}") for i in range(30)]
    )
    write_landing_file(
        landing_dir,
        "scrape",
        "p.parquet",
        [record(300 + i, url=f"https://x/{i}") for i in range(30)],
    )


def test_bronze_accounts_for_every_line_of_every_format(instance, resources, landing_dir):
    _mixed_landing(landing_dir)
    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)
    assert result.success

    records, quarantine = (
        batch_rows(resources["lake"], "records", batch),
        batch_rows(resources["lake"], "quarantine", batch),
    )
    assert records.height == 130 and quarantine.height == 1
    assert quarantine.row(0, named=True)["reason"] == "invalid_json"
    assert quarantine.row(0, named=True)["raw"] == '{"prompt": "cut'
    assert sorted(records["source"].unique()) == ["annotate", "logs", "scrape", "synth"]
    assert records["record_id"].n_unique() == records.height
    assert records.filter(pl.col("source") == "logs")["extra"][0] == '{"session_id":"s0"}'
    assert records.filter(pl.col("source") == "synth")["system"].unique().to_list() == ["Be brief."]

    metadata = result.asset_materializations_for_node("bronze")
    by_key = {m.asset_key: m.metadata for m in metadata}
    accounting = by_key[BRONZE_RECORDS]["per_file_accounting"].value.records
    assert len(accounting) == 4
    for row in accounting:
        assert row.data["lines_read"] == row.data["bronze_rows"] + row.data["quarantined"]
    assert by_key[BRONZE_RECORDS]["lines_read"].value == 131
    for key in (BRONZE_RECORDS, BRONZE_QUARANTINE):
        meta = by_key[key]
        assert meta["delta_version"].value == resources["lake"].version(*key.path)
        assert {
            "dagster/uri",
            "dagster/row_count",
            "dagster/column_schema",
            "upstream_delta_versions",
            "rows_per_second",
            "mb_per_second",
            "wall_seconds",
            "cpu_seconds",
        } <= set(meta)
    assert by_key[BRONZE_QUARANTINE]["dagster/row_count"].value == 1

    checks = checks_by_name(result)
    assert checks["bronze/records:contract"].passed
    assert checks["bronze/quarantine:contract"].passed
    assert checks["bronze/records:quarantine_rate"].passed  # 1 of 41 annotate lines = 2.4% < 5%


def test_the_run_log_shows_progress_and_names_each_file_that_set_lines_aside(
    instance, resources, landing_dir
):
    _mixed_landing(landing_dir)
    result = materialize_bronze(instance, resources, register(instance, resources))
    messages = [
        entry.user_message for entry in instance.all_logs(result.run_id) if entry.user_message
    ]
    progress = [m for m in messages if " file(s) read: " in m]
    assert progress == [
        "4 of 4 file(s) read: 130 record(s) accepted, 1 set aside\n"
        "  annotate/a.jsonl: 41 lines counted, 40 accepted, 1 set aside (invalid_json 1)"
    ], "a batch read in seconds logs once, at its end, naming the file that set a line aside"


def test_a_progress_line_names_so_many_files_and_counts_the_rest(
    instance, resources, landing_dir, monkeypatch
):
    from pipeline_assets.defs.bronze.assets import _BatchRead

    monkeypatch.setattr(_BatchRead, "FILES_NAMED", 2)
    for name in "abcd":
        write_landing_file(landing_dir, "annotate", f"{name}.jsonl", [record(1), b"[]"])
    result = materialize_bronze(instance, resources, register(instance, resources))
    [progress] = [
        e.user_message
        for e in instance.all_logs(result.run_id)
        if " file(s) read: " in (e.user_message or "")
    ]
    assert progress.splitlines()[1:] == [
        "  annotate/a.jsonl: 2 lines counted, 1 accepted, 1 set aside (not_an_object 1)",
        "  annotate/b.jsonl: 2 lines counted, 1 accepted, 1 set aside (not_an_object 1)",
        "  and 2 more file(s) with lines set aside (per_file_accounting lists them)",
    ]


def test_rematerializing_a_batch_replaces_its_rows(instance, resources, landing_dir):
    _mixed_landing(landing_dir)
    batch = register(instance, resources)
    first = materialize_bronze(instance, resources, batch)
    ids_first = sorted(batch_rows(resources["lake"], "records", batch)["record_id"])
    second = materialize_bronze(instance, resources, batch)
    assert first.success and second.success
    records = resources["lake"].read("bronze", "records")
    assert records.height == 130, "a re-run must replace the batch, never append a second copy"
    assert sorted(records["record_id"]) == ids_first, "record_id is stable across re-runs"
    assert resources["lake"].read("bronze", "quarantine").height == 1


def test_batches_accumulate_and_stay_separate(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(i) for i in range(10)])
    first = register(instance, resources)
    assert materialize_bronze(instance, resources, first).success
    write_landing_file(landing_dir, "annotate", "b.jsonl", [record(i) for i in range(10, 25)])
    second = register(instance, resources)
    assert second > first, "batch keys sort in arrival order"
    assert materialize_bronze(instance, resources, second).success
    records = resources["lake"].read("bronze", "records")
    assert records.group_by("batch_id").len().sort("batch_id")["len"].to_list() == [10, 15]


def test_schema_drift_is_quarantined_blocks_and_is_fixed_by_a_mapping(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "logs", "old.jsonl.gz", [record(i) for i in range(20)])
    assert materialize_bronze(instance, resources, register(instance, resources)).success

    renamed = [
        {
            **{k: v for k, v in record(100 + i).items() if k != "response"},
            "completion": f"answer {i}",
        }
        for i in range(20)
    ]
    write_landing_file(landing_dir, "logs", "new.jsonl.gz", renamed)
    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)

    quarantine = batch_rows(resources["lake"], "quarantine", batch)
    assert quarantine.height == 20
    assert set(quarantine["reason"]) == {"missing_field:response"}
    assert all("completion" in detail for detail in quarantine["detail"])
    check = checks_by_name(result)["bronze/records:quarantine_rate"]
    assert not check.passed and check.severity == AssetCheckSeverity.ERROR and check.blocking
    for words in ("'logs'", "'response'", "'completion'", '{"logs": {"completion": "response"}}'):
        assert words in check.description
    assert batch_rows(resources["lake"], "records", batch).height == 0

    mapped = LandingResource(
        uri=resources["landing"].uri, field_mappings={"logs": {"completion": "response"}}
    )
    fixed = materialize_bronze(instance, resources, batch, landing=mapped)
    assert checks_by_name(fixed)["bronze/records:quarantine_rate"].passed
    records = batch_rows(resources["lake"], "records", batch)
    assert records.height == 20 and records["response"][0].startswith("answer")
    assert batch_rows(resources["lake"], "quarantine", batch).height == 0


def pair(i: int, **fields) -> dict:
    return {
        "id": f"p{i}",
        "prompt": f"Which answer to question {i} is better?",
        "chosen": f"The careful answer {i}.",
        "rejected": f"The sloppy answer {i}.",
        "created_at": "2026-11-20T10:00:00Z",
        **fields,
    }


def test_a_preference_source_lands_in_its_own_table_beside_the_sft_ones(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(i) for i in range(10)])
    write_landing_file(
        landing_dir,
        "prefs",
        "p.jsonl.gz",
        [pair(i, score_chosen=9, score_rejected=3) for i in range(30)] + [pair(99, rejected=None)],
    )
    batch = register(instance, resources)
    prefs = LandingResource(uri=resources["landing"].uri, source_formats={"prefs": "preference"})
    result = materialize_bronze(instance, resources, batch, landing=prefs)
    assert result.success

    lake = resources["lake"]
    assert batch_rows(lake, "records", batch)["source"].unique().to_list() == ["annotate"]
    pairs = batch_rows(lake, "preference_records", batch)
    assert pairs.height == 30 and pairs["score_chosen"].unique().to_list() == [9.0]
    assert pairs["record_id"].n_unique() == 30 and pairs["source_file"].unique().to_list() == [
        "prefs/p.jsonl.gz"
    ]
    assert batch_rows(lake, "quarantine", batch).select("source", "reason").rows() == [
        ("prefs", "missing_field:rejected")
    ]
    checks = checks_by_name(result)
    for name in (
        "bronze/records:contract",
        "bronze/preference_records:contract",
        "bronze/records:accounting",
        "bronze/records:quarantine_rate",
    ):
        assert checks[name].passed, name
    by_key = {
        m.asset_key.to_user_string(): m.metadata
        for m in result.asset_materializations_for_node("bronze")
    }
    assert by_key["bronze/preference_records"]["dagster/row_count"].value == 30
    assert by_key["bronze/records"]["dagster/row_count"].value == 10


def test_preference_pairs_in_an_sft_source_block_and_name_the_source_format_setting(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "prefs", "p.jsonl", [pair(i) for i in range(20)])
    batch = register(instance, resources)
    result = materialize_bronze(instance, resources, batch)
    gate = checks_by_name(result)["bronze/records:quarantine_rate"]
    assert not gate.passed and gate.blocking
    assert """PIPELINE_SOURCE_FORMATS='{"prefs": "preference"}'""" in gate.description
    assert "PIPELINE_FIELD_MAPPINGS" not in gate.description, (
        "no mapping of chosen or rejected onto response"
    )

    fixed = materialize_bronze(
        instance,
        resources,
        batch,
        landing=LandingResource(
            uri=resources["landing"].uri, source_formats={"prefs": "preference"}
        ),
    )
    assert checks_by_name(fixed)["bronze/records:quarantine_rate"].passed
    assert batch_rows(resources["lake"], "preference_records", batch).height == 20
    assert batch_rows(resources["lake"], "quarantine", batch).height == 0


def test_volume_warns_when_rows_per_mb_jumps(instance, resources, landing_dir):
    for i in range(3):  # a history of batches with ordinary records
        write_landing_file(
            landing_dir, "synth", f"s{i}.jsonl", [record(100 * i + j) for j in range(30)]
        )
        assert materialize_bronze(instance, resources, register(instance, resources)).success
    huge = [record(900 + j, response="x" * 5000) for j in range(30)]  # same rows, ~30x the bytes
    write_landing_file(landing_dir, "synth", "s9.jsonl", huge)
    result = materialize_bronze(instance, resources, register(instance, resources))
    volume = checks_by_name(result)["bronze/records:volume"]
    assert not volume.passed and volume.severity == AssetCheckSeverity.WARN
    assert "synth" in volume.description and "trailing median" in volume.description
    assert result.success, "a warning never fails the run"


def test_freshness_warns_on_old_event_times(instance, resources, landing_dir):
    write_landing_file(
        landing_dir,
        "annotate",
        "old.jsonl",
        [record(i, created_at="2020-01-01T00:00:00Z") for i in range(5)],
    )
    write_landing_file(
        landing_dir, "synth", "new.jsonl", [record(10 + i, created_at=...) for i in range(5)]
    )
    result = materialize_bronze(instance, resources, register(instance, resources))
    freshness = checks_by_name(result)["bronze/records:freshness"]
    assert not freshness.passed and freshness.severity == AssetCheckSeverity.WARN
    assert "annotate" in freshness.description and "synth" not in freshness.description


def test_file_changed_after_registration_is_quarantined_not_skipped(
    instance, resources, landing_dir
):
    path = write_landing_file(landing_dir, "annotate", "a.jsonl", [record(i) for i in range(5)])
    batch = register(instance, resources)
    write_landing_file(
        landing_dir, "annotate", "a.jsonl", [record(i, response=f"new {i}") for i in range(6)]
    )
    result = materialize_bronze(instance, resources, batch)
    quarantine = batch_rows(resources["lake"], "quarantine", batch)
    assert quarantine["reason"].to_list() == ["unreadable_file"]
    assert "changed since registration" in quarantine["detail"][0]
    assert not checks_by_name(result)["bronze/records:quarantine_rate"].passed
    assert path.exists()


def test_failed_blocking_check_stops_downstream_of_that_batch(instance, resources, landing_dir):
    consumed = []

    @asset(key=["test", "downstream"], deps=[BRONZE_RECORDS], partitions_def=ingest_batches)
    def downstream(context) -> None:  # stands in for silver
        consumed.append(context.partition_key)

    def run(batch):
        return materialize(
            [bronze, *bronze_checks, downstream],
            partition_key=batch,
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )

    write_landing_file(landing_dir, "logs", "good.jsonl", [record(i) for i in range(20)])
    good = register(instance, resources)
    assert run(good).success and consumed == [good]

    write_landing_file(
        landing_dir,
        "logs",
        "drifted.jsonl",
        [{"prompt": f"q{i}", "completion": "a"} for i in range(20)],
    )
    drifted = register(instance, resources)
    result = run(drifted)
    assert not result.success
    assert consumed == [good], "downstream must not run for the blocked batch"
    assert "quarantine_rate" in str(
        result.get_step_failure_events()[0].event_specific_data.error.message
    )


def test_contract_check_fails_on_a_tampered_table(instance, resources, landing_dir):
    from pipeline_assets.contracts import BronzeRecord
    from pipeline_assets.defs.check_helpers import contract_check_result, sliced_contract_result

    write_landing_file(landing_dir, "annotate", "a.jsonl", [record(i) for i in range(5)])
    batch = register(instance, resources)
    assert materialize_bronze(instance, resources, batch).success
    lake = resources["lake"]
    rows = batch_rows(lake, "records", batch)
    assert contract_check_result(rows, BronzeRecord).passed
    lake.append(
        "bronze", "records", rows.head(1).with_columns(prompt=pl.lit("   "))
    )  # duplicate id, blank prompt

    contract = contract_check_result(batch_rows(lake, "records", batch), BronzeRecord)
    assert not contract.passed
    assert (
        contract.metadata["failure_cases"].value == 3
    )  # record_id twice (not unique), prompt blank
    assert "BronzeRecord" in contract.description

    # the check as it runs, slices of a byte budget (here: a row at a time), the duplicate in
    # another slice than its original
    def slices(max_bytes: int = 1):
        return partition_slices(lake.table("bronze", "records"), "batch_id", batch, max_bytes)

    sliced = sliced_contract_result(slices, BronzeRecord)
    assert [frame.height for frame in slices()] == [1] * 6
    assert [frame.height for frame in slices(2**30)] == [6], "both files' rows in one slice"
    assert not sliced.passed and sliced.metadata["rows"].value == 6
    assert sliced.metadata["failure_cases"].value == 3, sliced.metadata["failures"].value
    assert sliced_contract_result(lambda: iter([rows]), BronzeRecord).passed


def test_accounting_check_fails_when_the_parser_loses_a_line(
    instance, resources, landing_dir, monkeypatch
):
    from pipeline_assets.lib.landing import files as landing_files

    write_landing_file(landing_dir, "annotate", "a.jsonl.gz", [record(i) for i in range(30)])
    write_landing_file(landing_dir, "synth", "s.parquet", [record(100 + i) for i in range(10)])
    batch = register(instance, resources)
    assert checks_by_name(materialize_bronze(instance, resources, batch))[
        "bronze/records:accounting"
    ].passed

    decompress = landing_files._decompress

    def loses_line_7(fmt, data):  # a reader bug: one line of the decompressed stream goes missing
        text, failure = decompress(fmt, data)
        lines = text.split(b"\n")
        return b"\n".join(lines[:6] + lines[7:]), failure

    monkeypatch.setattr(landing_files, "_decompress", loses_line_7)
    result = materialize_bronze(instance, resources, batch)
    accounting = checks_by_name(result)["bronze/records:accounting"]
    assert (
        not accounting.passed
        and accounting.blocking
        and accounting.severity == AssetCheckSeverity.ERROR
    )
    assert (
        accounting.description
        == "annotate/a.jsonl.gz: 30 lines in the file, 29 rows in bronze and quarantine"
    )
    assert not result.success, "a blocking check failed"


def test_an_unreadable_file_blocks_its_batch_whatever_its_share(instance, resources, landing_dir):
    write_landing_file(landing_dir, "annotate", "big.jsonl", [record(i) for i in range(200)])
    (landing_dir / "annotate" / "broken.jsonl.gz").write_bytes(b"this is not gzip")
    result = materialize_bronze(instance, resources, register(instance, resources))
    gate = checks_by_name(result)["bronze/records:quarantine_rate"]
    assert not gate.passed and gate.blocking, (
        "1 quarantined unit of 201 is under 5%, but the file was lost whole"
    )
    assert "annotate/broken.jsonl.gz" in gate.description and "unreadable_file" in gate.description
    assert checks_by_name(result)["bronze/records:accounting"].passed


def test_an_appended_export_ingests_only_its_new_lines(instance, resources, landing_dir):
    path = write_landing_file(landing_dir, "logs", "export.jsonl", [record(i) for i in range(100)])
    first = register(instance, resources)
    assert materialize_bronze(instance, resources, first).success
    with path.open("ab") as export:
        export.write(jsonl_bytes([record(100 + i) for i in range(30)]))
    second = register(instance, resources)
    result = materialize_bronze(instance, resources, second)

    assert result.success
    records, quarantine = (
        batch_rows(resources["lake"], "records", second),
        batch_rows(resources["lake"], "quarantine", second),
    )
    assert sorted(records["source_line"]) == list(range(101, 131))
    assert records["id"].to_list() == [f"r{100 + i}" for i in range(30)]
    assert quarantine.height == 100 and set(quarantine["reason"]) == {"already_ingested"}
    assert first in quarantine["detail"][0]
    checks = checks_by_name(result)
    assert (
        checks["bronze/records:quarantine_rate"].passed
        and checks["bronze/records:accounting"].passed
    )
    assert checks["bronze/records:volume"].passed, checks["bronze/records:volume"].description


def test_a_rewritten_export_is_ingested_whole_again(instance, resources, landing_dir):
    path = write_landing_file(landing_dir, "logs", "export.jsonl", [record(i) for i in range(20)])
    assert materialize_bronze(instance, resources, register(instance, resources)).success
    write_landing_file(
        landing_dir,
        "logs",
        "export.jsonl",
        [record(i, response=f"revised answer {i}") for i in range(25)],
    )
    second = register(instance, resources)
    assert materialize_bronze(instance, resources, second).success
    assert batch_rows(resources["lake"], "records", second).height == 25, (
        "not an append: every line is new"
    )
    assert path.exists()


def test_a_good_copy_landed_later_releases_the_batch_a_broken_file_blocked(
    instance, resources, landing_dir
):
    write_landing_file(landing_dir, "annotate", "good.jsonl", [record(i) for i in range(50)])
    broken = landing_dir / "annotate" / "late.jsonl.gz"
    broken.write_bytes(b"half an upload")
    blocked = register(instance, resources)
    assert not checks_by_name(materialize_bronze(instance, resources, blocked))[
        "bronze/records:quarantine_rate"
    ].passed

    write_landing_file(
        landing_dir, "annotate", "late.jsonl.gz", [record(100 + i) for i in range(20)]
    )
    fixed = register(instance, resources)
    assert materialize_bronze(instance, resources, fixed).success
    again = checks_by_name(materialize_bronze(instance, resources, blocked))[
        "bronze/records:quarantine_rate"
    ]
    assert (
        again.passed
        and "annotate/late.jsonl.gz" in again.description
        and "later batch" in again.description
    )
    assert batch_rows(resources["lake"], "records", blocked).height == 50
    assert batch_rows(resources["lake"], "records", fixed).height == 20


def test_an_appended_export_does_not_release_a_batch_its_bad_lines_blocked(
    instance, resources, landing_dir
):
    path = write_landing_file(
        landing_dir, "logs", "export.jsonl", [record(i) for i in range(8)] + [b"{broken"] * 2
    )
    blocked = register(instance, resources)
    assert not checks_by_name(materialize_bronze(instance, resources, blocked))[
        "bronze/records:quarantine_rate"
    ].passed
    with path.open("ab") as export:
        export.write(jsonl_bytes([record(100 + i) for i in range(5)]))
    assert materialize_bronze(instance, resources, register(instance, resources)).success
    again = checks_by_name(materialize_bronze(instance, resources, blocked))[
        "bronze/records:quarantine_rate"
    ]
    assert not again.passed, (
        "the file was read whole the first time: its bad lines still count there"
    )
    assert batch_rows(resources["lake"], "records", blocked).height == 8, (
        "the re-run reads the registered start of the file"
    )
    assert (
        sorted(batch_rows(resources["lake"], "quarantine", blocked)["reason"])
        == ["invalid_json"] * 2
    )
