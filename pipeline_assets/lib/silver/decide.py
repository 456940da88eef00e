"""Silver's decision for one batch from its keys alone: which records are kept, and the stage that
removed each other one (issue 37; ``lib.silver.prepare`` makes the keys).

The order is today's (``lib.silver.curation``): a pair_sides reject first (it acts before the
hashes); then exact dedup, a pair's contradiction and near dedup among the rest, against the other
batches' index entries that share a key (first arrival wins); then, for the dedup survivors, their
per-record verdict (the first per-record stage that rejected them); then the pair cap on what is
left. The dedup stages and the cap are today's stage functions, run by the stage runner on the
keys: they read hashes and signatures only, so no text is needed, and none is allowed in.

A format whose only stages across the batch are exact and near dedup is decided from its
candidates' keys alone (``from_candidates``): the records the band searches found sharing an
exact hash or a band key with another record or an index entry. Any other record no dedup stage
can remove: it is kept by both, as its own cluster, and its staged per-record verdict stands. The
decision counts those records (``Decision.unseen``) from the blocks' tallies, never reading them.

Keys come without signatures: near dedup clusters the verified pairs tasks built from its
candidates' band keys and signatures (``lib.silver.near_edges``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import polars as pl

from pipeline_assets.lib.formats import RecordFormat
from pipeline_assets.lib.silver.curation import (
    SilverConfig,
    before_dedup,
    dedup_stages,
    last_stages,
    look_up_histories,
)
from pipeline_assets.lib.silver.dedup import SIGNATURE_COLUMNS, BandMatches, IndexLookup
from pipeline_assets.lib.silver.near_edges import NearPairs
from pipeline_assets.lib.silver.preference_rules import PAIR_HASH_COLUMNS
from pipeline_assets.lib.silver.prepare import (
    CLUSTER_ID,
    POSITION,
    REASON,
    REMOVED_BY,
    KeyTally,
    refuse_text,
)
from pipeline_assets.lib.stages import StagesResult, run_whole

# what the dedup stages and the pair cap read of a record
DEDUP_INPUT = ("record_id", "batch_id", "exact_hash", *SIGNATURE_COLUMNS, *PAIR_HASH_COLUMNS)


@dataclass(frozen=True)
class Decision:
    """One format's decision for a batch."""

    # one row a record it saw, in the order today's stages remove them (kept records last):
    # record_id, removed_by (the stage's name; null: kept), stage (the reject reason), the decided
    # stages' evidence (duplicate_of, jaccard, evidence), cluster_id (for the records near dedup
    # saw) and the record's position in the batch
    verdicts: pl.DataFrame
    layout: dict[str, tuple[str, ...]]  # per decided stage that removes records: its rows' columns
    dedup_stages: tuple[str, ...]
    last_stages: tuple[str, ...]
    counters: dict[str, dict]  # the decided stages', as the stage runner counted them
    index_lookup: dict  # keys looked up and entries found for this format
    # decided from candidates: the records it did not see (none: it saw every record)
    unseen: KeyTally | None = None

    def removed_by_stage(self) -> dict[str, int]:
        """The batch's records each stage removed: the verdicts', and the unseen records'."""
        removed = dict(self.verdicts.group_by(REMOVED_BY).len().drop_nulls().iter_rows())
        return KeyTally.summed([KeyTally(0, removed), self.unseen or KeyTally(0, {})]).verdicts

    def kept_rows(self) -> int:
        """The batch's records kept: the verdicts', and the unseen records no stage removed."""
        kept = self.verdicts.filter(pl.col(REMOVED_BY).is_null()).height
        unseen = self.unseen or KeyTally(0, {})
        return kept + unseen.rows - sum(unseen.verdicts.values())


def decide(
    keys_by_format: Mapping[RecordFormat, pl.DataFrame],
    look_up: IndexLookup | None,
    config: SilverConfig,
    near: Mapping[RecordFormat, NearPairs] | None = None,
    searched: Mapping[RecordFormat, BandMatches] | None = None,
    tallies: Mapping[RecordFormat, KeyTally] | None = None,
) -> dict[RecordFormat, Decision]:
    """Every format's decision for one batch from its ``keys`` (in batch order), after one lookup
    of the other batches' index entries over every format's keys (``look_up``; None: there are
    none), as ``curate_formats`` looks them up.

    Keys read without their signatures come with the band searches (``searched``: per format,
    ``search_band`` over every band, joined: the records sharing a band key with another record
    or an index entry, and those entries) and ``near``: per format, near dedup's verified pairs
    among them. A format in ``tallies`` is decided from candidates: its keys
    are those of every candidate its searches found, EXACT_BAND's included, and its tally counts
    all its keys."""
    tallies = tallies or {}
    for fmt, keys in keys_by_format.items():
        refuse_text(keys)
        if fmt in tallies:
            _check_candidates_only(config, fmt, (searched or {}).get(fmt))
    removed_before = {fmt: _removed_before(config, fmt) for fmt in keys_by_format}
    reached = {
        fmt: keys.filter(_reached_dedup(removed_before[fmt]))
        for fmt, keys in keys_by_format.items()
    }
    hashed = {
        fmt: frame.select(name for name in DEDUP_INPUT if name in frame.columns)
        for fmt, frame in reached.items()
    }
    searched = searched or {}
    pairs = {fmt: _near_pairs(keys, (near or {}).get(fmt)) for fmt, keys in keys_by_format.items()}
    histories, _ = look_up_histories(hashed, look_up, config.minhash, searched)
    return {
        fmt: _with_unseen(
            _decide(
                keys, hashed[fmt], *histories[fmt], removed_before[fmt], config, fmt, pairs[fmt]
            ),
            tallies[fmt].less(KeyTally.of(keys)) if fmt in tallies else None,
            removed_before[fmt],
        )
        for fmt, keys in keys_by_format.items()
    }


