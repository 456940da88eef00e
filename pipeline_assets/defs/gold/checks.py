"""Asset checks on the latest gold snapshot: contract and packing block; drift and volume report."""

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, asset_check

from pipeline_assets.contracts import GoldSequence
from pipeline_assets.defs.check_helpers import contract_check_result
from pipeline_assets.defs.gold.assets import read_snapshot
from pipeline_assets.defs.keys import GOLD_SEQUENCES
from pipeline_assets.defs.partitions import snapshot_key
from pipeline_assets.lib.drift import psi_numeric
from pipeline_assets.lib.packing import PackingFloor, packing_floor
from pipeline_assets.resources import GoldPolicy, LakeResource


def _columns(lake: LakeResource, version: int | None, *columns: str | pl.Expr) -> pl.DataFrame:
    """Only what a check needs from a snapshot: its token-id lists are most of its bytes."""
    scan = lake.scan("gold", "sequences", version)
    if scan is None:
        raise ValueError("gold/sequences does not exist yet: materialize it first")
    return scan.select(*columns).collect()


def _real_and_total(lake: LakeResource, version: int | None = None) -> tuple[int, int]:
    totals = _columns(lake, version, pl.col("real_tokens").sum(), pl.len(), pl.col("input_ids").list.len().max())
    real, rows, seq_len = totals.row(0)
    return int(real or 0), int(rows) * int(seq_len or 0)


def _against_previous(lake: LakeResource, judge) -> AssetCheckResult:
    """``judge(previous_version)``, or a pass when this is the first snapshot."""
    current = lake.version("gold", "sequences")
    if not current:
        return AssetCheckResult(passed=True, description="first snapshot: nothing to compare with")
    return judge(current - 1)


@asset_check(asset=GOLD_SEQUENCES, name="contract", blocking=True, description="The snapshot satisfies the GoldSequence contract.")
def gold_contract(lake: LakeResource) -> AssetCheckResult:
    return contract_check_result(read_snapshot(lake), GoldSequence)


@asset_check(asset=GOLD_SEQUENCES, name="packing_efficiency", blocking=True,
             description="Packing wastes no rows that the documents' lengths would let it save: it reaches the "
             "required share of real tokens, or needs no more rows than first-fit of the same pieces.")
def gold_packing_efficiency(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    pieces = _columns(lake, None, pl.col("document_lengths").explode(), pl.col("input_ids").list.len().max().alias("seq_len"))
    lengths, seq_len = pieces["document_lengths"].drop_nulls().to_numpy(), int(pieces["seq_len"].max() or 0)
    rows = _columns(lake, None, pl.len()).item()
    efficiency = float(lengths.sum()) / (rows * seq_len) if rows and seq_len else 0.0
    floor = packing_floor(lengths, seq_len) if seq_len else PackingFloor(0, 0)
    limit = gold_policy.min_packing_efficiency
    passed = efficiency >= limit or rows <= floor.first_fit_rows
    verdict = (f"at least {limit}" if efficiency >= limit
               else f"below {limit}, but {rows} rows where first-fit needs {floor.first_fit_rows} and the tokens alone "
               f"fill {floor.lower_bound_rows}: {'what these lengths allow' if passed else 'packing is broken'}")
    return AssetCheckResult(
        passed=passed,
        description=f"packing efficiency {efficiency:.4f} ({verdict})",
        metadata={"packing_efficiency": round(efficiency, 5), "rows": rows, "first_fit_rows": floor.first_fit_rows,
                  "lower_bound_rows": floor.lower_bound_rows, "minimum": limit},
    )


@asset_check(asset=GOLD_SEQUENCES, name="token_length_drift",
             description="PSI of document token lengths against the previous snapshot.")
def gold_token_length_drift(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    def judge(previous: int) -> AssetCheckResult:
        before, now = (
            _columns(lake, version, pl.col("document_lengths").explode())["document_lengths"].to_numpy()
            for version in (previous, previous + 1)
        )
        psi = psi_numeric(before, now)
        return AssetCheckResult(
            passed=psi < gold_policy.psi_warn,
            severity=AssetCheckSeverity.ERROR if psi >= gold_policy.psi_fail else AssetCheckSeverity.WARN,
            description=f"document token lengths PSI {psi:.3f} against {snapshot_key(previous)} "
            f"(warn at {gold_policy.psi_warn}, fail at {gold_policy.psi_fail})",
            metadata={"psi": round(psi, 4), "compared_with": snapshot_key(previous)},
        )

    return _against_previous(lake, judge)


@asset_check(asset=GOLD_SEQUENCES, name="token_volume",
             description="Real tokens are within tolerance of the previous snapshot's.")
def gold_token_volume(lake: LakeResource, gold_policy: GoldPolicy) -> AssetCheckResult:
    def judge(previous: int) -> AssetCheckResult:
        (before, _), (now, _) = (_real_and_total(lake, version) for version in (previous, previous + 1))
        change = (now - before) / before if before else float("inf")
        tolerance = gold_policy.volume_tolerance
        return AssetCheckResult(
            passed=abs(change) <= tolerance,
            severity=AssetCheckSeverity.WARN,
            description=f"{now:,} real tokens against {before:,} in {snapshot_key(previous)} "
            f"({change:+.0%}, tolerance ±{tolerance:.0%})",
            metadata={"real_tokens": now, "previous_real_tokens": before, "change": round(change, 4)},
        )

    return _against_previous(lake, judge)


gold_checks = [gold_contract, gold_packing_efficiency, gold_token_length_drift, gold_token_volume]
