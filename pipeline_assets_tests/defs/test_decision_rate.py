"""The sizer's decision rate, measured on synthetic batches once for a code and machine."""

from __future__ import annotations

import json

import pytest

from pipeline_assets.defs.silver.decision_rate import (
    PER_RECORD_STAGE,
    DecisionRate,
    SyntheticBatch,
    decision_rate,
)
from pipeline_assets.lib.ops.sizing import Removals
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.minhash import MinHashConfig

SIZES = (2_000, 8_000)
REMOVALS = Removals(exact=0.05, near=0.04, per_record=0.03)


def test_a_synthetic_batch_is_decided_as_its_removals_say():
    batch = SyntheticBatch(10_000, REMOVALS, SilverConfig(), seed=3)
    assert (batch.exact, batch.near, batch.rejected) == (500, 400, 300)
    assert batch.tally.rows == 10_000 and batch.tally.verdicts == {PER_RECORD_STAGE: 300}
    exact = batch.searched.exact_candidates
    assert 500 < exact.len() <= 1_000, "the exact copies and their originals"
    assert (
        batch.keys.filter(batch.keys["record_id"].is_in(exact.implode()))["exact_hash"].n_unique()
        == exact.len() - 500
    ), "each exact copy has its original"
    assert 400 < batch.searched.candidates.len() <= 800, "the near copies and their originals"
    assert batch.keys.height < 1_800, "the decision reads the candidates' keys, no others"
    assert batch.decide() > 0  # raises unless exactly the copies and the rejects are removed
    scraped = Removals(exact=0.45, near=0.3, per_record=0.2)  # most records removed
    assert SyntheticBatch(10_000, scraped, SilverConfig(), seed=4).decide() > 0

    stricter = SilverConfig(minhash=MinHashConfig(threshold=0.99))
    with pytest.raises(AssertionError, match="near_dedup"):
        SyntheticBatch(10_000, REMOVALS, stricter, seed=3).decide()  # near copies below 0.99


def test_the_decision_rate_is_measured_once_then_again_when_what_it_ran_on_changed(tmp_path):
    cache, config, said = tmp_path / "reports" / "decision-rate.json", SilverConfig(), []
    rate = decision_rate(cache, config, REMOVALS, said.append, SIZES)
    assert [rows for rows, _ in rate.points] == list(SIZES)
    assert all(seconds > 0 for _, seconds in rate.points)
    assert len(said) == 1 and "2,000, 8,000 records" in said[0]

    assert decision_rate(cache, config, REMOVALS, said.append, SIZES) == rate and len(said) == 1
    assert DecisionRate(**json.loads(cache.read_text())) == rate

    other = Removals(exact=0.2, near=0.04, per_record=0.03)
    assert decision_rate(cache, config, other, said.append, SIZES).measured_on != rate.measured_on
    assert len(said) == 2, "measured again for a corpus with other removals"
    cache.write_text("{not json")
    assert (
        decision_rate(cache, config, REMOVALS, said.append, SIZES).measured_on == rate.measured_on
    )
    assert len(said) == 3, "an unreadable file is measured again and written over"
