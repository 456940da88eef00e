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


def promotion_gate(
    candidate: dict[str, float],
    champion: dict[str, float] | None,
    *,
    vocab_size: int | None,
    margin: float = 0.005,
    slice_tolerance: float = 0.02,
    against: str = "the champion",
) -> GateDecision:
    """Promote when the candidate's overall loss is lower by at least ``margin`` (relative) and no
    slice is worse by more than ``slice_tolerance`` (relative) than ``champion``'s (``against``
    names it: a first fine-tune is judged against the base model it started from). Without one,
    the candidate must beat the uniform-token baseline, ln(vocab_size)."""
    if OVERALL not in candidate:
        raise ValueError(f"the candidate has no {OVERALL!r} slice")
    if champion is None:
        if vocab_size is None:
            raise ValueError(
                "a first model is judged against ln(vocab_size): pass the vocabulary size"
            )
        baseline = math.log(vocab_size)
        passed = candidate[OVERALL] < baseline
        return GateDecision(
            passed,
            (
                f"first model: overall loss {candidate[OVERALL]:.4f} "
                f"{'beats' if passed else 'does not beat'} the uniform baseline ln({vocab_size}) = "
                f"{baseline:.4f}"
            ),
            {"candidate_loss": candidate[OVERALL], "uniform_baseline_loss": baseline},
        )

    improvement = (champion[OVERALL] - candidate[OVERALL]) / champion[OVERALL]
    regressions = {
        name: (candidate[name] - champion[name]) / champion[name]
        for name in sorted(candidate.keys() & champion.keys())
        if name != OVERALL
    }
    worst = max(regressions, key=regressions.get) if regressions else None
    numbers = {
        "candidate_loss": candidate[OVERALL],
        "champion_loss": champion[OVERALL],
        "judged_against": against,
        "relative_improvement": improvement,
        "required_improvement": margin,
        "worst_slice": worst,
        "worst_slice_regression": regressions.get(worst, 0.0),
        "slice_tolerance": slice_tolerance,
        "slice_regressions": regressions,
    }
    if improvement < margin:
        return GateDecision(
            False,
            f"overall loss {candidate[OVERALL]:.4f} against {against}'s "
            f"{champion[OVERALL]:.4f}: {improvement:+.2%}, below the required {margin:.2%}",
            numbers,
        )
    if worst is not None and regressions[worst] > slice_tolerance:
        return GateDecision(
            False,
            f"slice {worst} is {regressions[worst]:.2%} worse than {against}'s "
            f"(tolerance {slice_tolerance:.2%}), though overall improves {improvement:.2%}",
            numbers,
        )
    return GateDecision(
        True,
        f"overall loss improves {improvement:.2%} on {against}'s (required {margin:.2%}); the "
        f"worst slice {worst or '-'} moves {numbers['worst_slice_regression']:+.2%} (tolerance "
        f"{slice_tolerance:.2%})",
        numbers,
    )


def champion_moved(*, seen: str | None, current: str | None, candidate: str) -> str | None:
    """Why an evaluation's numbers no longer judge the champion (None while they still do): the
    report measured the candidate against ``seen``, but ``current`` holds the alias now."""
    if current in (seen, candidate):
        return None
    then = f"v{seen}" if seen else "no champion"
    now = f"v{current}" if current else "none"
    return (
        f"the champion moved since evaluation/report measured this candidate (then {then}, now "
        f"{now}): its numbers do not judge the current champion; materialize evaluation/report and "
        "registry/model_version for this snapshot again"
    )


def _is_rollback(entry: dict) -> bool:
    # Entries written before `kind` existed name the rollback command in `by`.
    return (
        entry.get(
            "kind", "rollback" if entry.get("by") == "pipeline-assets rollback" else "promote"
        )
        == "rollback"
    )


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


CHANCE_ACCURACY = 0.5  # a model that cannot tell chosen from rejected


@dataclass(frozen=True)
class PreferenceScore:
    """One model on one slice of held-out pairs: the share it prefers as labelled, and its mean
    reward margin."""

    accuracy: float
    mean_margin: float


