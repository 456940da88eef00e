"""The code location loads once, whole, with the keys DESIGN.md §1 fixes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_assets.definitions import defs

ROOT = Path(__file__).resolve().parents[1]


def test_asset_keys_groups_checks_and_sensor():
    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string(): graph.get(key) for key in graph.get_all_asset_keys()}
    assert {"bronze/records", "bronze/quarantine", "reference/eval_sets"} <= set(keys)
    assert keys["bronze/records"].group_name == "bronze"
    assert keys["bronze/records"].partitions_def.name == "ingest_batches"
    checks = {
        (spec.asset_key.to_user_string(), spec.name, spec.blocking)
        for checks_def in defs.asset_checks
        for spec in checks_def.check_specs
    }
    assert {
        ("bronze/records", "contract", True),
        ("bronze/records", "quarantine_rate", True),
        ("bronze/records", "volume", False),
        ("bronze/records", "freshness", False),
        ("bronze/quarantine", "contract", True),
    } <= checks
    assert defs.resolve_sensor_def("landing_sensor").default_status.value == "RUNNING"
    assert defs.resolve_sensor_def("silver_in_order").default_status.value == "RUNNING"
    assert keys["reference/eval_sets"].is_observable, (
        "observed: its data version is the sha256 of its files"
    )
    assert defs.resolve_sensor_def("eval_sets_watcher").default_status.value == "RUNNING"
    assert keys["silver/records"].automation_condition is None, (
        "silver_in_order is silver's only automatic requester"
    )
    assert keys["gold/sequences"].partitions_def.name == "ingest_batches", (
        "one gold shard per ingest batch"
    )
    assert keys["gold/sequences"].automation_condition is not None, (
        "a batch's shard follows its silver"
    )
    assert keys["gold/snapshots"].automation_condition is None, (
        "snapshot_cadence cuts snapshots, not every batch"
    )
    assert {"token_length_drift", "token_volume"} <= {
        key.name for key in graph.get_check_keys_for_assets({keys["gold/snapshots"].key})
    }
    assert defs.resolve_sensor_def("snapshot_cadence").default_status.value == "RUNNING"
    assert {"contract", "packing_efficiency"} <= {
        key.name for key in graph.get_check_keys_for_assets({keys["gold/sequences"].key})
    }
    assert set(defs.resources) >= {"lake", "landing", "ingest_policy"}
    assert keys["gold/preference_sequences"].partitions_def.name == "ingest_batches"
    assert keys["gold/preference_snapshots"].automation_condition is None, (
        "preference_snapshot_cadence cuts them"
    )
    assert defs.resolve_sensor_def("preference_snapshot_cadence").default_status.value == "RUNNING"


def test_resources_follow_settings(monkeypatch, tmp_path):
    from pipeline_assets.defs.resources import build_resources
    from pipeline_assets.resources.settings import Settings

    for inherited in (
        "DAGSTER_HOME",
        "MLFLOW_TRACKING_URI",
        "PIPELINE_LANDING_URI",
        "PIPELINE_FIELD_MAPPINGS",
    ):
        monkeypatch.delenv(inherited, raising=False)  # make exports some of these
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.setenv("PIPELINE_LAKE_URI", "s3://bucket/lake")
    monkeypatch.setenv("PIPELINE_FIELD_MAPPINGS", '{"logs": {"completion": "response"}}')
    settings = Settings.from_env()
    assert (
        settings.landing_uri == f"{tmp_path}/landing"
        and settings.dagster_home == f"{tmp_path}/dagster"
    )
    assert settings.mlflow_tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    built = build_resources(settings)
    assert built["lake"].uri == "s3://bucket/lake"
    assert built["landing"].mapping_for("logs") == {"completion": "response"}


def test_long_records_setting_reaches_gold_and_a_bad_value_is_named(monkeypatch, tmp_path):
    from pipeline_assets.defs.resources import build_resources
    from pipeline_assets.resources.settings import Settings

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    assert build_resources(Settings.from_env())["gold_policy"].long_records == "truncate"
    monkeypatch.setenv("PIPELINE_LONG_RECORDS", "drop")
    assert build_resources(Settings.from_env())["gold_policy"].long_records == "drop"
    monkeypatch.setenv("PIPELINE_LONG_RECORDS", "split")
    with pytest.raises(
        ValueError, match="PIPELINE_LONG_RECORDS='split' is not one of 'truncate', 'drop'"
    ):
        Settings.from_env()


def test_tokenizer_sample_setting_reaches_gold_and_a_bad_value_is_named(monkeypatch, tmp_path):
    from pipeline_assets.defs.resources import build_resources
    from pipeline_assets.resources.settings import Settings

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    assert build_resources(Settings.from_env())["gold_policy"].tokenizer_sample_chars == 100_000_000
    monkeypatch.setenv("PIPELINE_TOKENIZER_SAMPLE_CHARS", "2e6")
    assert build_resources(Settings.from_env())["gold_policy"].tokenizer_sample_chars == 2_000_000
    monkeypatch.setenv("PIPELINE_TOKENIZER_SAMPLE_CHARS", "0")
    with pytest.raises(ValueError, match="PIPELINE_TOKENIZER_SAMPLE_CHARS=0 must be 1 or more"):
        Settings.from_env()


def test_preference_pair_settings_reach_silver_and_a_bad_value_is_named(monkeypatch, tmp_path):
    from pipeline_assets.defs.resources import build_resources
    from pipeline_assets.resources.settings import Settings

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    default = build_resources(Settings.from_env())["silver_policy"].silver_config()
    assert (default.max_pairs_per_prompt, default.max_length_ratio) == (8, None)
    monkeypatch.setenv("PIPELINE_MAX_PAIRS_PER_PROMPT", "3")
    monkeypatch.setenv("PIPELINE_PREFERENCE_MAX_LENGTH_RATIO", "5")
    configured = build_resources(Settings.from_env())["silver_policy"].silver_config()
    assert (configured.max_pairs_per_prompt, configured.max_length_ratio) == (3, 5.0)
    monkeypatch.setenv("PIPELINE_PREFERENCE_MAX_LENGTH_RATIO", "0.5")
    with pytest.raises(
        ValueError, match="PIPELINE_PREFERENCE_MAX_LENGTH_RATIO=0.5 must be more than 1"
    ):
        Settings.from_env()


def test_dagster_definitions_validate(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "PIPELINE_HOME": str(tmp_path)}
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "dagster"),
            "definitions",
            "validate",
            "-w",
            "workspace.yaml",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "All code locations passed validation" in done.stdout + done.stderr


def test_runs_execute_in_one_process_unless_the_setting_says_otherwise(tmp_path):
    assert defs.executor.name == "in_process"
    show = "from pipeline_assets.definitions import defs; print(defs.executor.name)"
    env = {**os.environ, "PIPELINE_HOME": str(tmp_path)}
    multiprocess = subprocess.run(
        [sys.executable, "-c", show],
        env={**env, "PIPELINE_EXECUTOR": "multiprocess"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert multiprocess.stdout.strip() == "multiprocess", multiprocess.stderr
    unknown = subprocess.run(
        [sys.executable, "-c", show],
        env={**env, "PIPELINE_EXECUTOR": "threads"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        unknown.returncode != 0
        and "PIPELINE_EXECUTOR='threads': one of in_process, multiprocess" in unknown.stderr
    )


def test_loading_the_location_hides_dagsters_preview_and_beta_notes_only_and_imports_no_torch():
    """They headed every command's output and read like errors; a real warning still shows. torch
    is imported where a step trains or scores, not by every process that loads the location (every
    command, every run the daemon launches): it cost 1.4 to 2 s each."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-W",
            "default",
            "-c",
            "import sys, warnings, pipeline_assets.definitions; warnings.warn('a real warning'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "UserWarning: a real warning" in loaded.stderr
    assert "PreviewWarning" not in loaded.stderr and "BetaWarning" not in loaded.stderr
    assert loaded.stdout.strip() == "[]", "torch was imported by loading the location"


def test_the_batch_gates_are_every_blocking_check_of_bronze_and_silver():
    """A batch is blocked by any blocking check on a bronze or silver table; the gates that
    defs/resources.py lists from the two layers' check lists miss none the code location has."""
    from pipeline_assets.definitions import defs
    from pipeline_assets.defs.resources import batch_gates

    graph = defs.resolve_asset_graph()
    blocking = {
        f"{key.asset_key.to_user_string()}:{key.name}"
        for key in graph.asset_check_keys
        if graph.get_check_spec(key).blocking and key.asset_key.path[0] in ("bronze", "silver")
    }
    assert blocking and set(batch_gates().checks) == blocking
