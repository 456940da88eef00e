"""The silver drift check's scores: a batch in another language drifts; the same mix does not."""

from __future__ import annotations

import polars as pl

from pipeline_assets.lib.silver.health import drift_scores, pass_rate_drops, pass_rates
from pipeline_assets.lib.silver.quality import QUANTITIES


def _batch(languages: dict[str, int]) -> pl.DataFrame:
    rows = sum(languages.values())
    return pl.DataFrame(
        {
            "source": ["support"] * rows,
            "language": [language for language, n in languages.items() for _ in range(n)],
            **{q: [float(i % 7) for i in range(rows)] for q in QUANTITIES},
        }
    )


def test_a_batch_in_another_language_shifts_the_language_mix_and_nothing_else():
    history = pl.concat([_batch({"en": 580, "de": 20}), _batch({"en": 590, "de": 10})])
    same = drift_scores(history, _batch({"en": 585, "de": 15}))
    assert max(same.values()) < 0.1
    shifted = drift_scores(history, _batch({"en": 200, "de": 400}))
    assert shifted["language_mix"] > 0.25
    assert {name for name, psi in shifted.items() if psi >= 0.1} == {"language_mix"}


def test_rows_written_before_languages_were_labelled_are_left_out():
    unlabelled = _batch({"en": 600}).with_columns(pl.lit(None, pl.String).alias("language"))
    scores = drift_scores(pl.concat([unlabelled, _batch({"en": 600})]), _batch({"en": 600}))
    assert scores["language_mix"] == 0.0


def test_a_pass_rate_that_collapses_names_the_stage_whose_removals_grew_from_counts_alone():
    batches = ["b1", "b2", "b3"]
    kept = pl.DataFrame(
        {"batch_id": batches + ["b3"], "source": ["web"] * 3 + ["chat"], "kept": [90, 88, 40, 5]}
    )
    removed = pl.DataFrame(
        {
            "batch_id": ["b1", "b2", "b3", "b3", "b3"],
            "source": ["web"] * 4 + ["chat"],
            "stage": ["exact_dup", "exact_dup", "exact_dup", "quality", "quality"],
            "removed": [10, 12, 10, 50, 5],
        }
    )
    rates = pass_rates(kept, removed)
    assert rates.filter(batch_id="b3", source="web")[["rows", "pass_rate"]].row(0) == (100, 0.4)
    drops = pass_rate_drops(rates, removed, "b3", trailing=10).to_dicts()
    assert [d["source"] for d in drops] == ["chat", "web"]
    chat, web = drops
    assert chat["baseline"] is None and chat["pass_rate"] == 0.5, "no history: not judged"
    assert web["baseline"] == 0.89 and round(web["drop"], 2) == 0.49
    assert web["blamed_stage"] == "quality" and web["blamed_growth"] == 0.5
