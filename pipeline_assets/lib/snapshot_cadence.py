"""When to cut a new data snapshot: when the silver text changed since the last one reaches a share
of what that snapshot was built from. A day of small batches is then one snapshot and one training,
not one per batch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CadenceInputs:
    changed_batches: dict[str, int]  # usable silver batches written since the last cut: their text characters
    last_snapshot: str | None  # the newest accepted snapshot's key, None before the first
    last_snapshot_chars: int  # the silver text characters that snapshot was built from


def snapshot_due(inputs: CadenceInputs, min_new_fraction: float) -> tuple[bool, str]:
    """Whether to cut, and why (or why not), in words for a sensor tick or a snapshot's metadata.

    Characters stand in for tokens: the snapshot's tokenizer turns text into tokens at a steady
    rate, and silver records its characters per batch without tokenizing."""
    if not inputs.changed_batches:
        since = f" since {inputs.last_snapshot}" if inputs.last_snapshot else ""
        return False, f"no usable silver batch changed{since}"
    if inputs.last_snapshot is None or inputs.last_snapshot_chars <= 0:
        return True, f"first snapshot ({len(inputs.changed_batches)} silver batch(es))"
    share = sum(inputs.changed_batches.values()) / inputs.last_snapshot_chars
    words = (f"silver changed since {inputs.last_snapshot}: {len(inputs.changed_batches)} batch(es), "
             f"{share:.1%} of its text (cut at {min_new_fraction:.0%})")
    return share >= min_new_fraction, words
