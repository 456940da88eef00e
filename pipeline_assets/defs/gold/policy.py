"""How gold tokenizes, splits and packs, and what its checks allow."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.resources.settings import setting_field


class GoldPolicy(ConfigurableResource):
    """How gold tokenizes, splits and packs, and what its checks allow."""

    tokenizer_path: str = setting_field("tokenizer_path")
    vocab_size: int = setting_field("vocab_size")
    tokenizer_sample_chars: int = setting_field("tokenizer_sample_chars", ge=1)
    seq_len: int = setting_field("seq_len")
    long_records: str = setting_field("long_records")
    conversation_loss: str = setting_field("conversation_loss")
    validation_fraction: float = setting_field("validation_fraction")
    preference_validation_fraction: float = setting_field("preference_validation_fraction")
    search_fraction: float = setting_field("search_fraction")
    shuffle_seed: int = setting_field("shuffle_seed")
    min_packing_efficiency: float = Field(
        default=0.98, description="blocking: real tokens / all tokens"
    )
    snapshot_min_new_fraction: float = setting_field("snapshot_min_new_fraction")
    psi_warn: float = 0.10
    psi_fail: float = 0.25
    volume_tolerance: float = Field(
        default=0.20, description="warning: tokens against the previous snapshot"
    )
