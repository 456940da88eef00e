import hashlib

import polars as pl
import pytest

from pipeline_assets.lib.gold.splits import TRAIN, assign_split
from pipeline_assets.lib.gold.tokenizer_sample import sample_for_tokenizer

VALIDATION_FRACTION, SEARCH_FRACTION = 0.3, 0.2  # half the records are not training records


def batch(name: str, n: int) -> pl.DataFrame:
    responses = [f"answer {i} of {name} " + "word " * (i % 37) for i in range(n)]
    return pl.DataFrame(
        {
            "record_id": [f"{name}-{i:05d}" for i in range(n)],
            "exact_hash": [
                hashlib.blake2b(text.encode(), digest_size=16).hexdigest() for text in responses
            ],
            "system": [None if i % 3 else "be brief" for i in range(n)],
            "prompt": [f"question {i}" for i in range(n)],
            "response": responses,
        }
    )


def sample(frame: pl.DataFrame, max_chars: int):
    return sample_for_tokenizer(frame.lazy(), max_chars, VALIDATION_FRACTION, SEARCH_FRACTION)


def chars(frame: pl.DataFrame) -> int:
    return sum(
        len(text or "") for column in ("system", "prompt", "response") for text in frame[column]
    )


def test_the_sample_holds_only_training_records_within_the_cap_whatever_the_row_order():
    silver = batch("b1", 2000)
    taken = sample(silver, 20_000)
    train = assign_split(silver, VALIDATION_FRACTION, search_fraction=SEARCH_FRACTION).filter(
        pl.col("split") == TRAIN
    )
    assert set(taken.records["record_id"]) <= set(train["record_id"])
    longest = max(chars(train[i]) for i in range(train.height))
    assert taken.chars == chars(taken.records) and 20_000 - longest < taken.chars <= 20_000, (
        "taken until the cap"
    )
    assert (taken.train_records, taken.train_chars, taken.max_chars) == (
        train.height,
        chars(train),
        20_000,
    )
    assert (
        taken.records["record_id"].to_list()
        != train["record_id"].head(taken.records.height).to_list()
    ), "not the first rows"
    assert sample(silver.sample(fraction=1.0, shuffle=True, seed=7), 20_000).records.equals(
        taken.records
    )


def test_a_new_batch_displaces_only_the_highest_ranked_records():
    first = sample(batch("b1", 2000), 20_000).records["record_id"].to_list()
    after = (
        sample(pl.concat([batch("b1", 2000), batch("b2", 2000)]), 20_000)
        .records["record_id"]
        .to_list()
    )
    kept = [record_id for record_id in after if record_id.startswith("b1")]
    assert kept == first[: len(kept)], (
        "records of the first batch stay in order; those dropped ranked highest"
    )
    assert 0 < len(kept) < len(first), "the new batch took some of the sample's room"


def test_a_cap_below_one_character_is_refused():
    with pytest.raises(ValueError, match="at least 1 character"):
        sample(batch("b1", 10), 0)