def preference_gate(
    candidate: dict[str, PreferenceScore],
    champion: dict[str, PreferenceScore] | None,
    *,
    sft_losses: tuple[float, float] | None,
    margin: float = 0.005,
    slice_tolerance: float = 0.02,
    sft_champion_behind: bool = True,
) -> GateDecision:
    """Promote a DPO candidate when its sft validation loss (``sft_losses``: candidate's, the sft
    champion's) is at most ``slice_tolerance`` (relative) worse, and it beats the DPO champion:
    overall preference accuracy higher by at least ``margin`` (absolute), or level within ``margin``
    with a mean reward margin higher by at least ``margin`` (relative); no source slice may lose
    more than ``slice_tolerance`` accuracy (absolute). Without a champion, the candidate must beat
    chance (0.5) by ``margin``. A candidate with no sft champion behind it (DPO from the base
    model: ``sft_champion_behind`` False) has no sft validation loss to hold."""
    if OVERALL not in candidate:
        raise ValueError(f"the candidate has no {OVERALL!r} slice")
    numbers = {
        "candidate_accuracy": candidate[OVERALL].accuracy,
        "candidate_mean_margin": candidate[OVERALL].mean_margin,
    }
    if sft_losses is None and sft_champion_behind:
        return GateDecision(
            False,
            "the candidate's sft validation loss was not compared with the sft champion's "
            "(evaluation/dpo_report says why): check it by hand and use `pipeline-assets promote`",
            numbers,
        )
    sft_note = "no sft champion behind it (DPO from the base model)"
    if sft_losses is not None:
        sft_change = (sft_losses[0] - sft_losses[1]) / sft_losses[1]
        numbers |= {
            "sft_candidate_loss": sft_losses[0],
            "sft_champion_loss": sft_losses[1],
            "sft_relative_change": sft_change,
            "slice_tolerance": slice_tolerance,
        }
        if sft_change > slice_tolerance:
            return GateDecision(
                False,
                f"sft validation loss {sft_losses[0]:.4f} against the sft champion's "
                f"{sft_losses[1]:.4f}: {sft_change:+.2%}, beyond the tolerance "
                f"{slice_tolerance:.2%}",
                numbers,
            )
        sft_note = f"sft validation loss {sft_change:+.2%} (tolerance {slice_tolerance:.2%})"
    if champion is None:
        accuracy = candidate[OVERALL].accuracy
        passed = accuracy - CHANCE_ACCURACY >= margin
        return GateDecision(
            passed,
            f"first DPO model: held-out preference accuracy {accuracy:.3f} "
            f"{'beats' if passed else 'does not beat'} chance ({CHANCE_ACCURACY}) by the margin "
            f"{margin}; {sft_note}",
            numbers | {"chance_accuracy": CHANCE_ACCURACY, "required_improvement": margin},
        )
    return _beats_preference_champion(candidate, champion, margin, slice_tolerance, numbers)


def _beats_preference_champion(
    candidate: dict[str, PreferenceScore],
    champion: dict[str, PreferenceScore],
    margin: float,
    slice_tolerance: float,
    numbers: dict,
) -> GateDecision:
    ours, theirs = candidate[OVERALL], champion[OVERALL]
    accuracy_gain = ours.accuracy - theirs.accuracy
    margin_gain = _relative_gain(ours.mean_margin, theirs.mean_margin)
    drops = {
        name: champion[name].accuracy - candidate[name].accuracy
        for name in sorted(candidate.keys() & champion.keys())
        if name != OVERALL
    }
    worst = max(drops, key=drops.get) if drops else None
    numbers |= {
        "champion_accuracy": theirs.accuracy,
        "champion_mean_margin": theirs.mean_margin,
        "accuracy_gain": accuracy_gain,
        "mean_margin_gain": margin_gain,
        "required_improvement": margin,
        "worst_slice": worst,
        "worst_slice_accuracy_drop": drops.get(worst, 0.0),
        "slice_accuracy_drops": drops,
    }
    if accuracy_gain >= margin:
        better = (
            f"preference accuracy {ours.accuracy:.3f} against the champion's {theirs.accuracy:.3f}"
        )
    elif accuracy_gain > -margin and margin_gain >= margin:
        better = (
            f"preference accuracy level ({ours.accuracy:.3f} against {theirs.accuracy:.3f}) and "
            f"mean reward margin {ours.mean_margin:.4f} against {theirs.mean_margin:.4f} "
            f"({margin_gain:+.2%})"
        )
    else:
        return GateDecision(
            False,
            f"preference accuracy {ours.accuracy:.3f} against the champion's "
            f"{theirs.accuracy:.3f} ({accuracy_gain:+.3f}), mean reward margin {margin_gain:+.2%}: "
            f"neither better by the required {margin}",
            numbers,
        )
    if worst is not None and drops[worst] > slice_tolerance:
        return GateDecision(
            False,
            f"slice {worst} loses {drops[worst]:.3f} preference accuracy against the "
            f"champion's (tolerance {slice_tolerance}), though {better}",
            numbers,
        )
    return GateDecision(
        True,
        f"{better}; the worst slice {worst or '-'} moves "
        f"{-numbers['worst_slice_accuracy_drop']:+.3f} (tolerance {slice_tolerance})",
        numbers,
    )


def _relative_gain(ours: float, theirs: float) -> float:
    """(ours - theirs) / |theirs|; against a champion whose mean margin is exactly 0, the difference
    itself."""
    return (ours - theirs) / abs(theirs) if theirs else ours - theirs
