"""Rollouts re-enter as data: groups of an RL run with a right and a wrong completion, written to
the landing zone as the learner writes them, are ingested by the next `pipeline-assets run` as
preference pairs (the source `rl_rollouts` is a preference source without any setting) and curated
into silver/preference_pairs."""

from __future__ import annotations

import subprocess
import sys

import polars as pl

from pipeline_assets.lib.rl.replay import preference_pairs_from_groups, write_rollout_pairs
from pipeline_assets_tests.conftest import cli_environment
from pipeline_assets_tests.lib.rl.test_replay import buffer, rollout

PROMPTS = {
    f"p{i}": f"Reverse the letters of the word number {i} in the list given below, please."
    for i in range(30)
}


def _groups() -> pl.DataFrame:
    """Thirty groups with a right and a wrong answer, and one where every answer is wrong
    (no pair)."""
    rows = []
    for i, prompt_id in enumerate(PROMPTS):
        rows += [
            rollout(
                f"{i}-a",
                f"g{i}",
                reward=1.0,
                prompt_id=prompt_id,
                status="consumed",
                consumed_by=5,
                completion=f"the right answer to question {i}, written out in a full sentence",
            ),
            rollout(
                f"{i}-b",
                f"g{i}",
                reward=0.0,
                prompt_id=prompt_id,
                status="consumed",
                consumed_by=5,
                completion=f"a wrong answer to question {i}, also written out in a sentence",
            ),
        ]
    rows += [rollout("x-a", "gx", reward=0.0, prompt_id="p0", status="consumed", consumed_by=5)]
    return buffer(*rows)


def test_rollout_pairs_landed_by_a_run_are_ingested_as_preference_pairs(tmp_path):
    landing = tmp_path / "landing"
    (tmp_path / "reference" / "eval_sets").mkdir(parents=True)
    prompts = pl.DataFrame({"prompt_id": list(PROMPTS), "prompt": list(PROMPTS.values())})
    pairs = preference_pairs_from_groups(_groups(), prompts)
    written = write_rollout_pairs(pairs, landing, "rl-0001")
    assert written == landing / "rl_rollouts" / "rl-0001.jsonl" and pairs.height == 30

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline_assets.cli.main",
            "run",
            "--select",
            "key:bronze/* or key:silver/*",
        ],
        env=cli_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    bronze = pl.read_delta(str(tmp_path / "lake" / "bronze" / "preference_records"))
    assert bronze.height == 30 and set(bronze["source"]) == {"rl_rollouts"}
    assert set(bronze["id"]) == {f"rl:g{i}" for i in range(30)}
    silver = pl.read_delta(str(tmp_path / "lake" / "silver" / "preference_pairs"))
    rejected = pl.read_delta(str(tmp_path / "lake" / "silver" / "rejects")).filter(
        pl.col("source") == "rl_rollouts"
    )
    assert silver.height + rejected.height == 30 and silver.height > 0
    assert pl.read_delta(str(tmp_path / "lake" / "bronze" / "records")).is_empty(), (
        "not read as sft records"
    )
