"""evaluation/dpo_report's report frame with a DPO champion beside the candidate.

The DPO path's end, end to end (`pipeline-assets run` trains sft-model/1, DPO on dpo-v0, judges the
candidate on dpo-v0's held-out pairs with no DPO champion yet, registers dpo-model/1, and
`pipeline-assets lineage dpo-model@champion` walks back to both sources' landing files), is asserted
on the demo's instance by test_documented_commands.py's story: `make demo` runs that same path, and
a second run to it cost this file a minute and a half.
"""

from __future__ import annotations

import polars as pl
import pytest


def test_the_report_holds_both_models_side_by_side_when_a_dpo_champion_exists():
    from pipeline_assets.contracts import DpoEvaluationSlice, conform, validate
    from pipeline_assets.defs.evaluation.dpo import _comparison, _report_frame
    from pipeline_assets.lib.training.preference_eval import preference_slices

    sources = pl.DataFrame({"pair_id": ["a", "b", "c"], "source": ["x", "x", "y"]})
    margins = {"candidate": [1.0, -1.0, 2.0], "champion": [-1.0, -1.0, 2.0]}
    slices = {
        role: preference_slices(
            pl.DataFrame({"pair_id": ["a", "b", "c"], "margin": values}), sources
        )
        for role, values in margins.items()
    }
    sft = {"candidate_loss": 2.1, "champion_loss": 2.0, "champion_version": "sft-model/3"}
    report = _report_frame("dpo-v2", slices, {"candidate": None, "champion": "dpo-model/1"}, sft)
    report = validate(conform(report, DpoEvaluationSlice), DpoEvaluationSlice)
    assert report.height == 8 and set(report["model_version"].drop_nulls()) == {
        "dpo-model/1",
        "sft-model/3",
    }
    wide = {row["slice"]: row for row in _comparison(report).iter_rows(named=True)}
    assert list(wide) == ["overall", "source:x", "source:y", "sft_validation_loss"]
    assert (wide["overall"]["candidate"], wide["overall"]["champion"]) == (
        pytest.approx(2 / 3),
        pytest.approx(1 / 3),
    )
    assert (wide["sft_validation_loss"]["candidate"], wide["sft_validation_loss"]["champion"]) == (
        2.1,
        2.0,
    )
