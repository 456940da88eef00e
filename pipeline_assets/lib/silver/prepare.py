"""Silver's per-record work on one block, with nothing removed yet: the first step of curating a
batch without every record passing through one process (issue 37).

``prepare_block`` runs every stage that judges one record at a time on every record of the block:
the block stages before dedup (normalize, a pair's sides, the views, the signatures), the hashes,
and the stages after dedup (decontamination, the quality rules, the language, the user's scorers),
each on what the one before kept, exactly as ``lib.silver.curation`` lists them. A record the
heuristics reject is never given to a model. What it would have removed stays, with the stage
that removed it (its per-record verdict) and that stage's evidence.

It gives two frames:

- ``staged``: every record with its text, the columns silver/records and silver/rejects take,
  its signatures, its per-record verdict (``removed_by``: the stage's name; ``stage``: the reject
  reason, as silver/rejects writes it) and the evidence;
- ``keys``: what the dedup decision reads and nothing more, no text at all: record id, position
  in the batch, exact hash, signatures, band keys, a pair's hashes and the per-record verdict.

``lib.silver.decide`` decides from the keys alone; ``lib.silver.split`` cuts the staged records
by the decision into what ``curate_formats`` gives today.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import polars as pl

from pipeline_assets.lib.formats import FORMATS, PREFERENCE, SFT, TURNS, RecordFormat
from pipeline_assets.lib.silver.curation import SilverConfig, after_dedup, before_dedup
from pipeline_assets.lib.silver.decontam import EvalNgramIndex
from pipeline_assets.lib.silver.dedup import (
    SIGNATURE_COLUMNS,
    exact_hashes,
    index_entries,
    lsh_of,
    staged_band_column,
)
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.preference_rules import PAIR_HASH_COLUMNS, pair_hashes
from pipeline_assets.lib.stages import (
    ROWS_PER_BLOCK,
    Stage,
    StagesResult,
    merge,
    run_stages,
    split_at_actors,
)

POSITION = "position"  # a record's place in its batch: the order every stage keeps
REMOVED_BY = "removed_by"  # the per-record stage (its name) that removed the record; null: none
REASON = "reason"  # in keys: that stage's reject reason, as silver/rejects' ``stage`` says it
CLUSTER_ID = "cluster_id"  # near dedup fills it in; the stages after dedup find it in place
HASHED = "hashed"  # layout: the record's columns as the dedup stages find them
KEPT = "kept"  # layout: the columns of a record every per-record stage kept
WORK_COUNTERS = ("seconds", "model_loads")  # what a stage spent, not what it judged


def text_columns() -> frozenset[str]:
    """Every column that holds a record's text in any format: its fields, turns and views, and the
    free-form ``meta`` and ``extra``. None of them may be in ``keys``."""
    names = {"meta", "extra"}
    for fmt in FORMATS.values():
        names |= {*fmt.text, *fmt.views, *(c for c in (fmt.turns, fmt.context) if c)}
    return frozenset(names)


# the string columns of silver's tables that hold ids, hashes and labels, never a record's text:
# the only ones whose min and max a written file's statistics carry to the committing step
BOUNDED_STRINGS = frozenset(
    {
        "record_id",
        "batch_id",
        "source",
        "stage",
        "exact_hash",
        "prompt_hash",
        "cluster_id",
        "duplicate_of",
        "duplicate_of_batch",
        "language",
        "lsh_params",
        "content_hash",
    }
)


class TextInKeysError(ValueError):
    """A frame that must hold only hashes and verdicts holds a record's text."""


def refuse_text(frame: pl.DataFrame) -> None:
    """Raise when ``frame`` has a text column (by name, or a column of turns)."""
    text = sorted(
        name for name, dtype in frame.schema.items() if name in text_columns() or dtype == TURNS
    )
    if text:
        raise TextInKeysError(f"keys hold text columns {text}: only hashes may reach the decision")


