"""A password in MLFLOW_TRACKING_URI and an AWS secret in the environment never show: not in the
UI's resource view (GraphQL), the run config, the event log, the Delta tables, nor an error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dagster import DagsterInstance, build_resources, materialize
from dagster_graphql.test.utils import (
    define_out_of_process_context,
    execute_dagster_graphql,
    infer_repository_selector,
)

from pipeline_assets.cli import main as cli
from pipeline_assets.definitions import build_definitions
from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.bronze.checks import bronze_checks
from pipeline_assets.defs.resources import build_resources as pipeline_resources
from pipeline_assets.resources.settings import Settings
from pipeline_assets_tests.conftest import _free_port, record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register

ROOT = Path(__file__).resolve().parents[1]
TRACKING_PASSWORD = "tracking-pass-7f3a9"
AWS_SECRET = "aws-secret-9c1e4"
SECRETS = (TRACKING_PASSWORD, AWS_SECRET)

RESOURCES_QUERY = """
query ($selector: RepositorySelector!) {
  allTopLevelResourceDetailsOrError(repositorySelector: $selector) {
    __typename
    ... on ResourceDetailsList { results { name configuredValues { key value type } } }
  }
}
"""


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Settings from the environment as a deployment has them: the tracking server's password in its
    URI (nothing listens there), AWS credentials set."""
    for name in [n for n in os.environ if n.startswith("PIPELINE_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    monkeypatch.setenv("PIPELINE_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", f"https://alice:{TRACKING_PASSWORD}@127.0.0.1:{_free_port()}"
    )
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    (home / "dagster").mkdir(parents=True)
    write_landing_file(home / "landing", "annotate", "a.jsonl", [record(i) for i in range(8)])
    return home


def _assert_no_secret(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shows in {where}"


def test_the_resource_view_names_the_variable_and_shows_no_secret(home):
    with (
        DagsterInstance.get() as instance,
        define_out_of_process_context(str(ROOT / "workspace.yaml"), None, instance) as context,
    ):
        result = execute_dagster_graphql(
            context, RESOURCES_QUERY, {"selector": infer_repository_selector(context)}
        )
    shown = json.dumps(result.data)
    _assert_no_secret("the GraphQL resource view", shown)
    resources = {r["name"]: r for r in result.data["allTopLevelResourceDetailsOrError"]["results"]}
    tracking = {v["key"]: v for v in resources["mlflow_tracking"]["configuredValues"]}[
        "tracking_uri"
    ]
    assert (tracking["type"], tracking["value"]) == ("ENV_VAR", "MLFLOW_TRACKING_URI")


def test_a_run_leaves_no_secret_in_the_instance_or_the_lake(home):
    defs = build_definitions(Settings.from_env())
    with DagsterInstance.get() as instance:
        batch = register(instance, defs.resources)
        result = materialize(
            [bronze, *bronze_checks],
            partition_key=batch,
            instance=instance,
            resources=defs.resources,
        )
        assert result.success
        shown_uris = [
            event.materialization.metadata["dagster/uri"].value
            for event in result.get_asset_materialization_events()
        ]
        assert str(home / "lake" / "bronze" / "records") in shown_uris, (
            "a run that records URIs in its metadata"
        )
        run = instance.get_run_by_id(result.run_id)
        _assert_no_secret("the run config", json.dumps(run.run_config) + json.dumps(run.tags))
        _assert_no_secret(
            "the event log", "\n".join(str(entry) for entry in instance.all_logs(result.run_id))
        )
    for path in [
        p for p in home.rglob("*") if p.is_file()
    ]:  # the instance's storage, the Delta tables, the logs
        _assert_no_secret(str(path.relative_to(home)), path.read_bytes().decode("utf-8", "replace"))


def test_an_unreachable_tracking_server_is_named_without_its_password(home, capsys):
    assert cli.main(["lineage", "sft-model/1"]) == 2
    error = capsys.readouterr().err
    _assert_no_secret("the error", error)
    assert "https://alice:***@127.0.0.1:" in error


def test_mlflow_on_the_sqlite_default_works_inside_and_outside_a_run(home, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert pipeline_resources(Settings.from_env())["mlflow_tracking"].experiment_id()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home}/other.db")
    resource = pipeline_resources(Settings.from_env())["mlflow_tracking"]
    with build_resources({"mlflow_tracking": resource}) as initialized:
        in_run = initialized.mlflow_tracking.experiment_id()
    assert resource.experiment_id() == in_run, "the CLI and a run see the same tracking store"
    assert (home / "other.db").exists()
