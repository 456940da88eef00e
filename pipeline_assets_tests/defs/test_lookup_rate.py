"""The sizer's lookup rate, measured on synthetic indexes once for a code and machine."""

from __future__ import annotations

import json

from pipeline_assets.defs.silver.lookup_rate import LookupRate, lookup_rate
from pipeline_assets.lib.silver.dedup import lsh_of
from pipeline_assets.lib.silver.minhash import MinHashConfig

SIZES, BATCH = (3_000, 6_000), 1_000


def test_the_lookup_rate_is_measured_once_then_again_when_what_it_ran_on_changed(tmp_path):
    cache, config, said = tmp_path / "reports" / "lookup-rate.json", MinHashConfig(), []
    rate = lookup_rate(cache, config, said.append, SIZES, BATCH)
    assert [rows for rows, _ in rate.points] == list(SIZES)
    assert all(seconds > 0 for _, seconds in rate.points)
    assert rate.bands == lsh_of(config).bands + 1, "every LSH band and the exact hash's"
    assert len(said) == 1 and "3,000, 6,000 records" in said[0]

    assert lookup_rate(cache, config, said.append, SIZES, BATCH) == rate and len(said) == 1, "kept"

    kept = json.loads(cache.read_text())
    cache.write_text(json.dumps({**kept, "measured_on": "other code; 64 cores"}))
    again = lookup_rate(cache, config, said.append, SIZES, BATCH)
    assert len(said) == 2 and again.measured_on == rate.measured_on
    assert LookupRate(**json.loads(cache.read_text())) == again
    cache.write_text("{not json")
    assert lookup_rate(cache, config, said.append, SIZES, BATCH).measured_on == rate.measured_on
    assert len(said) == 3, "an unreadable file is measured again and written over"
    other = MinHashConfig(threshold=0.7)
    assert lookup_rate(cache, other, said.append, SIZES, BATCH).measured_on != rate.measured_on
    assert len(said) == 4, "measured again for other settings"
