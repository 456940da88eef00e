"""The GRPO replay buffer's pure logic: which completions an update takes, and how healthy the
buffer is.

Rollout workers append one row per completion to ``rl/replay_buffer`` (contract ``ReplayBufferRow``)
with status ``pending``. Before each policy update the learner takes the pending rows: completions
generated within ``max_staleness`` versions of the current policy are ``consumed``, older ones are
``dropped_stale`` (their behaviour log-probabilities are too far off-policy for the importance ratio
to correct). The checks judge the buffer's freshness and whether its rewards still carry a learning
signal. Groups with a correct and a wrong completion also become preference pairs, written as a
landing file so the DPO path can learn from them too.

Polars only, so the rules are testable without Dagster or a model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

PENDING = "pending"
CONSUMED = "consumed"
DROPPED_STALE = "dropped_stale"
STATUSES = (PENDING, CONSUMED, DROPPED_STALE)

CORRECT_REWARD = 1.0
ROLLOUT_SOURCE = "rl_rollouts"  # the landing source the pairs are written under
PAIR_FIELDS = ("prompt", "chosen", "rejected", "score_chosen", "score_rejected", "id", "meta")

# A character Python's str.strip() keeps, as the landing reader tests required text (every character
# str.isspace() is true for lies in the Basic Multilingual Plane).
_NOT_SPACE = (
    "[^" + "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(0x10000)) if c.isspace()) + "]"
)


@dataclass(frozen=True)
class StalenessPolicy:
    max_staleness: int  # versions a completion's generating policy may lag the policy it updates
    max_pending_seconds: (
        float  # how long a completion may wait in the buffer before an update takes it
    )


@dataclass(frozen=True)
class Judgement:
    passed: bool
    description: str
    metrics: dict = field(default_factory=dict)


# --- taking rows for an update -------------------------------------------------------------------


def take_for_update(
    buffer: pl.DataFrame,
    current_version: int,
    policy: StalenessPolicy,
    *,
    now: datetime | None = None,
    max_groups: int | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The pending rows an update at ``current_version`` takes: ``(consumed, dropped)``, both with
    ``status``, ``consumed_by_version`` (= ``current_version``) and ``updated_at`` (``now``, by
    default the current UTC time) set, ready to merge back into the buffer by ``rollout_id``.

    A group is taken whole: its completions share one generation, and GRPO's advantage is relative
    to the group, so a group with any row lagging more than ``max_staleness`` versions is dropped
    entirely rather than trained on in part. A rollout that has any non-pending row in ``buffer``
    is never taken again, so calling this on the merged buffer takes nothing twice. ``max_groups``:
    consume at most that many fresh groups, the oldest first (the rest stay pending for the next
    update); every stale one is dropped.
    """
    pending = _untaken(buffer)
    lag = current_version - pl.col("policy_version")
    stale_groups = pending.filter(lag > policy.max_staleness).select("group_id").unique()
    taken_at = now or datetime.now(timezone.utc)
    fresh = pending.join(stale_groups, on="group_id", how="anti")
    if max_groups is not None:
        oldest = (
            fresh.group_by("group_id")
            .agg(pl.col("generated_at").min())
            .sort("generated_at", "group_id")
            .head(max_groups)
            .select("group_id")
        )
        fresh = fresh.join(oldest, on="group_id", how="semi")
    consumed = _mark(fresh, CONSUMED, current_version, taken_at)
    dropped = _mark(
        pending.join(stale_groups, on="group_id", how="semi"),
        DROPPED_STALE,
        current_version,
        taken_at,
    )
    return consumed, dropped


def merged(buffer: pl.DataFrame, *taken: pl.DataFrame) -> pl.DataFrame:
    """``buffer`` with the rows of ``taken`` replacing theirs by ``rollout_id``: in memory, the
    merge the buffer's Delta table gets."""
    updates = pl.concat(taken) if taken else buffer.clear()
    return buffer.update(updates, on="rollout_id")


