"""The RL task generator: right answers that pass their own verifiers, determinism, an even mix of
tasks, distinct prompts, and a held-out side that follows the prompt, not the seed."""

from __future__ import annotations

import polars as pl
import pytest

from pipeline_assets.lib.rl.tasks import (
    COLUMNS,
    HELD_OUT,
    TASK_SPACE_SIZE,
    TRAIN,
    VERIFIER_OF_TASK,
    generate_tasks,
    task_names,
)
from pipeline_assets.lib.rl.verifiers import ground_truth_passes, verify


@pytest.fixture(scope="module")
def tasks() -> pl.DataFrame:
    return generate_tasks(10_000, seed=7)


def solve(prompt: str) -> str:
    """The answer worked out from the prompt alone, independently of the generator."""
    task, _, question = prompt.partition(": ")
    if task == "reverse":
        return question[::-1]
    if task == "sort":
        return " ".join(sorted(question.split(), key=int))
    left, right = question.split(" + ")
    return str(int(left) + int(right))


def test_every_ground_truth_is_the_answer_and_passes_its_own_verifier(tasks):
    assert tasks.columns == list(COLUMNS)
    assert tasks.height == 10_000
    for row in tasks.iter_rows(named=True):
        assert row["ground_truth"] == solve(row["prompt"]), row
        assert row["verifier"] == VERIFIER_OF_TASK[row["task"]]
        assert ground_truth_passes(row["verifier"], row["ground_truth"]), row
        assert (
            verify(row["verifier"], row["ground_truth"], "1" + row["ground_truth"]).reward == 0.0
        ), row


def test_prompts_are_short_and_regular(tasks):
    patterns = {
        "reverse": r"reverse: [a-z]( [a-z]){2,4}",
        "sort": r"sort: [0-9]( [0-9]){2,4}",
        "add": r"add: [0-9]{1,2} \+ [0-9]{1,2}",
    }
    for task, pattern in patterns.items():
        prompts = tasks.filter(pl.col("task") == task)["prompt"]
        assert prompts.str.contains(f"^{pattern}$").all(), task
    numbers = (
        tasks.filter(pl.col("task") == "add")["prompt"]
        .str.extract_all("[0-9]+")
        .explode()
        .cast(pl.Int64)
    )
    assert numbers.min() == 0 and numbers.max() == 20


def test_the_same_seed_gives_the_same_frame_and_another_seed_another():
    assert generate_tasks(500, seed=1).equals(generate_tasks(500, seed=1))
    assert not generate_tasks(500, seed=1).equals(generate_tasks(500, seed=2))


def test_prompts_are_distinct_and_their_ids_are_a_hash_of_the_text(tasks):
    assert tasks["prompt"].n_unique() == tasks.height
    assert tasks["prompt_id"].n_unique() == tasks.height
    assert tasks["prompt_id"].str.contains("^[0-9a-f]{32}$").all()


def test_tasks_are_mixed_evenly_and_lengths_too():
    mix = generate_tasks(1200, seed=0)
    assert mix["task"].value_counts().sort("task").rows() == [
        ("add", 400),
        ("reverse", 400),
        ("sort", 400),
    ]
    words = (
        mix.filter(pl.col("task") == "reverse")["ground_truth"]
        .str.replace_all(" ", "")
        .str.len_chars()
    )
    assert words.value_counts().sort("ground_truth").rows() == [(3, 134), (4, 133), (5, 133)]
    assert mix.head(30)["task"].n_unique() == 3, "the order is shuffled, not task by task"


def test_a_task_with_too_few_prompts_gives_all_it_has_and_the_others_the_rest():
    mix = generate_tasks(2000, seed=0)
    assert dict(mix["task"].value_counts().rows()) == {"add": 441, "reverse": 780, "sort": 779}
    assert mix.height == mix["prompt"].n_unique() == 2000


def test_more_tasks_than_distinct_prompts_is_refused_naming_the_limit():
    limit = f"asked for {TASK_SPACE_SIZE + 1} tasks; n must be between 0 and {TASK_SPACE_SIZE}"
    with pytest.raises(ValueError, match=limit):
        generate_tasks(TASK_SPACE_SIZE + 1, seed=0)
    with pytest.raises(ValueError, match="asked for -1 tasks"):
        generate_tasks(-1, seed=0)
    assert generate_tasks(0, seed=0).columns == list(COLUMNS)


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_the_held_out_share_is_the_fraction_asked_for(fraction):
    split = generate_tasks(5000, seed=3, held_out_fraction=fraction)["split"]
    assert set(split) == {TRAIN, HELD_OUT}
    assert (split == HELD_OUT).mean() == pytest.approx(fraction, abs=0.05)
    assert (generate_tasks(300, seed=3, held_out_fraction=0.0)["split"] == TRAIN).all()


def test_a_held_out_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="held-out fraction"):
        generate_tasks(10, seed=0, held_out_fraction=1.0)


def test_a_prompt_lands_on_the_same_side_with_the_same_id_under_every_seed():
    first, second = generate_tasks(3000, seed=11), generate_tasks(3000, seed=12)
    both = first.join(second, on="prompt", suffix="_again")
    assert both.height >= 441, "every addition is in both banks"
    assert (both["split"] == both["split_again"]).all()
    assert (both["prompt_id"] == both["prompt_id_again"]).all()
    assert set(both["split"]) == {TRAIN, HELD_OUT}


def test_task_names():
    assert task_names() == ("reverse", "sort", "add")
