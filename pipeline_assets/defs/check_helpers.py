"""What every layer's asset checks share: reading one batch of a table, judging a contract."""

import pandera.errors
import polars as pl
from dagster import AssetCheckResult, MetadataValue

from pipeline_assets.contracts import validate
from pipeline_assets.resources import LakeResource


def batch_of(lake: LakeResource, layer: str, name: str, batch_id: str) -> pl.DataFrame:
    frame = lake.read(layer, name, where=pl.col("batch_id") == batch_id)
    if frame is None:
        raise ValueError(f"{layer}/{name} does not exist yet: materialize it first")
    return frame


def contract_check_result(frame: pl.DataFrame, model) -> AssetCheckResult:
    try:
        validate(frame, model)
    except pandera.errors.SchemaErrors as errors:
        cases = errors.failure_cases
        return AssetCheckResult(
            passed=False,
            metadata={
                "rows": frame.height,
                "failure_cases": len(cases),
                "failures": MetadataValue.md(f"```\n{str(cases.head(20))}\n```"),
            },
            description=f"{model.__name__} contract broken in {len(cases)} place(s)",
        )
    return AssetCheckResult(passed=True, metadata={"rows": frame.height, "failure_cases": 0})
