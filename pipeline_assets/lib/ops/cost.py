"""Where the time and the money go: per-stage throughput, the bottleneck, $ per million tokens.

Pure arithmetic over what each stage measured (rows, MB, tokens, wall, CPU and GPU seconds).
Compute is priced by what a stage used: CPU seconds at the core-hour price, GPU seconds at the
GPU-hour price, less the spot discount.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

MEASURED = {
    "stage": pl.String,
    "rows": pl.Int64,
    "input_mb": pl.Float64,
    "tokens": pl.Int64,
    "wall_seconds": pl.Float64,
    "cpu_seconds": pl.Float64,
    "gpu_seconds": pl.Float64,
}


@dataclass(frozen=True)
class Prices:
    core_hour: float = 0.048  # $ per vCPU-hour, on-demand
    gpu_hour: float = 3.00  # $ per GPU-hour, on-demand
    spot_discount: float = 0.0  # 0.6: spot capacity at 40% of the on-demand price

    def cost(self, cpu_seconds: pl.Expr | float, gpu_seconds: pl.Expr | float) -> pl.Expr | float:
        return (
            (cpu_seconds * self.core_hour + gpu_seconds * self.gpu_hour)
            / 3600
            * (1 - self.spot_discount)
        )


@dataclass(frozen=True)
class Compute:
    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0


def model_version_cost(training: Compute, data: Compute, prices: Prices) -> dict:
    """What a model version cost: its training run, and the data stages behind its snapshot, in
    $."""
    training_usd = round(prices.cost(training.cpu_seconds, training.gpu_seconds), 6)
    data_usd = round(prices.cost(data.cpu_seconds, data.gpu_seconds), 6)
    return {
        "total_usd": round(
            training_usd + data_usd, 6
        ),  # the sum of the parts as shown: they add up
        "training_usd": training_usd,
        "data_usd": data_usd,
        "cpu_seconds": round(training.cpu_seconds + data.cpu_seconds, 2),
        "gpu_seconds": round(training.gpu_seconds + data.gpu_seconds, 2),
        "prices": {
            "core_hour": prices.core_hour,
            "gpu_hour": prices.gpu_hour,
            "spot_discount": prices.spot_discount,
        },
    }


def stage_report(measured: pl.DataFrame, prices: Prices, dataset_tokens: int) -> pl.DataFrame:
    """One row per stage: throughputs, its share of the wall time, its cost and $ per million
    dataset tokens (the gold snapshot's real tokens: what the pipeline produces)."""
    wall = pl.col("wall_seconds").clip(lower_bound=1e-9)
    return measured.with_columns(
        rows_per_second=pl.col("rows") / wall,
        mb_per_second=pl.col("input_mb") / wall,
        tokens_per_second=pl.col("tokens") / wall,
        share_of_wall=pl.col("wall_seconds") / pl.col("wall_seconds").sum(),
        cost_usd=prices.cost(pl.col("cpu_seconds"), pl.col("gpu_seconds")),
    ).with_columns(usd_per_million_tokens=pl.col("cost_usd") / max(dataset_tokens, 1) * 1e6)


def bottleneck(report: pl.DataFrame) -> str:
    """The stage that takes the most wall time."""
    return report.sort("wall_seconds", descending=True)["stage"][0]


def headline_throughput(report: pl.DataFrame) -> pl.DataFrame:
    """Per stage, the throughput it is judged by: tokens/s where it counts tokens, else rows/s."""
    return report.select(
        "stage",
        throughput=pl.when(pl.col("tokens") > 0)
        .then("tokens_per_second")
        .otherwise("rows_per_second"),
        unit=pl.when(pl.col("tokens") > 0).then(pl.lit("tokens/s")).otherwise(pl.lit("rows/s")),
    )
