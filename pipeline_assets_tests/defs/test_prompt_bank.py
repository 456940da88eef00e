"""rl/prompt_bank and its blocking checks, materialized with the project's resources: generated
tasks and silver records answered by an integer become prompts with a verifier; an eval item is
removed by the batch path's decontamination stage with its evidence; a benchmark added after the
bank was built fails the no_eval_overlap check by name; a ground truth its verifier refuses fails
the verifiable check."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import polars as pl
from dagster import AssetSelection, materialize

from pipeline_assets.contracts import PromptBankRow, conform
from pipeline_assets.defs.keys import RL_PROMPT_BANK
from pipeline_assets.defs.rl.policy import RlPolicy
from pipeline_assets.defs.rl.prompt_bank import prompt_bank_checks, rl_prompt_bank
from pipeline_assets.lib.rl.tasks import generate_tasks

TASKS = 300
POLICY = RlPolicy(bank_tasks=TASKS, bank_seed=7)


def _eval_item(folder, name: str, prompt: str, response: str = "an answer") -> None:
    with (folder / f"{name}.jsonl").open("w") as out:
        out.write(
            json.dumps({"eval_set": name, "item_id": "1", "prompt": prompt, "response": response})
            + "\n"
        )


def _silver_with_integer_answers(lake) -> None:
    now = datetime.now(timezone.utc)
    rows = [
        {
            "record_id": f"{i:032x}",
            "prompt": prompt,
            "response": response,
            "source": "trivia",
            "batch_id": "b1",
        }
        for i, (prompt, response) in enumerate(
            [
                ("How many moons circle the red planet in our solar system today?", "2"),
                (
                    "Explain how a hash map resolves collisions in a few sentences.",
                    "By chaining buckets of entries.",
                ),
            ]
        )
    ]
    lake.overwrite("silver", "records", pl.DataFrame(rows).with_columns(ingested_at=pl.lit(now)))


def _run(resources, instance, checks_only: bool = False):
    """The bank and its checks, or its checks alone on the bank as written."""
    return materialize(
        [rl_prompt_bank, *prompt_bank_checks],
        instance=instance,
        raise_on_error=False,
        resources={**resources, "rl_policy": POLICY},
        selection=AssetSelection.checks_for_assets(RL_PROMPT_BANK) if checks_only else None,
    )


def _check(result, name: str):
    [evaluation] = [e for e in result.get_asset_check_evaluations() if e.check_name == name]
    return evaluation


def test_the_bank_holds_checkable_prompts_and_removes_an_eval_item_with_evidence(
    resources, instance, lake, eval_sets_dir
):
    tasks = generate_tasks(TASKS, seed=7)
    contaminated = tasks["prompt"][5]
    _eval_item(eval_sets_dir, "arith", contaminated)
    _silver_with_integer_answers(lake)

    result = _run(resources, instance)

    assert result.success
    bank = lake.read("rl", "prompt_bank")
    kept = bank.filter(pl.col("status") == "in_bank")
    assert bank.height == TASKS + 1, (
        "every generated task and the one silver record answered by an integer"
    )
    assert bank.filter(pl.col("prompt") == contaminated)["status"].to_list() == ["decontaminated"]
    assert (
        json.loads(bank.filter(pl.col("prompt") == contaminated)["evidence"][0])["eval_set"]
        == "arith"
    )
    silver = bank.filter(pl.col("source") == "trivia")
    assert silver["verifier"].to_list() == ["int_equal"] and silver["ground_truth"].to_list() == [
        "2"
    ]
    assert silver["status"].to_list() == ["quality:min_words"], (
        "judged like silver judged it: one word is too few"
    )
    assert set(kept["task"]) == {"reverse", "sort", "add"} and kept.height == TASKS - 1
    assert 0.1 < (kept["split"] == "held_out").mean() < 0.3
    assert _check(result, "verifiable").passed and _check(result, "no_eval_overlap").passed
    metadata = result.asset_materializations_for_node("rl__prompt_bank")[0].metadata
    assert metadata["prompts_in_bank"].value == kept.height

    late_item = next(prompt for prompt in kept["prompt"] if prompt != contaminated)
    _eval_item(
        eval_sets_dir, "late", late_item
    )  # a benchmark that arrived after the bank was built
    stale = _check(_run(resources, instance, checks_only=True), "no_eval_overlap")
    assert (
        not stale.passed and repr(late_item) in stale.description and "late/1" in stale.description
    )
    rebuilt = _run(resources, instance)
    assert rebuilt.success and _check(rebuilt, "no_eval_overlap").passed, (
        "materializing the bank again removes it"
    )


def test_the_checks_fail_on_a_bank_they_must_refuse(resources, instance, lake, eval_sets_dir):
    tasks = generate_tasks(20, seed=1).with_columns(
        source=pl.lit("rl_tasks"), status=pl.lit("in_bank"), evidence=pl.lit(None, pl.String)
    )
    broken = tasks.with_columns(
        ground_truth=pl.when(pl.int_range(pl.len()) == 0)
        .then(pl.lit(" x "))
        .otherwise("ground_truth")
    )
    lake.overwrite(
        "rl",
        "prompt_bank",
        conform(broken.select(*PromptBankRow.to_schema().columns), PromptBankRow),
    )
    _eval_item(eval_sets_dir, "late", tasks["prompt"][3])

    checked = _run(resources, instance, checks_only=True)

    verifiable, overlap = _check(checked, "verifiable"), _check(checked, "no_eval_overlap")
    assert (
        not verifiable.passed
        and "1 prompt(s) whose ground truth fails its own verifier" in verifiable.description
    )
    assert (
        not overlap.passed
        and repr(tasks["prompt"][3]) in overlap.description
        and "late/1" in overlap.description
    )
