"""Silver's block stages: the batch cut into blocks gives exactly the batch judged whole."""

from __future__ import annotations

import random
from functools import partial

import polars as pl

from pipeline_assets.lib.decontam import EvalNgramIndex
from pipeline_assets.lib.silver import SilverConfig, curate
from pipeline_assets.lib.stages import from_row, run_in_process, run_stages, to_row
from pipeline_assets_tests.lib.test_dedup import WORDS, _edited

EVAL_ANSWER = " ".join(f"benchmark{i}" for i in range(20))


def _bronze(n: int = 120, seed: int = 5) -> pl.DataFrame:
    rng = random.Random(seed)
    responses = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))) for _ in range(n)]
    responses[10] = responses[3]  # an exact duplicate
    responses[20] = _edited(responses[4], rng)  # a near duplicate
    responses[30] = f"As the benchmark says: {EVAL_ANSWER}."  # contaminated
    responses[40] = "ok"  # too short for the quality gate
    prompts = [f"Question {i}:  explain\u00a0this." for i in range(n)]
    prompts[10] = prompts[3]
    return pl.DataFrame({
        "record_id": [f"r{i:05d}" for i in range(n)],
        "batch_id": "b1",
        "source": "synth",
        "system": None,
        "prompt": prompts,
        "response": responses,
    }, schema_overrides={"system": pl.String})


def _eval_index() -> EvalNgramIndex:
    return EvalNgramIndex.build(pl.DataFrame({"eval_set": ["bench"], "item_id": ["1"], "prompt": ["What?"], "response": [EVAL_ANSWER]}))


def test_blocks_of_any_size_give_the_batch_judged_whole():
    bronze, index, config = _bronze(), _eval_index(), SilverConfig()
    whole = curate(bronze, None, index, config, partial(run_in_process, rows_per_block=bronze.height))
    blocked = curate(bronze, None, index, config, partial(run_in_process, rows_per_block=7))
    assert whole.kept.height + whole.rejects.height == bronze.height
    assert set(whole.rejects["stage"]) >= {"exact_dup", "near_dup", "decontaminated"}
    assert any(stage.startswith("quality:") for stage in whole.rejects["stage"])
    assert blocked.kept.equals(whole.kept) and blocked.rejects.equals(whole.rejects) and blocked.index.equals(whole.index)
    for stage in ("normalize", "decontaminate", "quality"):
        assert {k: v for k, v in blocked.stages[stage].items() if k != "seconds"} == \
            {k: v for k, v in whole.stages[stage].items() if k != "seconds"}, stage


def test_a_block_result_crosses_a_process_boundary_as_one_row():
    from pipeline_assets.lib.silver import after_dedup

    block = _bronze().with_columns(exact_hash=pl.lit("h"), cluster_id=pl.col("record_id"))
    result = run_stages(after_dedup(SilverConfig(), _eval_index()), block)
    back = from_row(to_row(result))
    assert back.kept.equals(result.kept) and back.counters == result.counters
    assert back.removed.keys() == result.removed.keys()
    assert all(back.removed[name].equals(frame) for name, frame in result.removed.items())
