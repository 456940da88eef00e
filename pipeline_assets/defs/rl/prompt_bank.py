"""rl/prompt_bank: the RL overlay's prompts, each with its verifier and ground truth, curated by the
batch path's own decontamination and quality stages (lib.rl.prompt_bank), and its blocking
checks."""

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetExecutionContext,
    MaterializeResult,
    asset,
    asset_check,
)

from pipeline_assets.contracts import PromptBankRow, conform, polars_schema, validate
from pipeline_assets.defs.keys import REFERENCE_EVAL_SETS, RL_PROMPT_BANK, SILVER_RECORDS
from pipeline_assets.defs.metadata import Stopwatch, delta_write_metadata, table_metadata
from pipeline_assets.defs.policies import SilverPolicy
from pipeline_assets.defs.retries import refusal
from pipeline_assets.defs.rl.policy import RlPolicy
from pipeline_assets.lib.rl.prompt_bank import (
    IN_BANK,
    as_records,
    checkable_silver,
    curate_bank,
    generated_tasks,
)
from pipeline_assets.lib.rl.verifiers import ground_truth_passes
from pipeline_assets.lib.silver.decontam import EvalNgramIndex, find_contamination
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource

_SHOWN = 20  # rows a failed check names


@asset(
    key=RL_PROMPT_BANK,
    group_name="rl",
    deps=[SILVER_RECORDS, REFERENCE_EVAL_SETS],
    kinds={"delta", "polars"},
    description="Prompts whose answer a rule checks, each naming its verifier (exact_match, "
    "int_equal, regex:<pattern>) and ground truth: silver records answered by a bare integer, and "
    "PIPELINE_RL_BANK_TASKS seeded tasks (reverse, sort, add), held out by a hash of the prompt. "
    "Every candidate is a row: in the bank, or removed by the batch path's decontamination or "
    "quality stage, with its evidence. Like the whole RL overlay, materialized by hand (or "
    "selected explicitly), never by automation.",
)
def rl_prompt_bank(
    context: AssetExecutionContext,
    lake: LakeResource,
    eval_sets: EvalSetsResource,
    silver_policy: SilverPolicy,
    rl_policy: RlPolicy,
) -> MaterializeResult:
    stopwatch = Stopwatch()
    silver_version = lake.version(*SILVER_RECORDS.path)
    candidates = [
        generated_tasks(rl_policy.bank_tasks, rl_policy.bank_seed, rl_policy.held_out_fraction)
    ]
    if silver_version is not None:  # only the records answered by an integer leave the lake
        scan = lake.scan(*SILVER_RECORDS.path, version=silver_version).select(
            "prompt", "response", "source"
        )
        candidates.append(checkable_silver(scan, rl_policy.held_out_fraction).collect())
    eval_files = eval_sets.files()
    index = EvalNgramIndex.build(eval_sets.items(eval_files), silver_policy.decontam_config())
    bank = curate_bank(
        pl.concat(candidates, how="diagonal_relaxed"), index, silver_policy.silver_config()
    )
    bank = validate(conform(bank, PromptBankRow), PromptBankRow)
    commit = lake.overwrite(*RL_PROMPT_BANK.path, bank)
    kept = bank.filter(pl.col("status") == IN_BANK)
    context.log.info(
        f"rl/prompt_bank: {kept.height} of {bank.height} candidates in the bank "
        f"({(kept['split'] == 'held_out').sum()} held out)"
    )
    return MaterializeResult(
        metadata={
            **delta_write_metadata(
                commit,
                polars_schema(PromptBankRow),
                upstream_versions={
                    "silver/records": silver_version,
                    "reference/eval_sets": eval_sets.fingerprint(eval_files),
                },
                input_bytes=int(bank.estimated_size()),
                stopwatch=stopwatch,
            ),
            "prompts_in_bank": kept.height,
            "held_out_prompts": int((kept["split"] == "held_out").sum()),
            "candidates_by_status": table_metadata(
                bank.group_by("status").len("rows").sort("status")
            ),
            "prompts_by_task": table_metadata(
                kept.group_by("source", "task", "split").len("rows").sort("source", "task")
            ),
        }
    )


def _in_bank(lake: LakeResource) -> pl.DataFrame:
    bank = lake.read(*RL_PROMPT_BANK.path)
    if bank is None:
        raise refusal("rl/prompt_bank does not exist yet: materialize it first")
    return bank.filter(pl.col("status") == IN_BANK)


@asset_check(
    asset=RL_PROMPT_BANK,
    name="verifiable",
    blocking=True,
    description="Every prompt's ground truth passes its own verifier: a prompt no answer can pass "
    "would only ever teach the policy that every answer is wrong.",
)
def prompt_bank_verifiable(
    context: AssetCheckExecutionContext, lake: LakeResource
) -> AssetCheckResult:
    bank = _in_bank(lake)
    failing = bank.filter(
        ~pl.struct("verifier", "ground_truth").map_elements(
            lambda row: ground_truth_passes(row["verifier"], row["ground_truth"]),
            return_dtype=pl.Boolean,
        )
    )
    return AssetCheckResult(
        passed=failing.is_empty(),
        description=(
            f"{failing.height} prompt(s) whose ground truth fails its own verifier, e.g. "
            + "; ".join(
                f"{r['prompt']!r} ({r['verifier']}: {r['ground_truth']!r})"
                for r in failing.head(3).iter_rows(named=True)
            )
        )
        if failing.height
        else f"all {bank.height} ground truths pass their verifiers",
        metadata={"prompts": bank.height, "failing": table_metadata(failing.head(_SHOWN))},
    )


@asset_check(
    asset=RL_PROMPT_BANK,
    name="no_eval_overlap",
    blocking=True,
    description="No prompt or ground truth in the bank contains an eval-set item (the eval sets as "
    "they are now: a benchmark added after the bank was built is caught here).",
)
def prompt_bank_no_eval_overlap(
    context: AssetCheckExecutionContext,
    lake: LakeResource,
    eval_sets: EvalSetsResource,
    silver_policy: SilverPolicy,
) -> AssetCheckResult:
    bank = _in_bank(lake)
    index = EvalNgramIndex.build(
        eval_sets.items(eval_sets.files()), silver_policy.decontam_config()
    )
    _, overlapping, _ = find_contamination(as_records(bank), index)
    return AssetCheckResult(
        passed=overlapping.is_empty(),
        description=(
            f"{overlapping.height} prompt(s) overlap an eval set, e.g. "
            + "; ".join(
                f"{r['prompt']!r} ~ {r['eval_set']}/{r['eval_item_id']}"
                for r in overlapping.head(3).iter_rows(named=True)
            )
            + ": materialize rl/prompt_bank again to remove them"
        )
        if overlapping.height
        else f"none of {bank.height} prompts overlaps the eval sets",
        metadata={
            "prompts": bank.height,
            "overlapping": table_metadata(
                overlapping.select("record_id", "prompt", "eval_set", "eval_item_id").head(_SHOWN)
            ),
        },
    )


prompt_bank_checks = [prompt_bank_verifiable, prompt_bank_no_eval_overlap]
