"""Silver's decision: the sizer's rate a record, measured on synthetic batches, against a decision
four times larger than the largest it measured.

Measured: ``decision_rate.measure_decision`` on the sizer's batch sizes (BATCH_SIZES, up to
400,000 records) and on one of TARGET_RECORDS, in turns, with REMOVALS (the sample corpus's
shares: 3% exact copies, 3% near copies, 3% rejected per record); the first two fitted as the
sizer fits them must predict the decision's seconds on the last within TOLERANCE. Baseline: the
same fit on batches of a calibration's sizes (CALIBRATION_SIZES: the sizer bench's arrivals),
measured in the same turns: the sizes the sizer had before it measured the decision (its
calibration's batches; it fitted the step's own ``decide_seconds`` on them, which carry the step's
fixed costs besides). ``ratio``: the baseline's error over the measured fit's.
"""

from __future__ import annotations

from pipeline_assets.defs.silver.decision_rate import BATCH_SIZES, measure_decision
from pipeline_assets.lib.ops.sizing import Removals, StageFit, fit_measured

TARGET_RECORDS = 1_600_000
CALIBRATION_SIZES = (3_000, 6_000, 11_000)
REMOVALS = Removals(exact=0.03, near=0.03, per_record=0.03)
TOLERANCE = 0.30


def run(target_records: int = TARGET_RECORDS) -> dict:
    sizes = (*CALIBRATION_SIZES, *BATCH_SIZES, target_records)
    points = dict(measure_decision(sizes, REMOVALS))
    measured = points[target_records]
    sizer, calibration = (
        fit_measured((rows, points[rows]) for rows in fitted_on)
        for fitted_on in (BATCH_SIZES, CALIBRATION_SIZES)
    )
    error = sizer.seconds(1, target_records) / measured - 1
    baseline_error = calibration.seconds(1, target_records) / measured - 1
    return {
        "target_records": target_records,
        "points": [[rows, seconds] for rows, seconds in points.items()],
        "measured": f"the sizer's fit ({_rate(sizer)}) on {', '.join(map(str, BATCH_SIZES))} "
        f"records predicts {sizer.seconds(1, target_records):.2f} s on {target_records:,}, "
        f"measured {measured:.2f} s: {error:+.1%}",
        "baseline": f"fitted on a calibration's sizes ({', '.join(map(str, CALIBRATION_SIZES))}: "
        f"{_rate(calibration)}): {calibration.seconds(1, target_records):.2f} s, "
        f"{baseline_error:+.1%}",
        "ratio": abs(baseline_error) / max(abs(error), 1e-9),
        "ratio_is": "the calibration-size fit's error / the sizer's fit's error",
        "target": f"the sizer's decision fit within {TOLERANCE:.0%} of the decision measured on "
        f"{target_records:,} records",
        "target_met": abs(error) <= TOLERANCE,
    }


def _rate(fit: StageFit) -> str:
    return f"{fit.fixed_seconds:.3f} s + {fit.seconds_per_unit * 1e6:.3f} us a record"
