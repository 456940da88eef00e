"""Successive halving over short torchrun trials: what ``training/hparam_search`` runs.

No Dagster here: the asset passes a ``launch`` function (torchrun through the launcher resource)
and receives each result as it comes, so the search can also be driven from a test or a notebook.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline_assets.lib.training.search import rung_steps, survivors
from pipeline_assets.lib.uris import join
from pipeline_assets.trainer.config import TrainConfig


@dataclass(frozen=True)
class TrialResult:
    trial: int
    rung: int
    steps: int
    search_loss: float  # on gold's search split; NaN when the trial failed
    hyperparameters: dict
    continued: bool = False  # survived this rung (set once the rung is judged)


@dataclass
class SearchOutcome:
    results: list[TrialResult] = field(default_factory=list)
    steps_trained: int = 0
    full_grid_steps: int = 0
    best_trial: int | None = None
    best_hyperparameters: dict = field(default_factory=dict)
    best_search_loss: float = math.nan


def trial_config(
    base: TrainConfig,
    search_root: str,
    trial: int,
    hyperparameters: dict,
    steps: int,
    max_steps: int,
) -> TrainConfig:
    """A trial: its own checkpoint folder, scored on the search split (never the promotion gate's
    validation rows) and saved at the end of each rung, on the longest schedule."""
    warmup_steps = min(hyperparameters.get("warmup_steps", base.warmup_steps), max_steps)
    return dataclasses.replace(
        base,
        **{**hyperparameters, "warmup_steps": warmup_steps},
        eval_split="search",
        checkpoint_uri=search_root,
        partition=f"trial-{trial}",
        steps=steps,
        schedule_steps=max_steps,
        eval_every=steps,
        checkpoint_every_steps=steps,
        log_every=max(1, steps // 5),
    )


def successive_halving(
    base: TrainConfig,
    configurations: list[dict],
    *,
    min_steps: int,
    max_steps: int,
    eta: int,
    launch: Callable[[TrainConfig, int], float],
    on_result: Callable[[TrialResult], None] = lambda result: None,
) -> SearchOutcome:
    """Train every configuration ``min_steps``, keep the best 1/eta, train those eta times longer
    (continuing from their checkpoints), until ``max_steps``. ``launch(config, trial)`` trains one
    trial up to ``config.steps`` and returns its loss on the search split (NaN on failure)."""
    search_root = join(base.checkpoint_uri, base.partition, "search")
    rungs = rung_steps(min_steps, max_steps, eta)
    outcome = SearchOutcome(full_grid_steps=len(configurations) * max_steps)
    alive, reached = list(range(len(configurations))), dict.fromkeys(range(len(configurations)), 0)
    for rung, steps in enumerate(rungs):
        losses = {}
        for trial in alive:
            config = trial_config(base, search_root, trial, configurations[trial], steps, max_steps)
            losses[trial] = launch(config, trial)
            outcome.steps_trained += steps - reached[trial]
            reached[trial] = steps
        kept = survivors(losses, eta) if rung < len(rungs) - 1 else []
        for trial in alive:
            result = TrialResult(
                trial, rung, steps, losses[trial], configurations[trial], continued=trial in kept
            )
            outcome.results.append(result)
            on_result(result)
        if rung == len(rungs) - 1:
            finite = {t: loss for t, loss in losses.items() if math.isfinite(loss)}
            if finite:
                outcome.best_trial = min(finite, key=lambda t: (finite[t], t))
                outcome.best_hyperparameters = configurations[outcome.best_trial]
                outcome.best_search_loss = finite[outcome.best_trial]
        alive = kept
    return outcome
