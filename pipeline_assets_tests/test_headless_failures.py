"""Where a step fails on a bug, the headless command's last lines name the asset, the partition and
the exception in one sentence, and the exit code is 1 (not a traceback as the only message)."""

from __future__ import annotations

from dagster import Definitions, asset

from pipeline_assets.cli.headless import run_stale
from pipeline_assets.cli.main import _report
from pipeline_assets.resources.settings import Settings


@asset(key=["gold", "broken"])
def broken() -> None:
    {}["tokenizer_version"]  # a bug: a key that is not there


def test_a_failed_step_is_one_sentence_naming_asset_partition_and_exception(instance, capsys):
    outcome = run_stale(Definitions(assets=[broken]), instance, None)
    assert _report(outcome, Settings.from_env()) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "FAILED: gold/broken failed for all batches: KeyError: 'tokenizer_version' (run "
    ), last