@dataclass(frozen=True)
class Prepared:
    """One format's records of a block (or of a whole batch, its blocks joined), prepared."""

    fmt: RecordFormat
    staged: pl.DataFrame  # every record with its text, verdict and evidence, in batch order
    keys: pl.DataFrame  # no text: what ``decide`` reads, in batch order
    # the columns of each frame today's stages hand on: HASHED, KEPT, and per stage that removes
    # records one at a time, its removed rows' columns (silver/rejects' column order follows them)
    layout: dict[str, tuple[str, ...]]
    record_stages: tuple[str, ...]  # the stages after dedup, in order
    counters: dict[str, dict]  # the stages before dedup, as the stage runner counted them
    # the work of the stages after dedup (WORK_COUNTERS), on every record that reached them here
    # (the dedup losers too); what they judged is counted from the verdicts
    record_counters: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class KeyTally:
    """Keys counted: their records, and the records of each per-record verdict (a stage's name:
    the records it removed). What a decision that reads some of a batch's keys knows of the rest."""

    rows: int
    verdicts: dict[str, int]

    @classmethod
    def of(cls, keys: pl.DataFrame) -> KeyTally:
        removed = keys.filter(pl.col(REMOVED_BY).is_not_null()).group_by(REMOVED_BY).len()
        return cls(keys.height, dict(sorted(removed.iter_rows())))

    @classmethod
    def summed(cls, tallies) -> KeyTally:
        rows, verdicts = 0, {}
        for tally in tallies:
            rows += tally.rows
            for name, count in tally.verdicts.items():
                verdicts[name] = verdicts.get(name, 0) + count
        return cls(rows, verdicts)

    def less(self, other: KeyTally) -> KeyTally:
        """The records counted here and not in ``other`` (a tally of some of them)."""
        verdicts = {name: n - other.verdicts.get(name, 0) for name, n in self.verdicts.items()}
        return KeyTally(self.rows - other.rows, {name: n for name, n in verdicts.items() if n})


def prepare_block(
    block: pl.DataFrame,
    config: SilverConfig,
    eval_index: EvalNgramIndex,
    fmt: RecordFormat = SFT,
    first_position: int = 0,
) -> Prepared:
    """Every per-record stage on ``block`` (bronze rows of ``fmt``, starting at ``first_position``
    of their batch), nothing removed: see the module docstring."""
    return finish_block(start_block(block, config, eval_index, fmt, first_position))


@dataclass(frozen=True)
class Started:
    """A block through the stages before dedup, hashed, and through the stages after dedup up to
    ``judged``'s: what ``finish_block`` completes. On Ray, ``judged`` goes on to the model stages
    on an actor pool (``run_more``), the rest travels with it."""

    fmt: RecordFormat
    positions: pl.DataFrame  # record_id and POSITION of every row of the block
    hashed: pl.DataFrame  # what the stages before dedup kept, with the hashes
    removed_before: dict[str, pl.DataFrame]  # the stages before dedup's removed rows
    counters: dict[str, dict]  # the stages before dedup, as the stage runner counted them
    judged: StagesResult  # the stages after dedup that have run
    minhash: MinHashConfig  # what the band keys are made with


def start_block(
    block: pl.DataFrame,
    config: SilverConfig,
    eval_index: EvalNgramIndex,
    fmt: RecordFormat = SFT,
    first_position: int = 0,
    before_models: bool = False,
) -> Started:
    """The stages before dedup and the hashes on ``block``, then the stages after dedup: all of
    them, or with ``before_models`` those before the first that runs a model (``model_stages``
    gives the rest)."""
    positions = block.select("record_id").with_row_index(POSITION, offset=first_position)
    before = run_stages(before_dedup(config, fmt), block)
    hashed = before.kept.with_columns(
        exact_hashes(before.kept, fmt), *(pair_hashes() if fmt is PREFERENCE else [])
    )
    stages = after_dedup(config, eval_index, fmt)
    # what the stages after dedup find today: near dedup dropped the signatures and added the
    # cluster (filled in from the decision), the flipped hash was dropped
    judged = run_stages(
        split_at_actors(stages)[0] if before_models else stages,
        hashed.drop(*SIGNATURE_COLUMNS, PAIR_HASH_COLUMNS[1], strict=False).with_columns(
            pl.lit(None, pl.String).alias(CLUSTER_ID)
        ),
    )
    return Started(fmt, positions, hashed, before.removed, before.counters, judged, config.minhash)


