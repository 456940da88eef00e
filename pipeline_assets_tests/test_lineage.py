"""Lineage's parts that need no registry: model specs (test_ops_retention.py follows a
whole lineage)."""

from __future__ import annotations

import pytest

from pipeline_assets.cli.lineage import parse_model_spec


def test_model_specs_name_an_alias_or_a_version():
    assert parse_model_spec("sft-model@champion") == ("sft-model", "champion", None)
    assert parse_model_spec("sft-model/3") == ("sft-model", None, "3")
    for bad in ("sft-model", "sft-model/latest"):
        with pytest.raises(ValueError):
            parse_model_spec(bad)