def _untaken(buffer: pl.DataFrame) -> pl.DataFrame:
    taken_ids = buffer.filter(pl.col("status") != PENDING).select("rollout_id")
    return buffer.filter(pl.col("status") == PENDING).join(taken_ids, on="rollout_id", how="anti")


def _mark(rows: pl.DataFrame, status: str, version: int, at: datetime) -> pl.DataFrame:
    return rows.with_columns(
        status=pl.lit(status),
        consumed_by_version=pl.lit(version, dtype=pl.Int64),
        updated_at=pl.lit(at, dtype=pl.Datetime("us", "UTC")),
    )


# --- checks -------------------------------------------------------------------------------------


def freshness(buffer: pl.DataFrame, policy: StalenessPolicy, now: datetime) -> Judgement:
    """Fails when a consumed row lagged its update by more than ``max_staleness`` versions, when
    rows were dropped as stale (a rollout worker lags the learner: its work is wasted, and a learner
    fed by it alone starves), or when a pending row has waited longer than ``max_pending_seconds``
    at ``now`` (the workers outpace the learner, or it stopped taking). Staleness metrics are 0 when
    nothing was consumed."""
    consumed = buffer.filter(pl.col("status") == CONSUMED)
    lags = consumed.get_column("consumed_by_version") - consumed.get_column("policy_version")
    worst_lag = int(lags.max() or 0)
    lagged_too_far = int((lags > policy.max_staleness).sum())
    pending = buffer.filter(pl.col("status") == PENDING)
    waits = (
        pl.lit(now, dtype=pl.Datetime("us", "UTC")) - pl.col("generated_at")
    ).dt.total_microseconds() / 1e6
    wait_seconds = pending.select(waits).to_series()
    oldest_wait = float(wait_seconds.max() or 0.0)
    waited_too_long = int((wait_seconds > policy.max_pending_seconds).sum())

    dropped = buffer.filter(pl.col("status") == DROPPED_STALE)
    dropped_lags = dropped.get_column("consumed_by_version") - dropped.get_column("policy_version")
    failures = []
    if dropped.height:
        failures.append(
            f"{dropped.height} row(s) dropped as stale, lagging up to {int(dropped_lags.max())} "
            f"versions (limit {policy.max_staleness})"
        )
    if lagged_too_far:
        failures.append(
            f"{lagged_too_far} consumed row(s) lagged up to {worst_lag} versions "
            f"(limit {policy.max_staleness})"
        )
    if waited_too_long:
        failures.append(
            f"{waited_too_long} pending row(s) waited too long, the oldest {oldest_wait:.0f}s "
            f"(limit {policy.max_pending_seconds:.0f}s)"
        )
    summary = (
        f"consumed rows lagged at most {worst_lag} versions (limit {policy.max_staleness}); the "
        f"oldest pending row has waited {oldest_wait:.0f}s (limit "
        f"{policy.max_pending_seconds:.0f}s)"
    )
    return Judgement(
        not failures,
        "; ".join(failures) or summary,
        {
            "staleness_mean": float(lags.mean() or 0.0),
            "staleness_max": worst_lag,
            "consumed_rows": consumed.height,
            "dropped_stale_rows": dropped.height,
            "pending_rows": pending.height,
            "oldest_pending_seconds": oldest_wait,
            "max_staleness": policy.max_staleness,
            "max_pending_seconds": policy.max_pending_seconds,
        },
    )


def reward_signal(buffer: pl.DataFrame, max_zero_spread_share: float = 0.9) -> Judgement:
    """Fails when more than ``max_zero_spread_share`` of the groups gave every completion the same
    reward: GRPO's advantage (reward minus the group's mean) is zero there, so those groups teach
    nothing (the prompts are too easy or too hard for the policy). Judges the groups of consumed
    rows, what updates trained on; before any update has consumed, all rows."""
    consumed = buffer.filter(pl.col("status") == CONSUMED)
    judged, judged_rows = (consumed, CONSUMED) if consumed.height else (buffer, "all")
    spreads = judged.group_by("group_id").agg(
        zero_spread=pl.col("reward").max() == pl.col("reward").min()
    )
    groups = spreads.height
    zero_spread = int(spreads.get_column("zero_spread").sum())
    share = zero_spread / groups if groups else 0.0
    metrics = {
        "groups": groups,
        "zero_spread_groups": zero_spread,
        "zero_spread_share": share,
        "max_zero_spread_share": max_zero_spread_share,
        "judged_rows": judged_rows,
    }
    verdict = (
        f"{share:.1%} of {groups} group(s) ({judged_rows} rows) gave every completion one reward "
        f"(limit {max_zero_spread_share:.1%})"
    )
    if share > max_zero_spread_share:
        return Judgement(False, f"{verdict}: no advantage to learn from", metrics)
    return Judgement(True, verdict, metrics)


