"""A deterministic generator of verifiable tasks small enough for a ~1M-parameter transformer
trained on CPU in a few minutes to learn with GRPO: the RL overlay's prompt bank in a test or a
demo.

Three tasks, with short, regular prompts and one right answer each:

- ``reverse``: "reverse: a b c d" -> "d c b a", 3 to 5 lowercase letters, spaced as ``sort``'s
  digits are (a byte-level BPE merges letter pairs; a tiny model then cannot see the letters it must
  reverse); checked by ``exact_match``;
- ``sort``: "sort: 3 1 2" -> "1 2 3", 3 to 5 single digits, repeats allowed; checked by
  ``exact_match``;
- ``add``: "add: 7 + 12" -> "19", both numbers 0..20; checked by ``int_equal``.

``generate_tasks(n, seed)`` returns exactly ``n`` distinct prompts (counted after deduplication:
they are drawn without replacement, so none repeats). The tasks share ``n`` evenly, and within a
task its lengths share the task's part evenly, except that a space with fewer prompts than its share
gives all it has and the rest goes to the others: ``add`` has 441 prompts, so 2,000 tasks hold 441
additions. Asking for more than ``TASK_SPACE_SIZE`` prompts raises ValueError.

A prompt's ``split`` (train / held_out) is a threshold on xxh3 of its text
(``splits.assign_split``), never on the seed, so a prompt is on the same side in every bank
generated.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from string import ascii_lowercase

import polars as pl

from pipeline_assets.lib.gold.splits import VALIDATION, assign_split
from pipeline_assets.lib.silver.dedup import hash_of

TRAIN, HELD_OUT = "train", "held_out"
VERIFIER_OF_TASK = {"reverse": "exact_match", "sort": "exact_match", "add": "int_equal"}
ADD_MAX = 20
COLUMNS = ("prompt_id", "task", "prompt", "ground_truth", "verifier", "split")
_SPLIT_SALT = "rl-tasks-v1"


@dataclass(frozen=True)
class _Space:
    """Every prompt of one task and length, numbered 0 .. size - 1."""

    task: str
    size: int
    build: Callable[[int], tuple[str, str]]  # number -> (prompt, ground truth)


def _reverse(length: int) -> _Space:
    def build(number: int) -> tuple[str, str]:
        word = "".join(ascii_lowercase[number // 26**place % 26] for place in range(length))
        return f"reverse: {' '.join(word)}", " ".join(reversed(word))

    return _Space("reverse", 26**length, build)


def _sort(length: int) -> _Space:
    def build(number: int) -> tuple[str, str]:
        digits = f"{number:0{length}d}"
        return f"sort: {' '.join(digits)}", " ".join(sorted(digits))

    return _Space("sort", 10**length, build)


def _add(number: int) -> tuple[str, str]:
    left, right = divmod(number, ADD_MAX + 1)
    return f"add: {left} + {right}", str(left + right)


_SPACES = (
    *map(_reverse, (3, 4, 5)),
    *map(_sort, (3, 4, 5)),
    _Space("add", (ADD_MAX + 1) ** 2, _add),
)
TASK_SPACE_SIZE = sum(space.size for space in _SPACES)


def task_names() -> tuple[str, ...]:
    """("reverse", "sort", "add")."""
    return tuple(VERIFIER_OF_TASK)


def generate_tasks(n: int, seed: int, held_out_fraction: float = 0.2) -> pl.DataFrame:
    """``n`` distinct tasks in a seeded shuffled order, columns ``COLUMNS``; the same arguments give
    an identical frame."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {held_out_fraction}")
    rng = random.Random(seed)
    rows = [
        (space.task, *space.build(number))
        for space, count in _space_counts(n)
        for number in rng.sample(range(space.size), count)
    ]
    rng.shuffle(rows)
    tasks = pl.DataFrame(
        rows,
        schema={"task": pl.String, "prompt": pl.String, "ground_truth": pl.String},
        orient="row",
    )
    tasks = tasks.with_columns(
        prompt_id=hash_of("prompt"), verifier=pl.col("task").replace_strict(VERIFIER_OF_TASK)
    )
    split = assign_split(tasks, held_out_fraction, salt=_SPLIT_SALT, key="prompt")["split"]
    return tasks.with_columns(split=split.replace({VALIDATION: HELD_OUT})).select(COLUMNS)


def _space_counts(n: int) -> list[tuple[_Space, int]]:
    """Each of ``_SPACES`` with how many prompts it gives: the tasks share ``n`` evenly, then a
    task's lengths share its part."""
    if not 0 <= n <= TASK_SPACE_SIZE:
        raise ValueError(
            f"asked for {n} tasks; n must be between 0 and {TASK_SPACE_SIZE}, "
            "the number of distinct prompts"
        )
    by_task = [[space for space in _SPACES if space.task == task] for task in task_names()]
    task_counts = _even_shares(n, [sum(space.size for space in spaces) for spaces in by_task])
    return [
        (space, count)
        for spaces, task_count in zip(by_task, task_counts, strict=True)
        for space, count in zip(
            spaces, _even_shares(task_count, [space.size for space in spaces]), strict=True
        )
    ]


def _even_shares(total: int, capacities: list[int]) -> list[int]:
    """``total`` split as evenly as ``capacities`` allow: a full one's excess goes to the others,
    and a remainder to the first ones. ``total`` must not exceed the capacities' sum."""
    shares = [0] * len(capacities)
    while left := total - sum(shares):
        room = [i for i, capacity in enumerate(capacities) if shares[i] < capacity]
        each, extra = divmod(left, len(room))
        for rank, i in enumerate(room):
            shares[i] += min(capacities[i] - shares[i], each + (rank < extra))
    return shares