def model_stages(config: SilverConfig, fmt: RecordFormat) -> list[Stage]:
    """The stages after dedup from the first that runs a model on (none: no such stage)."""
    return split_at_actors(after_dedup(config, EvalNgramIndex(config.decontam), fmt))[1]


def finish_block(started: Started) -> Prepared:
    """The block's staged records and keys from what its stages kept and removed."""
    fmt, hashed, judged = started.fmt, started.hashed, started.judged
    removed = {**started.removed_before, **judged.removed}
    staged = (
        pl.concat(
            [
                judged.kept,
                *(
                    frame.with_columns(pl.lit(name, pl.String).alias(REMOVED_BY))
                    for name, frame in removed.items()
                ),
            ],
            how="diagonal_relaxed",
        )
        .join(_hash_columns(hashed, fmt), on="record_id", how="left")
        .join(started.positions, on="record_id")
        .sort(POSITION)
    )
    return Prepared(
        fmt,
        staged,
        _keys(staged, hashed, started.minhash, fmt),
        {
            HASHED: tuple(hashed.columns),
            KEPT: tuple(judged.kept.columns),
            **{name: tuple(frame.columns) for name, frame in removed.items()},
        },
        tuple(judged.counters),
        started.counters,
        {
            name: {key: value for key, value in counted.items() if key in WORK_COUNTERS}
            for name, counted in judged.counters.items()
        },
    )


def _hash_columns(hashed: pl.DataFrame, fmt: RecordFormat) -> pl.DataFrame:
    """What ``staged`` takes back from the hashed rows: the signatures (for the index entries) and
    a pair's flipped hash."""
    flipped = [PAIR_HASH_COLUMNS[1]] if fmt is PREFERENCE else []
    return hashed.select("record_id", *SIGNATURE_COLUMNS, *flipped)


def _keys(
    staged: pl.DataFrame, hashed: pl.DataFrame, minhash: MinHashConfig, fmt: RecordFormat
) -> pl.DataFrame:
    """What the decision reads of a block: hashes, signatures, the per-record verdict, and the LSH
    band keys a column a band (the band searches read one each; no other reader takes them)."""
    pair = list(PAIR_HASH_COLUMNS) if fmt is PREFERENCE else []
    bands = lsh_of(minhash).bands
    band_keys = index_entries(hashed, minhash, fmt).select(
        "record_id",
        *(
            pl.col("band_keys").list.get(band, null_on_oob=True).alias(staged_band_column(band))
            for band in range(bands)
        ),
    )
    keys = staged.select(
        POSITION,
        "record_id",
        "batch_id",
        "exact_hash",
        *SIGNATURE_COLUMNS,
        *pair,
        REMOVED_BY,
        pl.col("stage").alias(REASON),
    ).join(band_keys, on="record_id", how="left", maintain_order="left")
    refuse_text(keys)
    return keys


def join_blocks(blocks: Sequence[Prepared]) -> Prepared:
    """A batch's blocks, prepared one by one, as one: frames in block order, counters summed."""
    first = blocks[0]
    if any(b.layout != first.layout or b.fmt is not first.fmt for b in blocks):
        raise ValueError("blocks of one batch were prepared with different formats or stages")
    counters = summed_counters([block.counters for block in blocks])
    return Prepared(
        first.fmt,
        pl.concat([b.staged for b in blocks], how="diagonal_relaxed"),
        pl.concat([b.keys for b in blocks], how="diagonal_relaxed"),
        first.layout,
        first.record_stages,
        counters,
        summed_counters([block.record_counters for block in blocks]),
    )


def summed_counters(blocks: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """The blocks' counters of the stages before dedup, summed as the stage runner sums them."""
    return merge([StagesResult(pl.DataFrame(), {}, counters) for counters in blocks]).counters


def prepare(
    bronze: pl.DataFrame,
    config: SilverConfig,
    eval_index: EvalNgramIndex,
    fmt: RecordFormat = SFT,
    rows_per_block: int = ROWS_PER_BLOCK,
) -> Prepared:
    """``prepare_block`` on each block of ``rows_per_block`` rows of a batch, joined."""
    starts = range(0, max(bronze.height, 1), rows_per_block)
    return join_blocks(
        [
            prepare_block(bronze.slice(start, rows_per_block), config, eval_index, fmt, start)
            for start in starts
        ]
    )
