"""Asset checks on silver, per ingest batch: contracts and the pass rate block; drift and volume
report. The pass rate and the volume compare a batch with the trailing batches of each source
from the counts silver's materializations recorded, not from the tables' rows: a check's work
grows with the batches, not with the records."""

import warnings

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetKey,
    DagsterInstance,
    PreviewWarning,
    asset_check,
)

from pipeline_assets.contracts import MinhashBandEntry, MinhashIndexEntry, SilverReject
from pipeline_assets.defs.check_helpers import batch_contract_check, trailing_median_result
from pipeline_assets.defs.format_tables import FORMAT_TABLES
from pipeline_assets.defs.keys import (
    SILVER_MINHASH_BANDS,
    SILVER_MINHASH_INDEX,
    SILVER_RECORDS,
    SILVER_REJECTS,
)
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.policies import SilverPolicy
from pipeline_assets.defs.snapshots import latest_records_by_partition
from pipeline_assets.lib.delta_files import partition_values
from pipeline_assets.lib.drift import against_trailing_median
from pipeline_assets.lib.silver.health import (
    DRIFT_FEATURES,
    drift_scores,
    pass_rate_drops,
    pass_rates,
)
from pipeline_assets.resources.lake import LakeResource

warnings.filterwarnings(
    "ignore", category=PreviewWarning, message=".*partitions_def on an AssetCheckSpec"
)

# the counts silver records in its materializations' metadata, which these checks read: each format
# table's kept rows by source, and silver/rejects' rows by source and stage
KEPT_BY_SOURCE, REJECTED_BY_STAGE = "kept_by_source", "rejected_by_stage"


def _kept_counts(instance: DagsterInstance, lake: LakeResource, batch_id: str) -> pl.DataFrame:
    """Kept rows (records, pairs and conversations) per (batch_id, source) up to this batch."""
    kept = [
        _counts_by_batch(instance, lake, tables.silver, KEPT_BY_SOURCE, batch_id, ["source"])
        for tables in FORMAT_TABLES
    ]
    return (
        pl.concat(kept).group_by("batch_id", "source").agg(kept=pl.col("rows").sum().cast(pl.Int64))
    )


def _removed_counts(instance: DagsterInstance, lake: LakeResource, batch_id: str) -> pl.DataFrame:
    """Rejects per (batch_id, source, stage) up to this batch."""
    return _counts_by_batch(
        instance, lake, SILVER_REJECTS, REJECTED_BY_STAGE, batch_id, ["source", "stage"]
    ).select("batch_id", "source", "stage", removed=pl.col("rows").cast(pl.Int64))


def _counts_by_batch(
    instance: DagsterInstance,
    lake: LakeResource,
    key: AssetKey,
    name: str,
    batch_id: str,
    by: list[str],
) -> pl.DataFrame:
    """Rows per (batch_id, *by) of ``key``'s table up to ``batch_id``: each batch's from the table
    ``name`` in the metadata of its latest materialization (what silver counted as it wrote the
    partition), so a check reads no row of the table; a batch without it (written by an older
    version) counted from its own partition."""
    schema = {"batch_id": pl.String, **dict.fromkeys(by, pl.String), "rows": pl.Int64}
    counted, uncounted = [pl.DataFrame(schema=schema)], []
    latest = latest_records_by_partition(instance, key)
    table = lake.table(*key.path)
    batches = set() if table is None else partition_values(table, "batch_id")
    for batch in sorted(b for b in batches if b <= batch_id):
        record = latest.get(batch)
        metadata = record.asset_materialization.metadata.get(name) if record else None
        if metadata is None:
            uncounted.append(batch)
            continue
        rows = [{"batch_id": batch, **row.data} for row in metadata.value.records]
        counted.append(pl.DataFrame(rows, schema=schema, orient="row"))
    if uncounted:
        counted.append(
            lake.scan(*key.path)
            .filter(pl.col("batch_id").is_in(uncounted))
            .group_by("batch_id", *by)
            .agg(rows=pl.len().cast(pl.Int64))
            .collect(engine="streaming")
            .select(list(schema))
        )
    return pl.concat(counted)


