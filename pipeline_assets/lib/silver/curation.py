"""Silver's stages for one ingest batch, in order, each with its own counters (datatrove-style).

normalize -> exact dedup -> near dedup -> decontaminate -> quality gate -> language -> the user's
scorers (``lib.silver.scoring``). Every record removed by a stage is kept in ``rejects`` with the
stage and its evidence, so for every batch ``bronze rows == silver rows + rejected rows``. Cheap
stages run first: a record the heuristics reject is never given to a model.

Every record format goes through the same stages on its own fields (``lib.formats``); preference
pairs add their own rules (``lib.silver.preference_rules``): pair_sides after normalize,
contradiction after exact dedup, pair_cap last.

Every stage has one shape (``lib.stages.Stage``: a name, a function, a reject reason) and the
stage runner counts its rows and seconds. The stages that judge one record at a time are block
stages: normalize and the MinHash signatures before dedup, decontamination and the quality gate
after it. An engine runs them block by block (in this process, or on Ray); the dedup stages (and
the pair cap) look across the batch and the entries of other batches that share one of its keys
(``IndexLookup``: a task a band and slice of batches, on Ray with the block stages), on hashes and
signatures, in the calling process, the batch as one block. A batch looks up once, every format's
keys together; each format dedups against the entries holding its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import polars as pl

from pipeline_assets.lib.formats import PREFERENCE, SFT, RecordFormat
from pipeline_assets.lib.silver.decontam import DecontamConfig, EvalNgramIndex, find_contamination
from pipeline_assets.lib.silver.dedup import (
    SIGNATURE_COLUMNS,
    BandMatches,
    IndexLookup,
    entries_holding,
    exact_dedup,
    exact_hashes,
    hash_of,
    index_entries,
    near_dedup,
    wanted_keys,
    with_signatures,
)
from pipeline_assets.lib.silver.language import language_stage
from pipeline_assets.lib.silver.minhash import MinHashConfig
from pipeline_assets.lib.silver.near_edges import NearPairs, near_dedup_edges
from pipeline_assets.lib.silver.normalize import NormalizeConfig, normalize_records
from pipeline_assets.lib.silver.preference_rules import (
    MAX_PAIRS_PER_PROMPT,
    PAIR_HASH_COLUMNS,
    PAIR_SIDES_REASON,
    cap_per_prompt,
    contradictions,
    pair_hashes,
    pair_sides,
)
from pipeline_assets.lib.silver.quality import REJECT_REASON as QUALITY_REASON
from pipeline_assets.lib.silver.quality import QualityThresholds, quality_gate
from pipeline_assets.lib.silver.scorers import ScorerSpec
from pipeline_assets.lib.silver.scoring import scorer_stages
from pipeline_assets.lib.stages import (
    ROWS_PER_BLOCK,
    Stage,
    StagesResult,
    run_in_process,
    run_whole,
)

RunBlocks = Callable[[Sequence[Stage], pl.DataFrame], StagesResult]


@dataclass(frozen=True)
class SilverConfig:
    normalize: NormalizeConfig = NormalizeConfig()
    minhash: MinHashConfig = MinHashConfig()
    decontam: DecontamConfig = DecontamConfig()
    quality_default: QualityThresholds = QualityThresholds()
    quality_by_source: dict[str, QualityThresholds] = field(default_factory=dict)
    max_pairs_per_prompt: int = MAX_PAIRS_PER_PROMPT
    max_length_ratio: float | None = (
        None  # preference pairs: None counts the ratio, a number also rejects beyond it
    )
    languages: frozenset[str] = frozenset()  # empty: every language kept
    scorers: tuple[ScorerSpec, ...] = ()  # the user's models, run after every other block stage


@dataclass(frozen=True)
class CuratedBatch:
    kept: pl.DataFrame  # bronze columns (text normalized) + exact_hash, cluster_id, q_*
    rejects: pl.DataFrame  # bronze columns + stage, evidence and the stage's own evidence columns
    index: pl.DataFrame  # MinHash index entries of the kept rows
    stages: dict[str, dict]  # per stage: counters and seconds
    block_wall_seconds: float = 0.0  # waiting for the block stages, wherever they ran
    block_stage_seconds: float = (
        0.0  # the block stages' own seconds summed over every block: their work
    )
    index_lookup: dict = field(
        default_factory=dict
    )  # its keys looked up, the other batches' entries found


def before_dedup(config: SilverConfig, fmt: RecordFormat = SFT) -> list[Stage]:
    pair_rules = [
        Stage(
            "pair_sides",
            partial(pair_sides, max_length_ratio=config.max_length_ratio),
            PAIR_SIDES_REASON,
        )
    ]
    views = [Stage("views", lambda block: (fmt.with_views(block), None, {}))]
    return [
        Stage("normalize", partial(normalize_records, config=config.normalize)),
        *(pair_rules if fmt is PREFERENCE else []),
        *(views if fmt.views else []),
        Stage("minhash", lambda block: (with_signatures(block, config.minhash, fmt), None, {})),
    ]


def dedup_stages(
    config: SilverConfig,
    history: pl.LazyFrame | None,
    fmt: RecordFormat = SFT,
    pairs: NearPairs | None = None,
) -> list[Stage]:
    """The stages between the block stages: they look across the batch and ``history`` (the other
    batches' index entries holding one of its keys). With ``pairs``, the batch comes without
    signatures and near dedup clusters the verified pairs it is given."""
    pair_rules = [Stage("contradiction", partial(contradictions, history=history), "contradiction")]
    near = (
        partial(near_dedup, history=history, config=config.minhash, fmt=fmt)
        if pairs is None
        else partial(near_dedup_edges, history=history, pairs=pairs, config=config.minhash, fmt=fmt)
    )
    return [
        Stage("exact_dedup", partial(exact_dedup, history=history), "exact_dup"),
        *(pair_rules if fmt is PREFERENCE else []),
        Stage("near_dedup", near, "near_dup"),
    ]


def after_dedup(
    config: SilverConfig, eval_index: EvalNgramIndex, fmt: RecordFormat = SFT
) -> list[Stage]:
    return [
        Stage(
            "decontaminate",
            partial(find_contamination, index=eval_index, fields=fmt.decontaminate),
            "decontaminated",
        ),
        Stage(
            "quality",
            partial(
                quality_gate,
                thresholds=config.quality_by_source,
                default=config.quality_default,
                judged=fmt.judged,
            ),
            QUALITY_REASON,
        ),
        language_stage(config.languages, fmt.judged),
        *scorer_stages(config.scorers, fmt),
    ]


def last_stages(
    config: SilverConfig, history: pl.LazyFrame | None, fmt: RecordFormat = SFT
) -> list[Stage]:
    """The stages after the block stages, across the batch and ``history``: the pair cap."""
    if fmt is not PREFERENCE:
        return []
    cap = partial(cap_per_prompt, history=history, cap=config.max_pairs_per_prompt)
    return [Stage("pair_cap", cap, "pair_cap")]


@dataclass(frozen=True)
class CuratedFormats:
    formats: dict[RecordFormat, CuratedBatch]
    # the batch's one lookup, over every format's keys: keys looked up, entries found, seconds
    index_lookup: dict


@dataclass(frozen=True)
class _Prepared:
    """One format's rows through the block stages before dedup, hashed: what its dedup stages start
    from."""

    fmt: RecordFormat
    hashed: pl.DataFrame
    stages: dict[str, dict]
    removed: list[pl.DataFrame]
    block_wall_seconds: float


def curate(
    bronze: pl.DataFrame,
    look_up: IndexLookup | None,
    eval_index: EvalNgramIndex,
    config: SilverConfig,
    run_blocks: RunBlocks | None = None,
    fmt: RecordFormat = SFT,
) -> CuratedBatch:
    """``curate_formats`` on a batch of one record format."""
    return curate_formats({fmt: bronze}, look_up, eval_index, config, run_blocks).formats[fmt]


def curate_formats(
    bronze: dict[RecordFormat, pl.DataFrame],
    look_up: IndexLookup | None,
    eval_index: EvalNgramIndex,
    config: SilverConfig,
    run_blocks: RunBlocks | None = None,
) -> CuratedFormats:
    """Run the stages on one batch's bronze rows of each record format. ``look_up`` finds the index
    entries of the batches it dedups against (None: there are none), once for every format's keys;
    ``run_blocks`` runs block stages (default: here, ROWS_PER_BLOCK rows at a time)."""
    run_blocks = run_blocks or partial(run_in_process, rows_per_block=ROWS_PER_BLOCK)
    prepared = {fmt: _prepare(frame, config, run_blocks, fmt) for fmt, frame in bronze.items()}
    histories, lookup_counters = look_up_histories(
        {fmt: p.hashed for fmt, p in prepared.items()}, look_up, config.minhash
    )
    return CuratedFormats(
        formats={
            fmt: _finish(p, *histories[fmt], eval_index, config, run_blocks)
            for fmt, p in prepared.items()
        },
        index_lookup=lookup_counters,
    )


def _prepare(
    bronze: pl.DataFrame, config: SilverConfig, run_blocks: RunBlocks, fmt: RecordFormat
) -> _Prepared:
    started = time.perf_counter()
    prepared = run_blocks(before_dedup(config, fmt), bronze)
    block_wall = time.perf_counter() - started
    hashed = prepared.kept.with_columns(
        exact_hashes(prepared.kept, fmt), *(pair_hashes() if fmt is PREFERENCE else [])
    )
    return _Prepared(
        fmt, hashed, dict(prepared.counters), list(prepared.removed.values()), block_wall
    )


def look_up_histories(
    hashed: dict[RecordFormat, pl.DataFrame],
    look_up: IndexLookup | None,
    config: MinHashConfig,
    searched: Mapping[RecordFormat, BandMatches] | None = None,
) -> tuple[dict[RecordFormat, tuple[pl.LazyFrame | None, dict]], dict]:
    """One lookup over every format's keys (``hashed``: its records' exact hash and signatures,
    and a pair's hashes): each format's history (the other batches' index entries holding one of
    its own keys: all its dedup stages read of them) with its counters, and the lookup's
    counters. A format in ``searched`` had its LSH bands searched apart (and its exact hashes,
    where they name exact dedup's candidates): its entries found there are read with the others,
    and only its other hashes are looked up here."""
    started, searched = time.perf_counter(), searched or {}
    wanted = {
        fmt: wanted_keys(
            frame,
            config,
            fmt,
            lsh=fmt not in searched,
            exact=fmt not in searched or searched[fmt].exact_candidates is None,
        )
        for fmt, frame in hashed.items()
        if look_up is not None and not frame.is_empty()
    }
    apart = {fmt: searched[fmt] for fmt in wanted if fmt in searched}
    every_key = pl.concat(wanted.values()).unique() if wanted else None
    also = pl.concat([a.entries for a in apart.values()]).unique() if apart else None
    found = look_up(every_key, also) if every_key is not None else None
    histories = {fmt: (None, {"keys": 0, "entries_found": 0}) for fmt in hashed}
    for fmt, keys in wanted.items():
        # what a lookup of the format's keys alone finds
        own = entries_holding(found, keys, apart[fmt].entries if fmt in apart else None)
        searched_keys = keys.height + (apart[fmt].keys if fmt in apart else 0)
        histories[fmt] = own.lazy(), {"keys": searched_keys, "entries_found": own.height}
    keys, entries = (
        (0, 0)
        if found is None
        else (every_key.height + sum(a.keys for a in apart.values()), found.height)
    )
    return histories, {
        "keys": keys,
        "entries_found": entries,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _finish(
    prepared: _Prepared,
    history: pl.LazyFrame | None,
    lookup_counters: dict,
    eval_index: EvalNgramIndex,
    config: SilverConfig,
    run_blocks: RunBlocks,
) -> CuratedBatch:
    """The stages from exact dedup on, against ``history``."""
    fmt = prepared.fmt
    deduped = run_whole(dedup_stages(config, history, fmt), prepared.hashed)
    started = time.perf_counter()
    judged = run_blocks(
        after_dedup(config, eval_index, fmt), deduped.kept.drop("flipped_hash", strict=False)
    )
    block_wall = prepared.block_wall_seconds + time.perf_counter() - started
    last = run_whole(last_stages(config, history, fmt), judged.kept)
    removed = [
        *prepared.removed,
        *(frame for result in (deduped, judged, last) for frame in result.removed.values()),
    ]
    block_stages = (*prepared.stages.values(), *judged.counters.values())
    return CuratedBatch(
        kept=last.kept.with_columns(split_hashes(fmt)),
        rejects=pl.concat(removed, how="diagonal_relaxed").drop(
            *SIGNATURE_COLUMNS, PAIR_HASH_COLUMNS[1], strict=False
        ),
        index=_kept_entries(prepared.hashed, last.kept, config.minhash, fmt),
        stages={**prepared.stages, **deduped.counters, **judged.counters, **last.counters},
        block_wall_seconds=round(block_wall, 3),
        block_stage_seconds=round(sum(c["seconds"] for c in block_stages), 3),
        index_lookup=lookup_counters,
    )


def split_hashes(fmt: RecordFormat) -> list[pl.Expr]:
    """A conversation's ``prompt_hash``: of its normalized first user turn (an empty text without
    one), the key gold splits it by. Taken of the kept rows only, so that it never becomes an index
    key: band PROMPT_BAND holds preference pairs' prompts, which the pair cap counts."""
    if not fmt.turns:
        return []
    return [hash_of(pl.col("first_user_turn").fill_null("")).alias("prompt_hash")]


def _kept_entries(
    hashed: pl.DataFrame, kept: pl.DataFrame, config: MinHashConfig, fmt: RecordFormat
) -> pl.DataFrame:
    """The MinHash index entries of the kept rows, in their order."""
    signed = kept.select("record_id").join(hashed, on="record_id", maintain_order="left")
    return index_entries(signed, config, fmt)
