"""Silver's decision measured on batches large enough to show its rate a record.

A calibration's batches hold a few thousand records. The decision (``lib.silver.decide``: exact and
near dedup on the keys, the per-record verdicts applied) costs them a fixed tenth of a second or so
(each of its polars steps' own start), so a rate fitted on them is that fixed cost spread over a
few records: four times the rate a batch of 400,000 records shows. Measured here instead: the
decision silver runs on synthetic batches of BATCH_SIZES records whose keys carry the
calibration's removals (``Removals``: exact copies, near copies, per-record rejects): ``decide``
as the step calls it for sft records, on the keys of the candidates the band searches found
(exact and near), the other records counted by their blocks' tally, with near dedup's verified
pairs. The fastest of ``kept_rates.REPEATS`` decisions at each size, the sizes taken in turns.
The band searches, the reads of the candidates' keys and the pairs' building are left out: in
silver, tasks do them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pipeline_assets.defs.silver.kept_rates import fastest_in_turns, fingerprint, kept_or_measured
from pipeline_assets.defs.silver.lookup_rate import bronze_record_ids, random_hashes
from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.ops.sizing import Removals
from pipeline_assets.lib.silver import curation, decide, dedup, near_edges
from pipeline_assets.lib.silver.curation import SilverConfig
from pipeline_assets.lib.silver.dedup import ENTRY_IDS, BandMatches, signature_series
from pipeline_assets.lib.silver.near_edges import SIGNED_COLUMNS, NearPairs, pairs_in
from pipeline_assets.lib.silver.prepare import REASON, REMOVED_BY, KeyTally

BATCH_SIZES = (100_000, 400_000)
PER_RECORD_STAGE = "quality"  # the stage the synthetic per-record rejects name
CHANGED_PERMUTATIONS = 6  # of a near copy's signature: an estimated Jaccard of about 0.95


@dataclass(frozen=True)
class DecisionRate:
    """What ``measure_decision`` measured, and on what."""

    points: list[tuple[int, float]]  # (records in the batch, the decision's seconds)
    measured_on: str


def decision_rate(
    cache: Path,
    config: SilverConfig,
    removals: Removals,
    log: Callable[[str], object] = print,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
) -> DecisionRate:
    """The decision's rate from ``cache`` when it was measured by this code on this machine with
    ``config``, ``removals`` and ``batch_sizes``, else measured now (seconds) and kept there."""
    shares = f"{removals.exact:.3f} exact, {removals.near:.3f} near, {removals.per_record:.3f}"
    measured_on = (
        f"{fingerprint((decide, dedup, curation, near_edges, sys.modules[__name__]), config)}; "
        f"batches of {', '.join(map(str, batch_sizes))} records; removals {shares}"
    )

    def measure() -> DecisionRate:
        log(
            f"measuring silver's decision on synthetic batches of "
            f"{', '.join(f'{size:,}' for size in batch_sizes)} records (once for this code and "
            f"machine; kept in {cache.name})"
        )
        points = measure_decision(batch_sizes, removals, config)
        return DecisionRate([list(point) for point in points], measured_on)

    return kept_or_measured(cache, DecisionRate, measured_on, measure)


def measure_decision(
    batch_sizes: tuple[int, ...], removals: Removals, config: SilverConfig = SilverConfig()
) -> list[tuple[int, float]]:
    """(records, the decision's seconds) for each of ``batch_sizes``, in order: a batch of each
    size, the fastest of decisions in turns (``fastest_in_turns``)."""
    batches = [
        SyntheticBatch(size, removals, config, seed=number)
        for number, size in enumerate(batch_sizes)
    ]
    return list(zip(batch_sizes, fastest_in_turns([b.decide for b in batches]), strict=True))


class SyntheticBatch:
    """A batch's keys as silver's prepare tasks stage them (record ids as bronze names them, random
    exact hashes), with ``removals``: exact copies of other records, near copies (their
    signatures a few permutations off their original's: the band searches' candidates, with
    their originals), and records a per-record stage rejected, each a share of ``rows``. ``keys``
    are the candidates' (the step reads no others), ``tally`` counts every record's."""

    def __init__(self, rows: int, removals: Removals, config: SilverConfig, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.config, self.rows = config, rows
        self.exact, self.near, self.rejected = (
            round(rows * share) for share in (removals.exact, removals.near, removals.per_record)
        )
        cuts = np.cumsum([self.exact, self.near, self.rejected])
        exact, near, rejected, rest = np.split(rng.permutation(rows), cuts)
        if len(rest) < 2:
            raise ValueError(f"removals {removals} leave no records to be the copies' originals")
        # a copy's original is one of the rest, near and exact ones apart: a near original removed
        # as an exact copy would leave its near copies nothing to be near
        near_of = rng.choice(rest[: len(rest) // 2], self.near)
        exact_of = rng.choice(rest[len(rest) // 2 :], self.exact)
        hashes = random_hashes(rng, rows).to_numpy().copy()
        hashes[exact] = hashes[exact_of]
        ids = bronze_record_ids(seed, rows)
        keys = pl.DataFrame(
            {
                "position": pl.Series(np.arange(rows), dtype=pl.UInt32),
                "record_id": ids,
                "batch_id": pl.repeat(f"b{seed}", rows, eager=True),
                "exact_hash": hashes,
                REMOVED_BY: _at(rows, rejected, PER_RECORD_STAGE),
                REASON: _at(rows, rejected, PER_RECORD_STAGE),
            }
        )
        self.signatures = _near_copies(
            rng, ids, near, near_of, config.minhash.num_perm
        ).with_columns(batch_id=pl.lit(f"b{seed}"))
        self.pairs = pairs_in(self.signatures, f"b{seed}", config.minhash)
        exact_candidates = keys.filter(pl.col("exact_hash").is_duplicated())["record_id"]
        self.searched = BandMatches(
            self.signatures["record_id"].sort(), pl.DataFrame(schema=ENTRY_IDS), 0, exact_candidates
        )
        self.tally = KeyTally.of(keys)
        self.keys = keys.filter(
            pl.col("record_id").is_in(self.searched.every_candidate().implode())
        )

    def decide(self) -> float:
        """One decision of the batch: its seconds, the similarities asked of tasks left out.
        Raises unless it removed exactly the batch's copies and rejects."""
        asked_seconds = []

        def similarity(pairs: pl.DataFrame) -> pl.DataFrame:
            started = time.perf_counter()
            found = self.pairs.similarity(pairs)
            asked_seconds.append(time.perf_counter() - started)
            return found

        started = time.perf_counter()
        decision = decide.decide(
            {SFT: self.keys},
            None,
            self.config,
            {SFT: NearPairs(self.pairs.edges, similarity)},
            {SFT: self.searched},
            {SFT: self.tally},
        )
        seconds = time.perf_counter() - started - sum(asked_seconds)
        removed = decision[SFT].removed_by_stage()
        expected = {
            "exact_dedup": self.exact,
            "near_dedup": self.near,
            PER_RECORD_STAGE: self.rejected,
        }
        if {stage: removed.get(stage, 0) for stage in expected} != expected:
            raise AssertionError(f"the decision removed {removed}, not {expected}")
        return seconds


def _at(rows: int, positions: np.ndarray, value: str) -> pl.Series:
    marked = np.zeros(rows, dtype=bool)
    marked[positions] = True
    return pl.select(pl.when(pl.Series(marked)).then(pl.lit(value))).to_series()


def _near_copies(
    rng: np.random.Generator, ids: pl.Series, copies: np.ndarray, originals: np.ndarray, perm: int
) -> pl.DataFrame:
    """The signatures of the near copies and their originals (``originals``: each copy's; an
    original may have several), the records the pair tasks read: random for an original, a
    copy's CHANGED_PERMUTATIONS of its original's drawn again."""
    distinct, of_copy = np.unique(originals, return_inverse=True)
    original = rng.integers(0, 2**32, (len(distinct), perm), dtype=np.uint32)
    copy = original[of_copy]
    rows = np.arange(len(copies))[:, None]
    changed = np.argsort(rng.random((len(copies), perm)), axis=1)[:, :CHANGED_PERMUTATIONS]
    copy[rows, changed] = rng.integers(0, 2**32, changed.shape, dtype=np.uint32)
    sigs = np.concatenate([original, copy])
    return pl.DataFrame(
        {
            "record_id": ids.gather(np.concatenate([distinct, copies])),
            **{name: signature_series(name, sigs) for name in SIGNED_COLUMNS},
        }
    )
