"""Successive halving with real torchrun trials on a small problem: fewer steps than the full grid,
and the same best configuration as training every configuration to the end."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from pipeline_assets.hparam_search import successive_halving, trial_config
from pipeline_assets.trainer.data import read_snapshot
from pipeline_assets.trainer.storage import CheckpointStore
from pipeline_assets_tests.trainer.launch import Job, run_job, tiny_config
from pipeline_assets_tests.trainer.synthetic import write_synthetic_gold

MIN_STEPS, MAX_STEPS, ETA = 5, 45, 3
CONFIGURATIONS = [{"lr": 1e-5}, {"lr": 3e-3}, {"lr": 1e-4}]


def _launcher(workspace: Path, trained: list):
    def launch(config, trial: int) -> float:
        job = Job(config, workspace / f"{config.partition}-{config.steps}.log", nproc=1)
        if job.wait(180) != 0:
            return math.nan
        trained.append((trial, config.steps))
        export, _ = CheckpointStore(config.checkpoint_uri, config.partition, config.scratch_dir).fetch_verified("final")
        return json.loads((export / "config.json").read_text())["search_loss"]

    return launch


def test_successive_halving_stops_bad_trials_early_and_finds_the_full_grids_best(tmp_path):
    version = write_synthetic_gold(str(tmp_path / "lake"), n_records=400, seq_len=64)
    base = tiny_config(str(tmp_path / "lake"), version, str(tmp_path / "checkpoints"), warmup_steps=2, eval_every=5)
    trained: list = []
    outcome = successive_halving(base, CONFIGURATIONS, min_steps=MIN_STEPS, max_steps=MAX_STEPS, eta=ETA,
                                 launch=_launcher(tmp_path, trained))

    assert outcome.steps_trained == 3 * 5 + 1 * 10 + 1 * 30 < outcome.full_grid_steps == 3 * 45
    stopped_first = {r.trial for r in outcome.results if r.rung == 0 and not r.continued}
    assert len(stopped_first) == 2 and all(steps == MIN_STEPS for trial, steps in trained if trial in stopped_first)

    # The full grid: the stopped configurations trained to the end too (the survivor's full run is the search's own,
    # since continuing from a checkpoint equals training straight through: test_torchrun shows it bit for bit).
    full_grid = {outcome.best_trial: outcome.best_search_loss}
    for trial in stopped_first:
        config = dataclasses.replace(base, **CONFIGURATIONS[trial], checkpoint_uri=str(tmp_path / "grid"),
                                     partition=f"c{trial}", steps=MAX_STEPS, eval_every=MAX_STEPS, eval_split="search")
        full_grid[trial] = _launcher(tmp_path, [])(config, trial)
    assert outcome.best_trial == min(full_grid, key=full_grid.get) == 1


def test_a_trial_reports_its_loss_on_the_search_rows_not_the_gates_validation_rows(tmp_path):
    version = write_synthetic_gold(str(tmp_path / "lake"), n_records=200, seq_len=64)
    base = tiny_config(str(tmp_path / "lake"), version, str(tmp_path / "checkpoints"), warmup_steps=1)
    config = trial_config(base, str(tmp_path / "search"), 0, {"lr": 3e-3}, steps=2, max_steps=2)
    run_job(config, tmp_path / "trial.log", nproc=1)

    export, _ = CheckpointStore(config.checkpoint_uri, config.partition, config.scratch_dir).fetch_verified("final")
    about = json.loads((export / "config.json").read_text())
    search_rows = read_snapshot(str(tmp_path / "lake"), version).search
    assert about["eval_split"] == "search" and about["eval_sequences"] == len(search_rows) > 0
    assert math.isfinite(about["search_loss"]) and "validation_loss" not in about
