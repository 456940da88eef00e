"""ops/pipeline_report's throughput check against the stage's own history."""

from __future__ import annotations

import polars as pl
from dagster import AssetCheckSeverity, build_asset_check_context

from pipeline_assets.contracts import PipelineStage, conform, validate
from pipeline_assets.defs.ops.report import stage_throughput
from pipeline_assets.defs.policies import CostPolicy


def _report(report_id: str, throughputs: dict[str, float]) -> pl.DataFrame:
    rows = [
        {
            "report_id": report_id,
            "snapshot": "gold-v0",
            "stage": stage,
            "rows": 1,
            "input_mb": 1.0,
            "tokens": 1,
            "wall_seconds": 1.0,
            "cpu_seconds": 1.0,
            "gpu_seconds": 0.0,
            "rows_per_second": 1.0,
            "mb_per_second": 1.0,
            "tokens_per_second": value,
            "share_of_wall": 0.5,
            "cost_usd": 0.0,
            "usd_per_million_tokens": 0.0,
            "throughput": value,
            "unit": "tokens/s",
        }
        for stage, value in throughputs.items()
    ]
    return validate(conform(pl.DataFrame(rows), PipelineStage), PipelineStage)


def _check(lake):
    return stage_throughput(
        build_asset_check_context(), lake=lake, cost_policy=CostPolicy(max_throughput_drop=0.30)
    )


def test_a_stage_that_slows_down_by_more_than_the_threshold_is_named(lake):
    for number, training in enumerate([10_000, 11_000, 9_000]):
        lake.append(
            "ops",
            "pipeline_report",
            _report(f"2026112{number}T000000Z", {"silver": 500.0, "training": training}),
        )
    lake.append(
        "ops",
        "pipeline_report",
        _report("20261123T000000Z", {"silver": 480.0, "training": 6_000.0}),
    )
    result = _check(lake)
    assert not result.passed and result.severity == AssetCheckSeverity.WARN
    assert result.metadata["slower_stages"].value == ["training"]
    assert "training at 6,000.0 against a median of 10,000.0 (-40%)" in result.description


def test_stages_within_their_usual_throughput_pass(lake):
    lake.append("ops", "pipeline_report", _report("20261120T000000Z", {"training": 10_000.0}))
    lake.append("ops", "pipeline_report", _report("20261121T000000Z", {"training": 8_000.0}))
    assert _check(lake).passed
