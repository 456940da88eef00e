"""The retention window (the prices are in defs/policies.py: the registry reads them too)."""

from __future__ import annotations

from dagster import ConfigurableResource

from pipeline_assets.resources.settings import setting_field


class RetentionPolicy(ConfigurableResource):
    """How long the retention job keeps what nothing registered needs."""

    days: float = setting_field("retention_days", ge=0)
