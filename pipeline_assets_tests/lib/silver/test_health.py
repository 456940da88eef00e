"""The silver drift check's scores: a batch in another language drifts; the same mix does not."""

from __future__ import annotations

import polars as pl

from pipeline_assets.lib.silver.health import drift_scores
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
