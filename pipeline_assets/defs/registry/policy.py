"""What a candidate must show to become champion."""

from __future__ import annotations

from dagster import ConfigurableResource

from pipeline_assets.resources.settings import setting_field


class RegistryPolicy(ConfigurableResource):
    """What the registry calls the model and what a candidate must show to become champion."""

    model_name: str = setting_field("model_name")
    dpo_model_name: str = setting_field("dpo_model_name")
    promotion_margin: float = setting_field("promotion_margin")
    slice_tolerance: float = setting_field("slice_tolerance")
    eval_max_tokens: int = setting_field("eval_max_tokens")
