"""When to cut a new data snapshot: when the tokens of the gold shards built since the last one
reach a share of that snapshot's tokens. A day of small batches is then one snapshot and one
training, not one per batch."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.lib.gold.splits import TRAIN, VALIDATION


@dataclass(frozen=True)
class CadenceInputs:
    changed_batches: dict[
        str, int
    ]  # usable gold shards built since the last cut: their real tokens
    last_snapshot: str | None  # the newest snapshot's key, None before the first
    last_snapshot_tokens: int  # the real tokens that snapshot holds


def snapshot_due(inputs: CadenceInputs, min_new_fraction: float) -> tuple[bool, str]:
    """Whether to cut, and why (or why not), in words for a sensor tick or a snapshot's metadata."""
    if not inputs.changed_batches:
        since = f" since {inputs.last_snapshot}" if inputs.last_snapshot else ""
        return False, f"no usable gold shard built{since}"
    if inputs.last_snapshot is None or inputs.last_snapshot_tokens <= 0:
        return True, f"first snapshot ({len(inputs.changed_batches)} batch shard(s))"
    share = sum(inputs.changed_batches.values()) / inputs.last_snapshot_tokens
    words = (
        f"gold shards built since {inputs.last_snapshot}: {len(inputs.changed_batches)} batch(es), "
        f"{share:.1%} of its tokens (cut at {min_new_fraction:.0%})"
    )
    return share >= min_new_fraction, words


def lacks_a_split(sequences_by_split: dict[str, int]) -> str | None:
    """Why the usable shards, all together, cannot make a snapshot yet (training needs a train
    sequence, the promotion gate a validation one), or None."""
    missing = [split for split in (TRAIN, VALIDATION) if sequences_by_split.get(split, 0) <= 0]
    if not missing:
        return None
    held = ", ".join(f"{n} {split}" for split, n in sorted(sequences_by_split.items())) or "none"
    return (
        f"the usable gold shards hold no {' and no '.join(missing)} sequence ({held}): a snapshot "
        "waits for more records to train and evaluate on"
    )
