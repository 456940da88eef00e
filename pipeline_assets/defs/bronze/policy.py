"""What the bronze checks judge by."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.resources.settings import setting_field


class IngestPolicy(ConfigurableResource):
    """Thresholds the bronze checks judge by."""

    max_quarantine_rate: float = setting_field("max_quarantine_rate")
    volume_tolerance: float = setting_field("volume_tolerance")
    freshness_sla_hours: float = setting_field("freshness_sla_hours")
    trailing_batches: int = Field(
        default=10, description="how many earlier batches the volume baseline uses"
    )
