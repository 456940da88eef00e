"""The promotion gate: does a candidate model replace the champion?

Pure arithmetic over per-slice losses (token-weighted mean loss per slice, the same data for both
models), so the rule is readable and testable on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OVERALL = "overall"


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str
    numbers: dict = field(default_factory=dict)


def promotion_gate(candidate: dict[str, float], champion: dict[str, float] | None, *, vocab_size: int | None,
                   margin: float = 0.005, slice_tolerance: float = 0.02) -> GateDecision:
    """Promote when the candidate's overall loss is lower by at least ``margin`` (relative) and no
    slice is worse by more than ``slice_tolerance`` (relative). Without a champion, the candidate
    must beat the uniform-token baseline, ln(vocab_size)."""
    if OVERALL not in candidate:
        raise ValueError(f"the candidate has no {OVERALL!r} slice")
    if champion is None:
        if vocab_size is None:
            raise ValueError("a first model is judged against ln(vocab_size): pass the vocabulary size")
        baseline = math.log(vocab_size)
        passed = candidate[OVERALL] < baseline
        return GateDecision(passed, (
            f"first model: overall loss {candidate[OVERALL]:.4f} "
            f"{'beats' if passed else 'does not beat'} the uniform baseline ln({vocab_size}) = {baseline:.4f}"
        ), {"candidate_loss": candidate[OVERALL], "uniform_baseline_loss": baseline})

    improvement = (champion[OVERALL] - candidate[OVERALL]) / champion[OVERALL]
    regressions = {
        name: (candidate[name] - champion[name]) / champion[name]
        for name in sorted(candidate.keys() & champion.keys()) if name != OVERALL
    }
    worst = max(regressions, key=regressions.get) if regressions else None
    numbers = {
        "candidate_loss": candidate[OVERALL], "champion_loss": champion[OVERALL],
        "relative_improvement": improvement, "required_improvement": margin,
        "worst_slice": worst, "worst_slice_regression": regressions.get(worst, 0.0), "slice_tolerance": slice_tolerance,
        "slice_regressions": regressions,
    }
    if improvement < margin:
        return GateDecision(False, f"overall loss {candidate[OVERALL]:.4f} against the champion's {champion[OVERALL]:.4f}: "
                                   f"{improvement:+.2%}, below the required {margin:.2%}", numbers)
    if worst is not None and regressions[worst] > slice_tolerance:
        return GateDecision(False, f"slice {worst} is {regressions[worst]:.2%} worse than the champion's "
                                   f"(tolerance {slice_tolerance:.2%}), though overall improves {improvement:.2%}", numbers)
    return GateDecision(True, f"overall loss improves {improvement:.2%} (required {margin:.2%}); the worst slice "
                              f"{worst or '-'} moves {numbers['worst_slice_regression']:+.2%} (tolerance {slice_tolerance:.2%})",
                        numbers)


def champion_moved(*, seen: str | None, current: str | None, candidate: str) -> str | None:
    """Why an evaluation's numbers no longer judge the champion (None while they still do): the
    report measured the candidate against ``seen``, but ``current`` holds the alias now."""
    if current in (seen, candidate):
        return None
    then = f"v{seen}" if seen else "no champion"
    now = f"v{current}" if current else "none"
    return (f"the champion moved since evaluation/report measured this candidate (then {then}, now {now}): "
            "its numbers do not judge the current champion; materialize evaluation/report and "
            "registry/model_version for this snapshot again")


def _is_rollback(entry: dict) -> bool:
    # Entries written before `kind` existed name the rollback command in `by`.
    return entry.get("kind", "rollback" if entry.get("by") == "pipeline-assets rollback" else "promote") == "rollback"


def champion_chain(history: list[dict]) -> list[str]:
    """The champions still to roll back to, oldest first, replayed from the recorded moves (oldest
    first): a promotion stacks its version, a rollback removes the version it left."""
    chain: list[str] = []
    for entry in history:
        version = str(entry["version"])
        if _is_rollback(entry):
            while chain and chain[-1] != version:
                chain.pop()
            if not chain:
                chain.append(version)
        elif not chain or chain[-1] != version:
            chain.append(version)
    return chain


def rollback_target(history: list[dict], *, current: str | None) -> str | None:
    """The version a rollback from ``current`` goes to: the champion before it in the chain, never
    ``current`` itself; None when there is none."""
    chain = champion_chain(history)
    while chain and chain[-1] == current:
        chain.pop()
    return chain[-1] if chain else None
