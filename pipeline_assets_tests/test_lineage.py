"""Lineage's parts that need no registry: model specs, and which batches fed a snapshot."""

from __future__ import annotations

import polars as pl
import pytest

from pipeline_assets.lineage import contributing_batches, parse_model_spec


def test_model_specs_name_an_alias_or_a_version():
    assert parse_model_spec("sft-model@champion") == ("sft-model", "champion", None)
    assert parse_model_spec("sft-model/3") == ("sft-model", None, "3")
    for bad in ("sft-model", "sft-model/latest"):
        with pytest.raises(ValueError):
            parse_model_spec(bad)


def test_a_batch_left_out_of_the_snapshot_is_not_in_its_lineage(lake):
    silver = pl.DataFrame({"record_id": ["a1", "a2", "b1", "c1"], "batch_id": ["A", "A", "B", "C"]})
    silver_version = lake.overwrite("silver", "records", silver).version
    gold = pl.DataFrame({"record_ids": [["a1", "c1"], ["a2"]]})  # batch B was blocked in silver
    gold_version = lake.overwrite("gold", "sequences", gold).version
    assert contributing_batches(lake, gold_version, silver_version) == ["A", "C"]
