"""The GRPO replay buffer: taking rows for an update, its checks, its contract, and its
preference pairs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import orjson
import pandera.errors
import polars as pl
import pytest

from pipeline_assets.contracts import ReplayBufferRow, polars_schema, validate
from pipeline_assets.lib.formats import PREFERENCE
from pipeline_assets.lib.landing.files import read_landing_file
from pipeline_assets.lib.rl.replay import (
    PAIR_FIELDS,
    STATUSES,
    StalenessPolicy,
    blank_completions,
    freshness,
    merged,
    preference_pairs_from_groups,
    reward_signal,
    take_for_update,
    write_rollout_pairs,
)

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc)
POLICY = StalenessPolicy(max_staleness=1, max_pending_seconds=3600.0)


def rollout(
    rollout_id: str,
    group_id: str,
    *,
    version: int = 5,
    reward: float = 0.0,
    status: str = "pending",
    consumed_by: int | None = None,
    completion: str | None = None,
    age_seconds: float = 60.0,
    prompt_id: str | None = None,
) -> dict:
    return {
        "rollout_id": rollout_id,
        "run": "rl-v0",
        "group_id": group_id,
        "prompt_id": prompt_id or f"p-{group_id}",
        "policy_version": version,
        "generated_at": NOW - timedelta(seconds=age_seconds),
        "worker": "w0",
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "behaviour_logps": [-0.5, -1.25],
        "completion": f"answer {rollout_id}" if completion is None else completion,
        "reward": reward,
        "verifier_detail": "exact match" if reward == 1.0 else "expected 42",
        "status": status,
        "consumed_by_version": consumed_by,
        "updated_at": NOW - timedelta(seconds=age_seconds),
    }


def buffer(*rows: dict) -> pl.DataFrame:
    return pl.DataFrame(list(rows), schema=polars_schema(ReplayBufferRow))


def group(group_id: str, rewards: list[float], **fields) -> list[dict]:
    return [rollout(f"{group_id}-{i}", group_id, reward=r, **fields) for i, r in enumerate(rewards)]


# --- taking rows --------------------------------------------------------------------------------


def test_rows_lagging_beyond_the_limit_are_dropped_whole_groups_at_a_time_and_counted():
    rows = buffer(
        *group("fresh", [1.0, 0.0], version=5),
        *group("old", [1.0, 0.0], version=2),
        rollout("mixed-0", "mixed", version=5),
        rollout("mixed-1", "mixed", version=2),
    )
    consumed, dropped = take_for_update(rows, 5, POLICY, now=NOW)

    assert consumed.get_column("rollout_id").to_list() == ["fresh-0", "fresh-1"]
    assert sorted(dropped.get_column("rollout_id")) == ["mixed-0", "mixed-1", "old-0", "old-1"]
    assert set(consumed.get_column("status")) == {"consumed"}
    assert set(dropped.get_column("status")) == {"dropped_stale"}
    assert set(pl.concat([consumed, dropped]).get_column("consumed_by_version")) == {5}

    updated = validate(merged(rows, consumed, dropped), ReplayBufferRow)
    judgement = freshness(updated, POLICY, NOW)
    assert judgement.metrics["dropped_stale_rows"] == 4
    assert (
        not judgement.passed
        and "4 row(s) dropped as stale, lagging up to 3 versions (limit 1)" in judgement.description
    )


def test_freshness_fails_naming_the_worst_lag_and_the_limit():
    rows = buffer(
        *group("late", [1.0, 0.0, 0.5], version=2, status="consumed", consumed_by=5),
        *group("on_time", [1.0, 0.0], version=4, status="consumed", consumed_by=5),
    )
    judgement = freshness(rows, POLICY, NOW)

    assert not judgement.passed
    assert "3 consumed row(s) lagged up to 3 versions (limit 1)" in judgement.description
    assert judgement.metrics["staleness_max"] == 3
    assert judgement.metrics["staleness_mean"] == pytest.approx((3 * 3 + 2 * 1) / 5)


def test_rows_within_the_limit_are_consumed_once():
    rows = buffer(*group("g", [1.0, 0.0], version=4), *group("h", [0.0, 0.0], version=5))
    consumed, dropped = take_for_update(rows, 5, POLICY, now=NOW)
    assert consumed.height == 4 and dropped.is_empty()

    updated = merged(rows, consumed, dropped)
    again_consumed, again_dropped = take_for_update(updated, 6, POLICY, now=NOW)
    assert again_consumed.is_empty() and again_dropped.is_empty()
    assert freshness(updated, POLICY, NOW).passed


def test_a_pending_row_older_than_the_limit_fails_freshness_naming_its_age():
    rows = buffer(
        rollout("waiting", "g", age_seconds=7200.0), rollout("recent", "g", age_seconds=10.0)
    )
    judgement = freshness(rows, POLICY, NOW)

    assert not judgement.passed
    assert "7200s" in judgement.description and "limit 3600s" in judgement.description
    assert judgement.metrics["oldest_pending_seconds"] == pytest.approx(7200.0)
    assert judgement.metrics["pending_rows"] == 2


# --- reward signal ------------------------------------------------------------------------------


def groups_with_zero_spread(zero_spread: int, total: int, **fields) -> pl.DataFrame:
    rows = []
    for g in range(total):
        rewards = [1.0, 1.0] if g < zero_spread else [1.0, 0.0]
        rows += group(f"g{g:02d}", rewards, **fields)
    return buffer(*rows)


def test_reward_signal_fails_when_too_many_groups_have_one_reward():
    judgement = reward_signal(groups_with_zero_spread(19, 20, status="consumed", consumed_by=5))
    assert not judgement.passed
    assert "95.0%" in judgement.description
    assert judgement.metrics["zero_spread_groups"] == 19


def test_reward_signal_passes_under_the_limit_and_judges_all_rows_before_any_is_consumed():
    judgement = reward_signal(groups_with_zero_spread(17, 20))
    assert judgement.passed
    assert judgement.metrics["zero_spread_share"] == pytest.approx(0.85)
    assert judgement.metrics["judged_rows"] == "all"


# --- contract -----------------------------------------------------------------------------------


def test_contract_accepts_a_valid_buffer():
    rows = buffer(*group("g", [1.0, 0.0]), rollout("c", "h", status="consumed", consumed_by=6))
    validate(rows, ReplayBufferRow)
    assert set(
        ReplayBufferRow.to_schema().columns["status"].checks[0].statistics["allowed_values"]
    ) == set(STATUSES)


@pytest.mark.parametrize(
    "broken",
    [
        {"behaviour_logps": [-0.5]},  # one log-probability for two completion tokens
        {"status": "in_flight"},
    ],
)
def test_contract_rejects_mismatched_logps_and_unknown_status(broken):
    with pytest.raises(pandera.errors.SchemaErrors):
        validate(buffer({**rollout("r", "g"), **broken}), ReplayBufferRow)


# --- preference pairs ---------------------------------------------------------------------------


def pair_source() -> tuple[pl.DataFrame, pl.DataFrame]:
    rows = buffer(
        rollout("a2", "mixed", reward=1.0),
        rollout("a1", "mixed", reward=1.0),
        rollout("a4", "mixed", reward=0.25),
        rollout("a3", "mixed", reward=0.0),
        *group("all_right", [1.0, 1.0]),
        *group("all_wrong", [0.0, 0.5]),
        rollout("b1", "blank_wrong", reward=1.0),
        rollout("b2", "blank_wrong", reward=0.0, completion="  \n"),
        rollout("c1", "blank_right", reward=1.0, completion=""),
        rollout("c2", "blank_right", reward=0.0),
        rollout("c3", "blank_right", reward=1.0),
    )
    prompts = pl.DataFrame(
        {
            "prompt_id": [
                "p-mixed",
                "p-all_right",
                "p-all_wrong",
                "p-blank_wrong",
                "p-blank_right",
            ],
            "prompt": [
                "What is 6 x 7?",
                "What is 1 + 1?",
                "Prove P != NP.",
                "Name a prime.",
                "What is 2 + 2?",
            ],
        }
    )
    return rows, prompts


def test_pairs_only_from_groups_with_a_correct_and_a_wrong_completion():
    rows, prompts = pair_source()
    pairs = preference_pairs_from_groups(rows, prompts)

    assert pairs.columns == list(PAIR_FIELDS)
    assert pairs.get_column("id").to_list() == ["rl:blank_right", "rl:mixed"]
    mixed = pairs.row(1, named=True)
    assert (mixed["prompt"], mixed["chosen"], mixed["rejected"]) == (
        "What is 6 x 7?",
        "answer a1",
        "answer a3",
    )
    assert (mixed["score_chosen"], mixed["score_rejected"]) == (1.0, 0.0)
    assert mixed["meta"] == {
        "group_id": "mixed",
        "policy_version": 5,
        "chosen_rollout_id": "a1",
        "rejected_rollout_id": "a3",
        "rejected_verifier_detail": "expected 42",
    }
    assert (
        pairs.row(0, named=True)["chosen"] == "answer c3"
    )  # the blank correct completion is passed over
    assert blank_completions(rows) == 2


def test_written_pairs_parse_back_and_pass_the_landing_contract(tmp_path):
    rows, prompts = pair_source()
    pairs = preference_pairs_from_groups(rows, prompts)
    path = write_rollout_pairs(pairs, tmp_path, "policy-v5")

    assert path == tmp_path / "rl_rollouts" / "policy-v5.jsonl"
    assert [p.name for p in path.parent.iterdir()] == [
        "policy-v5.jsonl"
    ]  # no temporary file left behind
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [set(line) for line in lines] == [set(PAIR_FIELDS)] * 2
    assert lines[1]["meta"]["group_id"] == "mixed"

    result = read_landing_file(path.name, path.read_bytes(), None, PREFERENCE)
    assert result.quarantine.is_empty()
    assert result.lines_read == result.records.height == 2
    assert result.records.get_column("id").to_list() == ["rl:blank_right", "rl:mixed"]


def test_no_pairs_write_no_file(tmp_path):
    rows, prompts = pair_source()
    no_pairs = preference_pairs_from_groups(rows.filter(pl.col("group_id") == "all_right"), prompts)
    assert no_pairs.is_empty()
    assert write_rollout_pairs(no_pairs, tmp_path, "policy-v6") is None
    assert not (tmp_path / "rl_rollouts").exists()


def test_an_update_takes_at_most_max_groups_fresh_groups_oldest_first_and_drops_every_stale_one():
    rows = buffer(
        *group("newer", [1.0, 0.0], version=5, age_seconds=10),
        *group("older", [1.0, 0.0], version=5, age_seconds=50),
        *group("stale", [1.0, 0.0], version=1, age_seconds=5),
    )
    consumed, dropped = take_for_update(rows, 5, POLICY, now=NOW, max_groups=1)

    assert set(consumed["group_id"]) == {"older"} and set(dropped["group_id"]) == {"stale"}
    again, _ = take_for_update(merged(rows, consumed, dropped), 5, POLICY, now=NOW, max_groups=1)
    assert set(again["group_id"]) == {"newer"}, "left pending for the next update"
