"""Asset checks on the latest gold snapshot: contract and packing block; drift and volume report."""

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, asset_check

from pipeline_assets.contracts import GoldSequence
from pipeline_assets.defs.check_helpers import contract_check_result
from pipeline_assets.defs.gold.assets import read_snapshot
from pipeline_assets.defs.keys import GOLD_SEQUENCES
from pipeline_assets.defs.partitions import snapshot_key
from pipeline_assets.lib.drift import psi_numeric
from pipeline_assets.resources import GoldPolicy, LakeResource


def _snapshot(lake: LakeResource, version: int | None = None) -> pl.DataFrame:
    return read_snapshot(lake, version)


def _previous_version(lake: LakeResource) -> int | None:
    current = lake.version("gold", "sequences")
    return current - 1 if current else None


def _real_and_total(frame: pl.DataFrame) -> tuple[int, int]:
    seq_len = frame["input_ids"].list.len().max() or 0
    return int(frame["real_tokens"].sum()), frame.height * int(seq_len)


@asset_check(asset=GOLD_SEQUENCES, name="contract", blocking=True, description="The snapshot satisfies the GoldSequence contract.")
def gold_contract(lake: LakeResource) -> AssetCheckResult:
    return contract_check_result(_snapshot(lake), GoldSequence)


@asset_check(asset=GOLD_SEQUENCES, name="packing_efficiency", blocking=True,
             description="Real tokens are at least the required share of all tokens (padding is GPU time thrown away).")
def gold_packing_efficiency(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    real, total = _real_and_total(_snapshot(lake))
    efficiency = real / total if total else 0.0
    limit = gold_policy.min_packing_efficiency
    return AssetCheckResult(
        passed=efficiency >= limit,
        description=f"packing efficiency {efficiency:.4f} ({'at least' if efficiency >= limit else 'below'} {limit})",
        metadata={"packing_efficiency": round(efficiency, 5), "real_tokens": real, "all_tokens": total, "minimum": limit},
    )


@asset_check(asset=GOLD_SEQUENCES, name="token_length_drift",
             description="PSI of document token lengths against the previous snapshot.")
def gold_token_length_drift(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    previous = _previous_version(lake)
    if previous is None:
        return AssetCheckResult(passed=True, description="first snapshot: nothing to compare with")
    lengths = [_snapshot(lake, v)["document_lengths"].explode().to_numpy() for v in (previous, previous + 1)]
    psi = psi_numeric(lengths[0], lengths[1])
    severity = AssetCheckSeverity.ERROR if psi >= gold_policy.psi_fail else AssetCheckSeverity.WARN
    return AssetCheckResult(
        passed=psi < gold_policy.psi_warn,
        severity=severity,
        description=f"document token lengths PSI {psi:.3f} against {snapshot_key(previous)} "
        f"(warn at {gold_policy.psi_warn}, fail at {gold_policy.psi_fail})",
        metadata={"psi": round(psi, 4), "compared_with": snapshot_key(previous)},
    )


@asset_check(asset=GOLD_SEQUENCES, name="token_volume",
             description="Real tokens are within tolerance of the previous snapshot's.")
def gold_token_volume(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    previous = _previous_version(lake)
    if previous is None:
        return AssetCheckResult(passed=True, description="first snapshot: nothing to compare with")
    now, _ = _real_and_total(_snapshot(lake))
    before, _ = _real_and_total(_snapshot(lake, previous))
    change = (now - before) / before if before else float("inf")
    tolerance = gold_policy.volume_tolerance
    return AssetCheckResult(
        passed=abs(change) <= tolerance,
        severity=AssetCheckSeverity.WARN,
        description=f"{now:,} real tokens against {before:,} in {snapshot_key(previous)} ({change:+.0%}, tolerance ±{tolerance:.0%})",
        metadata={"real_tokens": now, "previous_real_tokens": before, "change": round(change, 4)},
    )


gold_checks = [gold_contract, gold_packing_efficiency, gold_token_length_drift, gold_token_volume]