# --- preference pairs ---------------------------------------------------------------------------


def preference_pairs_from_groups(rows: pl.DataFrame, prompts: pl.DataFrame) -> pl.DataFrame:
    """One preference pair per group with a correct completion (reward 1.0) and a wrong one (reward
    below 1.0): the first of each by ``rollout_id``, with the prompt text from ``prompts``
    (``prompt_id``, ``prompt``; one row per prompt). Columns ``PAIR_FIELDS``; ``id`` is
    ``rl:<group_id>``, stable across reruns, and ``meta`` holds the group, its policy version, the
    two rollouts and the verifier's detail on the rejected one.

    The landing contract requires non-blank text, so blank completions are neither chosen nor
    rejected (a group left without both gives no pair; count them with ``blank_completions``), and a
    group whose prompt is unknown or blank gives none.
    """
    usable = rows.filter(pl.col("completion").str.contains(_NOT_SPACE)).sort("rollout_id")
    chosen = _first_per_group(usable.filter(pl.col("reward") == CORRECT_REWARD)).select(
        "group_id",
        "prompt_id",
        "policy_version",
        chosen="completion",
        score_chosen="reward",
        chosen_rollout_id="rollout_id",
    )
    rejected = _first_per_group(usable.filter(pl.col("reward") < CORRECT_REWARD)).select(
        "group_id",
        rejected="completion",
        score_rejected="reward",
        rejected_rollout_id="rollout_id",
        rejected_verifier_detail="verifier_detail",
    )
    prompt_texts = prompts.select("prompt_id", "prompt").filter(
        pl.col("prompt").str.contains(_NOT_SPACE)
    )
    return (
        chosen.join(rejected, on="group_id")
        .join(prompt_texts, on="prompt_id", validate="m:1")
        .sort("group_id")
        .select(
            "prompt",
            "chosen",
            "rejected",
            "score_chosen",
            "score_rejected",
            id=pl.lit("rl:") + pl.col("group_id"),
            meta=pl.struct(
                "group_id",
                "policy_version",
                "chosen_rollout_id",
                "rejected_rollout_id",
                "rejected_verifier_detail",
            ),
        )
    )


def blank_completions(rows: pl.DataFrame) -> int:
    """Completions that are empty or whitespace only: ``preference_pairs_from_groups`` skips
    them."""
    return rows.height - rows.filter(pl.col("completion").str.contains(_NOT_SPACE)).height


def _first_per_group(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.group_by("group_id", maintain_order=True).first()


def write_rollout_pairs(pairs: pl.DataFrame, landing_dir: Path, name: str) -> Path | None:
    """Write ``pairs`` as ``<landing_dir>/rl_rollouts/<name>.jsonl``, one landing record per line;
    None, and nothing written, when there are none.

    Atomic: the lines go to a hidden temporary file in the same folder (the landing sensor skips
    names starting with '.'), which is then renamed, so the sensor never sees a half-written file.
    A file of the same name is replaced.
    """
    if "/" in name or name.startswith(".") or not name:
        raise ValueError(f"{name!r} is not a landing file name: no '/', no leading '.'")
    if pairs.is_empty():
        return None
    folder = Path(landing_dir) / ROLLOUT_SOURCE
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}.jsonl"
    temporary = folder / f".{name}.jsonl.{os.getpid()}.tmp"
    try:
        with temporary.open("wb") as out:
            out.write(pairs.select(PAIR_FIELDS).write_ndjson().encode())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target
