"""Prices for the cost model, and the retention window."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.lib.ops.cost import Prices
from pipeline_assets.resources.settings import setting_field


class CostPolicy(ConfigurableResource):
    """Prices for the pipeline report and the sizer, and when a stage counts as slower."""

    core_hour_usd: float = setting_field("core_hour_usd")
    gpu_hour_usd: float = setting_field("gpu_hour_usd")
    spot_discount: float = setting_field("spot_discount")
    max_throughput_drop: float = Field(
        default=0.30, description="warning: a stage this much below its trailing median"
    )
    trailing_reports: int = 10

    def prices(self) -> Prices:
        return Prices(
            core_hour=self.core_hour_usd,
            gpu_hour=self.gpu_hour_usd,
            spot_discount=self.spot_discount,
        )


class RetentionPolicy(ConfigurableResource):
    """How long the retention job keeps what nothing registered needs."""

    days: float = setting_field("retention_days", ge=0)
