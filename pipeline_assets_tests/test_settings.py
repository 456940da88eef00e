"""Every setting is written once (``resources/settings.py``): the docs' table, the ``Settings`` the
environment gives and each policy's defaults all come from it."""

import dataclasses
import io
import re
import tokenize
from pathlib import Path

import pytest

from pipeline_assets.defs.resources import build_resources
from pipeline_assets.resources.settings import BY_FIELD, SETTINGS, Settings, markdown_table

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADER = "| variable | default | meaning |"


def _docs_table() -> str:
    lines = (ROOT / "docs" / "settings.md").read_text().splitlines()
    start = lines.index(TABLE_HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def test_the_docs_settings_table_is_what_the_code_prints():
    assert _docs_table() == markdown_table(), (
        "docs/settings.md's table and resources/settings.py disagree: paste the output of "
        "`python -m pipeline_assets.resources.settings` into docs/settings.md"
    )


def test_every_settings_field_has_one_setting():
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(fields) == sorted(BY_FIELD)
    variables = [s.variable for s in SETTINGS]
    assert len(variables) == len(set(variables))


def _string_literals(path: Path):
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING:
            yield token.string


def test_every_pipeline_variable_the_code_names_is_a_setting():
    known = {s.variable for s in SETTINGS}
    named = {
        (variable, str(path.relative_to(ROOT)))
        for path in (ROOT / "pipeline_assets").rglob("*.py")
        for literal in _string_literals(path)
        for variable in re.findall(r"\bPIPELINE_[A-Z0-9_]*[A-Z0-9]\b", literal)
    }
    assert {(v, where) for v, where in named if v not in known} == set()


def test_with_nothing_set_every_policy_starts_at_its_own_defaults(monkeypatch, tmp_path):
    for setting in SETTINGS:
        monkeypatch.delenv(setting.variable, raising=False)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    resources = build_resources(Settings.from_env())
    for key in ("ingest_policy", "silver_policy", "gold_policy", "registry_policy"):
        built = resources[key]
        assert built == type(built)(), key
    for key in ("cost_policy", "retention_policy", "rl_policy", "training_policy"):
        assert resources[key] == type(resources[key])(), key


def test_a_home_relative_default_follows_pipeline_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    for variable in ("PIPELINE_LAKE_URI", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(variable, raising=False)
    settings = Settings.from_env()
    assert settings.lake_uri == f"{tmp_path}/lake"
    assert settings.mlflow_tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("PIPELINE_RL_GROUP_SIZE", "1", "PIPELINE_RL_GROUP_SIZE=1 must be 2 or more"),
        ("PIPELINE_RL_HELD_OUT_FRACTION", "1", "PIPELINE_RL_HELD_OUT_FRACTION=1 must be below 1"),
        ("PIPELINE_RL_MAX_PENDING_SECONDS", "0", "must be more than 0"),
        ("PIPELINE_SEQ_LEN", "long", "PIPELINE_SEQ_LEN='long' is not a number"),
        ("PIPELINE_QUALITY_THRESHOLDS", "[1]", "PIPELINE_QUALITY_THRESHOLDS must be a JSON object"),
    ],
)
def test_a_bad_value_fails_naming_its_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings.from_env()


def test_a_set_variable_reaches_its_policy(monkeypatch):
    monkeypatch.setenv("PIPELINE_RL_MAX_STALENESS", "5")
    monkeypatch.setenv("PIPELINE_SLICE_TOLERANCE", "0.1")
    resources = build_resources(Settings.from_env())
    assert resources["rl_policy"].max_staleness == 5
    assert resources["registry_policy"].slice_tolerance == 0.1


def _another(value):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    return value + 1 if isinstance(value, (int, float)) else value + "-other"


def test_every_policy_field_a_setting_sets_takes_the_settings_value(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    settings = Settings.from_env()
    changed = {
        name: _another(getattr(settings, name))
        for name in BY_FIELD
        if _another(getattr(settings, name)) is not None
    }
    changed.update(long_records="drop", kuberay_config="", spot_discount=0.5)
    changed["rl_held_out_fraction"] = 0.5
    changed["languages"] = ["de", "en"]
    resources = build_resources(dataclasses.replace(settings, **changed))
    checked = 0
    for resource in resources.values():
        for name, info in getattr(type(resource), "model_fields", {}).items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "setting" in extra:
                assert getattr(resource, name) == changed[extra["setting"]], (resource, name)
                checked += 1
    assert checked >= 30
