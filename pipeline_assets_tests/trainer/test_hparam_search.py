"""Successive halving with real torchrun trials on a small problem: fewer steps than the full grid,
and the same best configuration as training every configuration to the end."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from pipeline_assets.trainer.data import read_snapshot
from pipeline_assets.trainer.search_driver import successive_halving
from pipeline_assets.trainer.storage import CheckpointStore
from pipeline_assets_tests.trainer.launch import Job, tiny_config
from pipeline_assets_tests.trainer.synthetic import write_synthetic_gold

MIN_STEPS, MAX_STEPS, ETA = 5, 15, 3
CONFIGURATIONS = [{"lr": 1e-5}, {"lr": 3e-3}, {"lr": 1e-4}]


def _launcher(workspace: Path, trained: list, search_rows: int):
    def launch(config, trial: int) -> float:
        job = Job(config, workspace / f"{config.partition}-{config.steps}.log", nproc=1)
        if job.wait(180) != 0:
            return math.nan
        trained.append((trial, config.steps))
        export, _ = CheckpointStore(
            config.checkpoint_uri, config.partition, config.scratch_dir
        ).fetch_verified("final")
        about = json.loads((export / "pipeline.json").read_text())
        # A trial is judged on the search rows, never on the validation rows the promotion
        # gate uses.
        assert about["eval_split"] == "search" and about["eval_sequences"] == search_rows > 0
        assert "validation_loss" not in about
        return about["search_loss"]

    return launch


def test_successive_halving_stops_bad_trials_early_and_finds_the_full_grids_best(tmp_path):
    version = write_synthetic_gold(str(tmp_path / "lake"), n_records=400, seq_len=64)
    base = tiny_config(
        str(tmp_path / "lake"), version, str(tmp_path / "checkpoints"), warmup_steps=2, eval_every=5
    )
    search_rows = len(read_snapshot(str(tmp_path / "lake"), version).search)
    trained: list = []
    outcome = successive_halving(
        base,
        CONFIGURATIONS,
        min_steps=MIN_STEPS,
        max_steps=MAX_STEPS,
        eta=ETA,
        launch=_launcher(tmp_path, trained, search_rows),
    )

    assert outcome.steps_trained == 3 * 5 + 1 * 10 < outcome.full_grid_steps == 3 * 15
    stopped_first = {r.trial for r in outcome.results if r.rung == 0 and not r.continued}
    assert len(stopped_first) == 2 and all(
        steps == MIN_STEPS for trial, steps in trained if trial in stopped_first
    )

    # The full grid: the stopped configurations trained to the end too (the survivor's full run is
    # the search's own, since continuing from a checkpoint equals training straight through:
    # test_torchrun shows it bit for bit).
    full_grid = {outcome.best_trial: outcome.best_search_loss}
    for trial in stopped_first:
        config = dataclasses.replace(
            base,
            **CONFIGURATIONS[trial],
            checkpoint_uri=str(tmp_path / "grid"),
            partition=f"c{trial}",
            steps=MAX_STEPS,
            eval_every=MAX_STEPS,
            eval_split="search",
        )
        full_grid[trial] = _launcher(tmp_path, [], search_rows)(config, trial)
    assert outcome.best_trial == min(full_grid, key=full_grid.get) == 1


def test_every_configuration_of_the_default_grid_makes_a_trial(tmp_path):
    """The default space includes ``warmup_steps``: a trial takes it, capped at the schedule."""
    from pipeline_assets.defs.training.policy import HparamSearchPolicy
    from pipeline_assets.lib.training.search import grid
    from pipeline_assets.trainer.search_driver import trial_config

    base = tiny_config(str(tmp_path / "lake"), 0, str(tmp_path / "checkpoints"))
    space = HparamSearchPolicy().space
    assert "warmup_steps" in space
    for number, configuration in enumerate(grid(space)):
        config = trial_config(base, str(tmp_path / "search"), number, configuration, 5, 12)
        assert config.warmup_steps == min(configuration["warmup_steps"], 12)
        assert config.lr == configuration["lr"] and config.partition == f"trial-{number}"
