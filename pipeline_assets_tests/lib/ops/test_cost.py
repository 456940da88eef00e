"""The cost model: throughputs, shares, prices, the bottleneck."""

from __future__ import annotations

import polars as pl
import pytest

from pipeline_assets.lib.ops.cost import (
    MEASURED,
    Compute,
    Prices,
    bottleneck,
    headline_throughput,
    model_version_cost,
    stage_report,
)

MEASURED_ROWS = [
    {
        "stage": "bronze",
        "rows": 20_000,
        "input_mb": 10.0,
        "tokens": 0,
        "wall_seconds": 4.0,
        "cpu_seconds": 6.0,
        "gpu_seconds": 0.0,
    },
    {
        "stage": "training",
        "rows": 0,
        "input_mb": 0.0,
        "tokens": 800_000,
        "wall_seconds": 80.0,
        "cpu_seconds": 150.0,
        "gpu_seconds": 80.0,
    },
]


def test_stage_report_prices_cpu_and_gpu_seconds_and_spreads_them_per_million_tokens():
    report = stage_report(
        pl.DataFrame(MEASURED_ROWS, schema=MEASURED),
        Prices(core_hour=0.036, gpu_hour=3.6),
        2_000_000,
    )
    bronze, training = report.row(0, named=True), report.row(1, named=True)
    assert bronze["rows_per_second"] == 5_000 and bronze["mb_per_second"] == 2.5
    assert bronze["cost_usd"] == pytest.approx(6 * 0.036 / 3600)
    assert training["cost_usd"] == pytest.approx((150 * 0.036 + 80 * 3.6) / 3600)
    assert training["usd_per_million_tokens"] == pytest.approx(training["cost_usd"] / 2)
    assert bronze["share_of_wall"] + training["share_of_wall"] == pytest.approx(1.0)
    assert bottleneck(report) == "training"
    judged = dict(headline_throughput(report).select("stage", "unit").iter_rows())
    assert judged == {"bronze": "rows/s", "training": "tokens/s"}


def test_spot_discount_lowers_every_price():
    frame = pl.DataFrame(MEASURED_ROWS, schema=MEASURED)
    on_demand = stage_report(frame, Prices(), 1_000_000)["cost_usd"].sum()
    spot = stage_report(frame, Prices(spot_discount=0.6), 1_000_000)["cost_usd"].sum()
    assert spot == pytest.approx(on_demand * 0.4)


def test_a_model_versions_cost_adds_up_as_shown():
    # 0.0004 + 0.0004 rounds each part down but the exact total up: the total must be the parts' sum
    prices = Prices(
        core_hour=3.6, gpu_hour=0.0, spot_discount=0.0
    )  # a dollar a thousand cpu seconds
    cost = model_version_cost(Compute(cpu_seconds=0.0004), Compute(cpu_seconds=0.0004), prices)
    assert cost["training_usd"] == cost["data_usd"] == 0.0
    assert cost["total_usd"] == cost["training_usd"] + cost["data_usd"]
    cost = model_version_cost(Compute(cpu_seconds=0.7254), Compute(cpu_seconds=0.0004), prices)
    assert cost["total_usd"] == round(cost["training_usd"] + cost["data_usd"], 6) == 0.000725
