"""The stage runner: every stage's rows in, kept, rejected and seconds are derived from its frames,
its removed rows carry its reject reason, and a stage that loses a row fails."""

from __future__ import annotations

import polars as pl
import pytest

from pipeline_assets.lib.stages import (
    Stage,
    StageAccountingError,
    from_row,
    run_in_process,
    run_stages,
    to_row,
)


def _records(n: int) -> pl.DataFrame:
    return pl.DataFrame({"record_id": [f"r{i}" for i in range(n)], "words": list(range(n))})


def _drop_short(block: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Reports only its own detail, as a stage function does."""
    short = pl.col("words") < 3
    removed = block.filter(short).with_columns(evidence=pl.format("{} words", "words"))
    return block.filter(~short), removed, {"words_removed": int(removed["words"].sum())}


def _lose_a_row(block: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    return block.slice(1), block.clear(), {}


def test_the_runner_derives_every_count_and_stamps_the_reject_reason():
    doubled = Stage("double", lambda block: (block.with_columns(pl.col("words") * 2), None, {}))
    stages = [doubled, Stage("drop_short", _drop_short, "too_short")]
    result = run_stages(stages, _records(5))

    counters = result.counters
    assert counters["double"].pop("seconds") >= 0 and counters["drop_short"].pop("seconds") >= 0
    assert counters == {
        "double": {"rows_in": 5, "kept": 5, "rejected": 0},
        "drop_short": {"rows_in": 5, "kept": 3, "rejected": 2, "words_removed": 2},
    }
    assert result.kept["words"].to_list() == [4, 6, 8]
    removed = result.removed["drop_short"]
    assert removed.columns == ["record_id", "words", "stage", "evidence"]
    assert removed.select("record_id", "stage").rows() == [("r0", "too_short"), ("r1", "too_short")]
    assert "double" not in result.removed


def test_blocks_sum_the_derived_counts_and_cross_a_process_boundary():
    stages = [Stage("drop_short", _drop_short, "too_short")]
    blocked = run_in_process(stages, _records(7), rows_per_block=2)
    assert {k: v for k, v in blocked.counters["drop_short"].items() if k != "seconds"} == {
        "rows_in": 7,
        "kept": 4,
        "rejected": 3,
        "words_removed": 3,
    }
    back = from_row(to_row(blocked))
    assert back.counters == blocked.counters and back.removed["drop_short"].equals(
        blocked.removed["drop_short"]
    )


def test_a_stage_that_loses_a_row_fails_naming_the_stage():
    stages = [Stage("leaky", _lose_a_row, "leaked")]
    with pytest.raises(StageAccountingError, match=r"stage 'leaky': 4 rows in, but 3 kept \+ 0"):
        run_stages(stages, _records(4))


def test_a_stage_keeps_to_its_shape():
    counting = Stage("counting", lambda block: (block, None, {"rows_in": block.height}))
    with pytest.raises(StageAccountingError, match="'counting' reports"):
        run_stages([counting], _records(2))
    unnamed = Stage("unnamed", _drop_short)
    with pytest.raises(StageAccountingError, match="'unnamed' removed 3 row"):
        run_stages([unnamed], _records(4))

    def stray(block: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
        return block.slice(1), block.head(1).with_columns(stage=pl.lit("other:x")), {}

    with pytest.raises(StageAccountingError, match="'stray' wrote stage values"):
        run_stages([Stage("stray", stray, "mine")], _records(2))