def from_candidates(config: SilverConfig, fmt: RecordFormat) -> bool:
    """True when ``fmt``'s only stages across the batch are exact and near dedup, so that its
    candidates' keys decide it (a pair's contradiction and cap look at every pair of a prompt)."""
    across = [*dedup_stages(config, None, fmt), *last_stages(config, None, fmt)]
    return [stage.name for stage in across] == ["exact_dedup", "near_dedup"]


def _check_candidates_only(config: SilverConfig, fmt: RecordFormat, searched) -> None:
    if not from_candidates(config, fmt):
        raise ValueError(f"{fmt.name} records are decided across the batch: every key is needed")
    if searched is None or searched.exact_candidates is None:
        raise ValueError("keys of candidates only need the exact band searched with the others")


def _with_unseen(decision: Decision, unseen: KeyTally | None, removed_before: list[str]):
    """``decision`` with the records it did not see counted: each dedup stage had them in and
    kept them (but those a stage before dedup removed)."""
    if unseen is None:
        return decision
    reached = unseen.rows - sum(unseen.verdicts.get(name, 0) for name in removed_before)
    counters = dict(decision.counters)
    for name in decision.dedup_stages:
        counted = counters[name]
        counters[name] = {
            **counted,
            "rows_in": counted["rows_in"] + reached,
            "kept": counted["kept"] + reached,
        }
    return replace(decision, counters=counters, unseen=unseen)


def _near_pairs(keys: pl.DataFrame, pairs: NearPairs | None) -> NearPairs | None:
    if SIGNATURE_COLUMNS[0] in keys.columns:
        return None
    if pairs is None:
        raise ValueError("keys without signatures need near dedup's verified pairs")
    return pairs


def reached_dedup(config: SilverConfig, fmt: RecordFormat) -> pl.Expr:
    """True for the keys of records no stage before dedup removed."""
    return _reached_dedup(_removed_before(config, fmt))


def _reached_dedup(removed_before: list[str]) -> pl.Expr:
    return ~pl.col(REMOVED_BY).is_in(removed_before).fill_null(False)


def _removed_before(config: SilverConfig, fmt: RecordFormat) -> list[str]:
    """The stages before dedup that remove records (a pair's sides)."""
    return [stage.name for stage in before_dedup(config, fmt) if stage.reject_reason]


def _decide(
    keys: pl.DataFrame,
    hashed: pl.DataFrame,
    history: pl.LazyFrame | None,
    lookup_counters: dict,
    removed_before: list[str],
    config: SilverConfig,
    fmt: RecordFormat,
    pairs: NearPairs | None,
) -> Decision:
    deduped = run_whole(dedup_stages(config, history, fmt, pairs), hashed)
    survivors = deduped.kept.join(
        keys.select("record_id", REMOVED_BY, REASON), on="record_id", maintain_order="left"
    )
    passing = survivors.filter(pl.col(REMOVED_BY).is_null()).select(deduped.kept.columns)
    last = run_whole(
        last_stages(config, history, fmt), passing.drop(PAIR_HASH_COLUMNS[1], strict=False)
    )
    verdicts = pl.concat(
        [
            keys.filter(pl.col(REMOVED_BY).is_in(removed_before)).select(
                "record_id", REMOVED_BY, pl.col(REASON).alias("stage")
            ),
            *_removed_rows(deduped),
            survivors.filter(pl.col(REMOVED_BY).is_not_null()).select(
                "record_id", REMOVED_BY, pl.col(REASON).alias("stage"), CLUSTER_ID
            ),
            *_removed_rows(last),
            last.kept.select("record_id", CLUSTER_ID),
        ],
        how="diagonal_relaxed",
    ).join(keys.select("record_id", POSITION), on="record_id", how="left", maintain_order="left")
    removed = {**deduped.removed, **last.removed}
    return Decision(
        verdicts,
        {name: tuple(frame.columns) for name, frame in removed.items()},
        tuple(deduped.counters),
        tuple(last.counters),
        {**deduped.counters, **last.counters},
        lookup_counters,
    )


def _removed_rows(result: StagesResult) -> list[pl.DataFrame]:
    """Each stage's removed records: their id, the stage, its evidence (the columns after
    ``stage``) and their cluster where near dedup gave one."""
    rows = []
    for name, frame in result.removed.items():
        evidence = frame.columns[frame.columns.index("stage") + 1 :]
        cluster = [CLUSTER_ID] if CLUSTER_ID in frame.columns else []
        rows.append(
            frame.select(
                "record_id",
                pl.lit(name, pl.String).alias(REMOVED_BY),
                "stage",
                *evidence,
                *cluster,
            )
        )
    return rows
