"""Silver's records cut by the decision (issue 37): the staged records of a batch
(``lib.silver.prepare``) and its verdicts (``lib.silver.decide``) give the frames
``curate_formats`` gives today, table for table, and each stage's counters.

Each stage's removed rows get the columns today's stage gives them (the layouts ``prepare`` and
``decide`` recorded), so silver/rejects has today's columns in today's order.

``split_share`` cuts some of the batch's records (a write task's share) by their verdicts alone
(from candidates: the records without one by their staged verdicts),
by the same code ``split`` runs on the whole batch; ``stage_counters`` gives the batch's counters
from the verdicts and the blocks' counters, no record read, so the step never holds the text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import polars as pl

from pipeline_assets.lib.silver.curation import split_hashes
from pipeline_assets.lib.silver.decide import Decision
from pipeline_assets.lib.silver.dedup import SIGNATURE_COLUMNS, index_entries
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.preference_rules import PAIR_HASH_COLUMNS
from pipeline_assets.lib.silver.prepare import (
    CLUSTER_ID,
    HASHED,
    KEPT,
    POSITION,
    REMOVED_BY,
    Prepared,
)

DECIDED = "decided_"  # the verdict's columns, beside the staged record's own


@dataclass(frozen=True)
class SplitShare:
    """What one share of a batch's staged records gives: the three tables' rows of its records."""

    kept: pl.DataFrame  # as CuratedBatch.kept
    rejects: pl.DataFrame  # as CuratedBatch.rejects
    index: pl.DataFrame  # as CuratedBatch.index


@dataclass(frozen=True)
class SplitBatch(SplitShare):
    stages: dict[str, dict]  # per stage, in order: rows_in, kept, rejected (and the runner's own)


def split(
    prepared: Prepared, decision: Decision, minhash: MinHashConfig = MinHashConfig()
) -> SplitBatch:
    """The batch's kept rows, rejects and index entries, cut from ``prepared.staged`` by
    ``decision``, and every stage's counters."""
    cut = split_share(prepared, decision, minhash)
    stages = stage_counters(prepared.counters, prepared.record_stages, decision)
    return SplitBatch(cut.kept, cut.rejects, cut.index, stages)


def split_share(
    prepared: Prepared, decision: Decision, minhash: MinHashConfig = MinHashConfig()
) -> SplitShare:
    """The kept rows, rejects and index entries of the records of ``prepared`` (a whole batch or
    some of its blocks), by ``decision`` (its verdicts: those records' and no others, see
    ``for_positions``). Over a batch's shares, the concatenations are what ``split`` of the whole
    batch gives, row for row."""
    rows = with_verdicts(prepared.staged, decision)
    removed_by = pl.col(DECIDED + REMOVED_BY)
    order = (
        *prepared.counters,
        *decision.dedup_stages,
        *prepared.record_stages,
        *decision.last_stages,
    )
    removed = [
        _removed(rows.filter(removed_by == name), name, prepared, decision)
        for name in order
        if name in prepared.layout or name in decision.layout
    ]
    kept = rows.filter(removed_by.is_null())
    signed = kept.select(_columns(prepared.layout[HASHED]))
    return SplitShare(
        kept=kept.select(_columns(prepared.layout[KEPT])).with_columns(split_hashes(prepared.fmt)),
        rejects=pl.concat(removed, how="diagonal_relaxed").drop(
            *SIGNATURE_COLUMNS, PAIR_HASH_COLUMNS[1], strict=False
        ),
        index=index_entries(signed, minhash, prepared.fmt),
    )


def for_positions(decision: Decision, start: int, stop: int) -> Decision:
    """``decision`` with the verdicts of the records from position ``start`` up to ``stop`` only
    (a share's records): what a task that splits that share needs, and no more."""
    inside = pl.col(POSITION).is_between(start, stop, closed="left")
    return replace(decision, verdicts=decision.verdicts.filter(inside))


