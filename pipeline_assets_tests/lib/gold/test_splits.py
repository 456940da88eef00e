import polars as pl
import pytest

from pipeline_assets.lib.formats import CONVERSATION, PREFERENCE, SFT, TURNS
from pipeline_assets.lib.gold.sequences import gold_records
from pipeline_assets.lib.gold.splits import SEARCH, TRAIN, VALIDATION, assign_split


def frame(n: int, prefix: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "record_id": [f"{prefix}-{i:06d}" for i in range(n)],
            "exact_hash": [f"{i:032x}" for i in range(n)],
        }
    )


def test_the_split_follows_the_content_not_the_record_id():
    first, again = (
        assign_split(frame(5000, "20261121T053000Z"), 0.1),
        assign_split(frame(5000, "20261122T000000Z"), 0.1),
    )
    assert first["split"].to_list() == again["split"].to_list(), (
        "the same texts ingested another day split the same"
    )
    by_id = assign_split(frame(5000, "20261121T053000Z"), 0.1, key="record_id")
    assert by_id["split"].to_list() != first["split"].to_list()


def test_the_validation_share_is_the_fraction_asked_for():
    split = assign_split(frame(20_000, "x"), 0.05)["split"]
    assert set(split) == {TRAIN, VALIDATION}
    assert (split == VALIDATION).mean() == pytest.approx(0.05, abs=0.006)
    assert (assign_split(frame(1000, "x"), 0.0)["split"] == TRAIN).all()


def test_a_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="validation fraction"):
        assign_split(frame(10, "x"), 1.0)


def test_the_search_split_takes_only_training_records_and_leaves_validation_as_it_was():
    before = assign_split(frame(20_000, "x"), 0.05)["split"]
    after = assign_split(frame(20_000, "x"), 0.05, search_fraction=0.04)["split"]
    assert set(after) == {TRAIN, VALIDATION, SEARCH}
    assert ((before == VALIDATION) == (after == VALIDATION)).all(), "the gate's rows do not change"
    assert (before.filter(after == SEARCH) == TRAIN).all(), "search rows come from train only"
    assert (after == SEARCH).mean() == pytest.approx(0.04, abs=0.005)
    assert (after == VALIDATION).mean() == pytest.approx(0.05, abs=0.006)


def test_fractions_that_leave_no_training_records_are_refused():
    with pytest.raises(ValueError, match="search fraction"):
        assign_split(frame(10, "x"), 0.5, search_fraction=0.5)


def _conversation_variants(groups: int, variants: int) -> pl.DataFrame:
    """Silver conversations: ``variants`` of each first question, each with its own content (its
    own exact_hash) and the first question's prompt_hash."""
    rows = [
        {
            "record_id": f"c{g:03d}-{v}",
            "messages": [
                {"role": "user", "content": f"question {g}"},
                {"role": "assistant", "content": f"answer {g}.{v}"},
            ],
            "source": "chats",
            "exact_hash": f"{g:016x}{v:016x}",
            "prompt_hash": f"{g:032x}",
        }
        for g in range(groups)
        for v in range(variants)
    ]
    return pl.DataFrame(rows, schema_overrides={"messages": TURNS})


def test_variants_of_one_conversation_share_a_side_of_the_split():
    records = gold_records(_conversation_variants(400, 3), CONVERSATION, 0.2, 0.1)
    sides = records.group_by(pl.col("record_id").str.head(4)).agg(pl.col("split").n_unique())
    assert (sides["split"] == 1).all(), "every variant of a first question on one side"
    assert set(records["split"]) == {TRAIN, VALIDATION, SEARCH}
    by_content = assign_split(_conversation_variants(400, 3), 0.2, search_fraction=0.1)
    assert by_content["split"].to_list() != records["split"].to_list(), "the key is prompt_hash"
    assert records["whole_turns"].all()
    assert records["messages"][0].to_list() == _conversation_variants(1, 1)["messages"][0].to_list()


def test_sft_records_split_by_their_content_as_before_and_become_one_exchange():
    silver = frame(3000, "r").with_columns(
        system=pl.lit(None, pl.String),
        prompt=pl.format("prompt {}", "record_id"),
        response=pl.lit("answer"),
        source=pl.lit("logs"),
    )
    records = gold_records(silver, SFT, 0.1, 0.05)
    expected = assign_split(silver, 0.1, search_fraction=0.05)
    assert records["split"].to_list() == expected["split"].to_list()
    assert not records["whole_turns"].any()
    assert records["messages"][0].to_list() == [
        {"role": "user", "content": "prompt r-000000"},
        {"role": "assistant", "content": "answer"},
    ]


def test_a_format_with_a_loss_of_its_own_is_not_a_gold_record():
    with pytest.raises(ValueError, match="'preference' is not trained with sft's loss"):
        gold_records(frame(3, "p"), PREFERENCE, 0.1, 0.0)
