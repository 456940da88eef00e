"""Silver's stages for one ingest batch, in order, each with its own counters (datatrove-style).

normalize -> exact dedup -> near dedup -> decontaminate -> quality gate. Every record removed by
a stage is kept in ``rejects`` with the stage and its evidence, so for every batch
``bronze rows == silver rows + rejected rows``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import polars as pl

from pipeline_assets.lib.decontam import DecontamConfig, EvalNgramIndex, find_contamination
from pipeline_assets.lib.dedup import exact_dedup, near_dedup
from pipeline_assets.lib.minhash import MinHashConfig
from pipeline_assets.lib.normalize import NormalizeConfig, normalize_records
from pipeline_assets.lib.quality import QualityThresholds, quality_gate


@dataclass(frozen=True)
class SilverConfig:
    normalize: NormalizeConfig = NormalizeConfig()
    minhash: MinHashConfig = MinHashConfig()
    decontam: DecontamConfig = DecontamConfig()
    quality_default: QualityThresholds = QualityThresholds()
    quality_by_source: dict[str, QualityThresholds] = field(default_factory=dict)


@dataclass(frozen=True)
class CuratedBatch:
    kept: pl.DataFrame  # bronze columns (text normalized) + exact_hash, cluster_id, q_*
    rejects: pl.DataFrame  # bronze columns + stage, evidence and the stage's own evidence columns
    index: pl.DataFrame  # MinHash index entries of the kept rows
    stages: dict[str, dict]  # per stage: counters and seconds


def curate(bronze: pl.DataFrame, history: pl.LazyFrame | None, eval_index: EvalNgramIndex, config: SilverConfig) -> CuratedBatch:
    """Run the stages on one batch of bronze rows; ``history`` is the MinHash index of the batches it dedups against."""
    stages: dict[str, dict] = {}

    started = time.perf_counter()
    normalized, counters = normalize_records(bronze, config.normalize)
    stages["normalize"] = _finished(counters, started)

    started = time.perf_counter()
    exact = exact_dedup(normalized, history)
    stages["exact_dedup"] = _finished(exact.counters, started)

    started = time.perf_counter()
    near, index = near_dedup(exact.kept, history, config.minhash)
    stages["near_dedup"] = _finished(near.counters, started)

    started = time.perf_counter()
    clean, contaminated, counters = find_contamination(near.kept, eval_index)
    stages["decontaminate"] = _finished(counters, started)

    started = time.perf_counter()
    kept, low_quality, counters = quality_gate(clean, config.quality_by_source, config.quality_default)
    stages["quality"] = _finished(counters, started)

    rejects = pl.concat([exact.rejected, near.rejected, contaminated, low_quality], how="diagonal_relaxed")
    return CuratedBatch(
        kept=kept,
        rejects=rejects,
        index=index.filter(pl.col("record_id").is_in(kept["record_id"].implode())),
        stages=stages,
    )


def _finished(counters: dict, started: float) -> dict:
    return {**counters, "seconds": round(time.perf_counter() - started, 3)}