def with_verdicts(staged: pl.DataFrame, decision: Decision) -> pl.DataFrame:
    """``staged`` (staged records in batch order: record_id, REMOVED_BY, stage) with each record's
    verdict in the DECIDED columns (``DECIDED + REMOVED_BY``: the stage that removed it). Every
    record must have one, but in a decision from candidates: a record without one keeps its staged
    per-record verdict, and leads its own cluster."""
    verdicts, some = decision.verdicts, decision.unseen is not None
    decided = verdicts.rename({name: DECIDED + name for name in verdicts.columns[1:]})
    found = DECIDED + "found"
    rows = staged.join(
        decided.with_columns(pl.lit(True).alias(found)),
        on="record_id",
        how="left",
        maintain_order="left",
    )
    given = rows.height - rows[found].null_count()
    if given != verdicts.height or (given != staged.height and not some):
        raise ValueError(
            f"{staged.height} staged records but {verdicts.height} verdicts, not one for each"
        )
    if some:
        unseen = pl.col(found).is_null()
        rows = rows.with_columns(
            pl.when(unseen).then(pl.col(name)).otherwise(DECIDED + column).alias(DECIDED + column)
            for column, name in (
                (REMOVED_BY, REMOVED_BY),
                ("stage", "stage"),
                (CLUSTER_ID, "record_id"),
            )
        )
    return rows.drop(found)


def _columns(names: tuple[str, ...] | list[str]) -> list[pl.Expr]:
    """``names`` from a staged row, its cluster as the decision gave it."""
    return [
        pl.col(DECIDED + CLUSTER_ID).alias(CLUSTER_ID) if name == CLUSTER_ID else pl.col(name)
        for name in names
    ]


def _removed(rows: pl.DataFrame, name: str, prepared: Prepared, decision: Decision) -> pl.DataFrame:
    """The rows ``name`` removed, with the columns today's stage gives them."""
    if name in prepared.layout:  # a per-record stage: its own verdict and evidence, staged
        return rows.select(_columns(prepared.layout[name]))
    decided = decision.layout[name]
    at_stage = decided.index("stage")
    return rows.select(
        *_columns(_record_columns(name, decided[:at_stage], prepared, decision)),
        *(pl.col(DECIDED + column).alias(column) for column in decided[at_stage:]),
    )


def _record_columns(
    name: str, decided: tuple[str, ...], prepared: Prepared, decision: Decision
) -> list[str]:
    """The record's columns as a decided stage found them: the hashed rows (near dedup drops the
    signatures and adds the cluster); after the per-record stages (the pair cap), what they
    kept."""
    if name in decision.last_stages:
        return list(prepared.layout[KEPT])
    hashed = [
        column
        for column in prepared.layout[HASHED]
        if column in decided or column not in SIGNATURE_COLUMNS
    ]
    return [*hashed, *([CLUSTER_ID] if CLUSTER_ID in decided else [])]


def stage_counters(
    before_dedup: dict[str, dict], record_stages: tuple[str, ...], decision: Decision
) -> dict[str, dict]:
    """Every stage's counters in today's order, from keys and verdicts alone: the runner's for the
    stages before dedup (``before_dedup``: the blocks' counters, summed) and the decided ones; for
    the per-record stages (``record_stages``), derived from the verdicts as the runner derives them
    (rows in: what the stage before kept)."""
    survivors = decision.counters[decision.dedup_stages[-1]]["kept"]
    by_stage = decision.removed_by_stage()
    per_record = {}
    for name in record_stages:
        rejected = by_stage.get(name, 0)
        kept = survivors - rejected
        per_record[name] = {"rows_in": survivors, "kept": kept, "rejected": rejected}
        survivors -= rejected
    last = {name: decision.counters[name] for name in decision.last_stages}
    dedup = {name: decision.counters[name] for name in decision.dedup_stages}
    return {**before_dedup, **dedup, **per_record, **last}
