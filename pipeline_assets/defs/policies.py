"""The policies more than one layer reads, so that no layer folder imports a sibling's: the
registry's model names and promotion rules (evaluation, gold's reference model, RL, the registry),
silver's curation thresholds (silver and the RL prompt bank, which curates with them), and the
prices (the pipeline report and the registry). A policy only its own layer reads stays in that
layer's ``policy.py``."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from pipeline_assets.lib.ops.cost import Prices
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.decontam import DecontamConfig
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.normalize import NormalizeConfig
from pipeline_assets.lib.silver.quality import QualityThresholds
from pipeline_assets.resources.settings import setting_field


class RegistryPolicy(ConfigurableResource):
    """What the registry calls the model and what a candidate must show to become champion."""

    model_name: str = setting_field("model_name")
    dpo_model_name: str = setting_field("dpo_model_name")
    promotion_margin: float = setting_field("promotion_margin")
    slice_tolerance: float = setting_field("slice_tolerance")
    eval_max_tokens: int = setting_field("eval_max_tokens")


class SilverPolicy(ConfigurableResource):
    """How silver normalizes, deduplicates, decontaminates and gates, and what its checks allow."""

    unicode_form: str = "NFC"
    strip_control: bool = True
    collapse_whitespace: bool = True
    minhash_num_perm: int = 128
    minhash_seed: int = 1
    minhash_shingle_words: int = 5
    minhash_threshold: float = 0.8
    decontam_ngram: int = 13
    quality_thresholds: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='per source rule overrides, e.g. {"logs": {"min_words": 3}}',
    )
    max_pass_rate_drop: float = Field(
        default=0.20, description="blocking: a source's pass rate below its trailing median"
    )
    psi_warn: float = 0.10
    psi_fail: float = 0.25
    drift_min_rows: int = Field(
        default=500,
        description="below this many rows on either side, PSI is mostly sampling noise: not judged",
    )
    volume_tolerance: float = Field(
        default=0.20, description="warning: kept rows against the trailing median"
    )
    trailing_batches: int = 10
    max_pairs_per_prompt: int = setting_field("max_pairs_per_prompt")
    max_length_ratio: float = setting_field("max_length_ratio")
    languages: list[str] = setting_field("languages")

    def decontam_config(self) -> DecontamConfig:
        return DecontamConfig(ngram=self.decontam_ngram)

    def silver_config(self) -> SilverConfig:
        return SilverConfig(
            normalize=NormalizeConfig(
                self.unicode_form or None, self.strip_control, self.collapse_whitespace
            ),
            minhash=MinHashConfig(
                num_perm=self.minhash_num_perm,
                seed=self.minhash_seed,
                shingle_words=self.minhash_shingle_words,
                threshold=self.minhash_threshold,
            ),
            decontam=self.decontam_config(),
            quality_by_source={
                source: QualityThresholds(**overrides)
                for source, overrides in self.quality_thresholds.items()
            },
            max_pairs_per_prompt=self.max_pairs_per_prompt,
            max_length_ratio=self.max_length_ratio or None,
            languages=frozenset(self.languages),
        )


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