@asset_check(
    asset=SILVER_RECORDS,
    name="pass_rate",
    blocking=True,
    partitions_def=ingest_batches,
    additional_deps=[SILVER_REJECTS],
    description="No source's pass rate falls more than the allowed points below its trailing "
    "median.",
)
def silver_pass_rate(
    context: AssetCheckExecutionContext, lake: LakeResource, silver_policy: SilverPolicy
) -> AssetCheckResult:
    batch_id = context.partition_key
    kept = _kept_counts(context.instance, lake, batch_id)
    removed = _removed_counts(context.instance, lake, batch_id)
    drops = pass_rate_drops(
        pass_rates(kept, removed), removed, batch_id, silver_policy.trailing_batches
    )
    limit = silver_policy.max_pass_rate_drop
    fallen = drops.filter(pl.col("drop") > limit)
    description = (
        "; ".join(
            f"source '{r['source']}': pass rate fell from {r['baseline']:.0%} to "
            f"{r['pass_rate']:.0%} ({r['drop'] * 100:.0f} points, limit {limit * 100:.0f}); most "
            f"of the difference was removed by {r['blamed_stage']} "
            f"(+{r['blamed_growth'] * 100:.0f} points of the batch)"
            for r in fallen.iter_rows(named=True)
        )
        or f"every source within {limit * 100:.0f} points of its trailing median"
    )
    return AssetCheckResult(
        passed=fallen.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        description=description,
        metadata={"max_drop_points": limit * 100, "pass_rates": table_metadata(drops)},
    )


@asset_check(
    asset=SILVER_RECORDS,
    name="drift",
    partitions_def=ingest_batches,
    description="PSI of response length, source mix, language mix and quality-rule values against "
    "trailing batches.",
)
def silver_drift(
    context: AssetCheckExecutionContext, lake: LakeResource, silver_policy: SilverPolicy
) -> AssetCheckResult:
    batch_id = context.partition_key
    table = lake.table("silver", "records")
    earlier = sorted(b for b in partition_values(table, "batch_id") if b < batch_id)
    trailing_ids = earlier[-silver_policy.trailing_batches :]
    history = (  # the trailing batches' rows and this one's, never every earlier batch's
        pl.scan_delta(table)
        .filter(pl.col("batch_id").is_in([*trailing_ids, batch_id]))
        .select("batch_id", *DRIFT_FEATURES)
        .collect()
    )
    reference = history.filter(pl.col("batch_id") != batch_id)
    current = history.filter(pl.col("batch_id") == batch_id)
    if min(reference.height, current.height) < silver_policy.drift_min_rows:
        return AssetCheckResult(
            passed=True,
            description=f"not judged: {current.height} rows against {reference.height} from "
            f"{len(trailing_ids)} earlier batch(es); drift needs {silver_policy.drift_min_rows} on "
            "each side",
            metadata={
                "reference_batches": len(trailing_ids),
                "rows": current.height,
                "reference_rows": reference.height,
            },
        )
    scores = drift_scores(reference, current)
    worst_name, worst = max(scores.items(), key=lambda item: item[1])
    drifted = {name: score for name, score in scores.items() if score >= silver_policy.psi_warn}
    severity = (
        AssetCheckSeverity.ERROR if worst >= silver_policy.psi_fail else AssetCheckSeverity.WARN
    )
    return AssetCheckResult(
        passed=not drifted,
        severity=severity,
        description=(
            "; ".join(
                f"{name} PSI {score:.2f}"
                for name, score in sorted(drifted.items(), key=lambda i: -i[1])
            )
            + f" (warn at {silver_policy.psi_warn}, fail at {silver_policy.psi_fail})"
        )
        if drifted
        else f"stable: worst {worst_name} PSI {worst:.3f}",
        metadata={
            "reference_batches": len(trailing_ids),
            "psi": table_metadata(
                pl.DataFrame(
                    {"feature": list(scores), "psi": [round(v, 4) for v in scores.values()]}
                )
            ),
            "worst_psi": round(worst, 4),
        },
    )


@asset_check(
    asset=SILVER_RECORDS,
    name="volume",
    partitions_def=ingest_batches,
    description="Each source's kept rows are within tolerance of its trailing median.",
)
def silver_volume(
    context: AssetCheckExecutionContext, lake: LakeResource, silver_policy: SilverPolicy
) -> AssetCheckResult:
    batch_id = context.partition_key
    judged = against_trailing_median(
        _kept_counts(context.instance, lake, batch_id).rename({"kept": "rows"}),
        batch_id,
        "rows",
        silver_policy.trailing_batches,
    )
    return trailing_median_result(judged, silver_policy.volume_tolerance, "rows", "rows_by_source")


silver_checks = [
    *(batch_contract_check(tables.silver, tables.silver_contract) for tables in FORMAT_TABLES),
    batch_contract_check(SILVER_REJECTS, SilverReject),
    batch_contract_check(SILVER_MINHASH_INDEX, MinhashIndexEntry),
    batch_contract_check(SILVER_MINHASH_BANDS, MinhashBandEntry),
    silver_pass_rate,
    silver_drift,
    silver_volume,
]
