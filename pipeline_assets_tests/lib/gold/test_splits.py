import polars as pl
import pytest

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
