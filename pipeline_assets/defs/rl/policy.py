"""The RL overlay's settings."""

from __future__ import annotations

from dagster import ConfigurableResource

from pipeline_assets.resources.settings import setting_field


class RlPolicy(ConfigurableResource):
    """The RL overlay's settings: its prompt bank, its groups, its rollout workers and how stale a
    rollout may be (each a PIPELINE_RL_* setting)."""

    bank_tasks: int = setting_field("rl_bank_tasks", ge=1)
    bank_seed: int = setting_field("rl_bank_seed")
    held_out_fraction: float = setting_field("rl_held_out_fraction", ge=0, lt=1)
    group_size: int = setting_field("rl_group_size", ge=2)
    updates: int = setting_field("rl_updates", ge=1)
    warm_start_max_steps: int = setting_field("rl_warm_start_max_steps", ge=0)
    rollout_workers: int = setting_field("rl_rollout_workers", ge=1)
    max_staleness: int = setting_field("rl_max_staleness", ge=0)
    max_pending_seconds: float = setting_field("rl_max_pending_seconds", gt=0)
