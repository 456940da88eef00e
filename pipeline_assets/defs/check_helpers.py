"""What every layer's asset checks share: reading one batch of a table, judging a contract."""

from collections.abc import Callable, Iterable, Iterator

import pandera.errors
import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetKey,
    DagsterInstance,
    MetadataValue,
    asset_check,
)

from pipeline_assets.defs.dagster_private import AssetCheckExecutionRecordStatus
from pipeline_assets.defs.metadata import table_metadata
from pipeline_assets.defs.partitions import ingest_batches
from pipeline_assets.defs.retries import refusal
from pipeline_assets.lib.delta_files import partition_slices
from pipeline_assets.resources.lake import LakeResource


def batch_of(lake: LakeResource, layer: str, name: str, batch_id: str) -> pl.DataFrame:
    frame = lake.read(layer, name, where=pl.col("batch_id") == batch_id)
    if frame is None:
        raise refusal(f"{layer}/{name} does not exist yet: materialize it first")
    return frame


BYTES_PER_CHECK_SLICE = 32 * 2**20  # the Arrow bytes of a batch a contract check holds at a time


def batch_contract_check(key: AssetKey, model) -> AssetChecksDefinition:
    """The blocking check ``contract`` of a table partitioned by ingest batch: the batch's rows
    satisfy ``model``."""

    @asset_check(
        asset=key,
        name="contract",
        blocking=True,
        partitions_def=ingest_batches,
        description=f"The batch's rows satisfy the {model.__name__} contract.",
    )
    def check(context: AssetCheckExecutionContext, lake: LakeResource) -> AssetCheckResult:
        table = lake.table(*key.path)  # opened once: each pass reads the same version
        if table is None:
            raise refusal(f"{key.to_user_string()} does not exist yet: materialize it first")

        def slices() -> Iterator[pl.DataFrame]:
            return partition_slices(table, "batch_id", context.partition_key, BYTES_PER_CHECK_SLICE)

        return sliced_contract_result(slices, model)

    return check


def contract_check_result(
    frame: pl.DataFrame, model, check_name: str | None = None
) -> AssetCheckResult:
    """``check_name`` names the result when an asset emits it for one of its own check specs."""
    return sliced_contract_result(lambda: iter([frame]), model, check_name)


def sliced_contract_result(
    slices: Callable[[], Iterator[pl.DataFrame]], model, check_name: str | None = None
) -> AssetCheckResult:
    """``model`` judged a slice of rows at a time (``slices()`` gives them, and again when asked):
    each slice by every check but uniqueness; uniqueness over every slice from a 64-bit hash of
    each row's key, the rows whose hash repeats read again and compared whole. Memory: a slice,
    and 8 bytes a row for each unique key (twice while they are sorted)."""
    schema = model.to_schema()
    keys = [[name] for name, column in schema.columns.items() if column.unique]
    keys += [list(schema.unique)] if schema.unique else []
    per_slice = schema.update_columns({key[0]: {"unique": False} for key in keys if len(key) == 1})
    per_slice.unique = None
    rows, cases, hashes = 0, [], [[] for _ in keys]
    for frame in slices():
        rows += frame.height
        try:
            per_slice.validate(frame, lazy=True)
        except pandera.errors.SchemaErrors as errors:
            cases.append(errors.failure_cases)
        for held, key in zip(hashes, keys, strict=True):
            held.append(frame.select(pl.struct(key).hash()).to_series())
    for held, key in zip(hashes, keys, strict=True):
        cases += _repeated_keys(slices, key, pl.concat(held) if held else pl.Series([]))
    found = pl.concat(cases, how="diagonal_relaxed") if cases else pl.DataFrame()
    return _contract_result(rows, found, model, check_name)


def _repeated_keys(slices, key: list[str], hashes: pl.Series) -> list[pl.DataFrame]:
    """A failure case a row whose ``key`` another row has too, as pandera reports a unique
    column's."""
    ordered = hashes.sort()  # neighbours: no hash table as large as the batch's keys
    repeated = ordered.filter(ordered == ordered.shift(1)).unique()
    if repeated.is_empty():
        return []
    candidates = pl.concat(
        frame.select(key).filter(pl.struct(key).hash().is_in(repeated.implode()))
        for frame in slices()
    )
    twice = candidates.filter(pl.struct(key).is_duplicated())
    if twice.is_empty():
        return []
    return [
        twice.select(
            failure_case=pl.struct(key).struct.json_encode(),
            column=pl.lit(", ".join(key)),
            check=pl.lit("unique"),
        )
    ]


def _contract_result(
    rows: int, cases: pl.DataFrame, model, check_name: str | None = None
) -> AssetCheckResult:
    if cases.is_empty():
        return AssetCheckResult(
            check_name=check_name, passed=True, metadata={"rows": rows, "failure_cases": 0}
        )
    return AssetCheckResult(
        check_name=check_name,
        passed=False,
        metadata={
            "rows": rows,
            "failure_cases": len(cases),
            "failures": MetadataValue.md(f"```\n{str(cases.head(20))}\n```"),
        },
        description=f"{model.__name__} contract broken in {len(cases)} place(s)",
    )


def trailing_median_result(
    judged: pl.DataFrame, tolerance: float, unit: str, metadata_name: str
) -> AssetCheckResult:
    """A warning per source whose value strays more than ``tolerance`` from its trailing median.

    ``judged`` comes from lib.drift.against_trailing_median (source, current, baseline,
    deviation); a source without history is named, not judged.
    """
    off = judged.filter(pl.col("deviation").abs() > tolerance)
    without_history = judged.filter(pl.col("baseline").is_null())["source"].to_list()
    description = (
        "; ".join(
            f"source '{r['source']}': {r['current']:.4g} {unit} vs trailing median "
            f"{r['baseline']:.4g} ({r['deviation']:+.0%})"
            for r in off.iter_rows(named=True)
        )
        or f"every source within ±{tolerance:.0%} of its trailing median"
    )
    if without_history:
        description += f" (no history yet for: {', '.join(without_history)})"
    return AssetCheckResult(
        passed=off.is_empty(),
        severity=AssetCheckSeverity.WARN,
        description=description,
        metadata={"tolerance": tolerance, metadata_name: table_metadata(judged)},
    )


def partitions_failing_blocking_checks(
    instance: DagsterInstance, checks: Iterable[AssetChecksDefinition]
) -> set[tuple[str, AssetKey]]:
    """(partition, asset) pairs whose latest run of a blocking check failed."""
    return partitions_failing(
        instance, [spec for definition in checks for spec in definition.check_specs]
    )


def partitions_failing(
    instance: DagsterInstance, specs: Iterable[AssetCheckSpec]
) -> set[tuple[str, AssetKey]]:
    """``partitions_failing_blocking_checks`` of these check specs (the blocking ones)."""
    return partitions_failing_checks(instance, [spec.key for spec in specs if spec.blocking])


def partitions_failing_checks(
    instance: DagsterInstance, keys: list[AssetCheckKey]
) -> set[tuple[str, AssetKey]]:
    """(partition, asset) pairs whose latest run of one of these checks failed."""
    infos = instance.event_log_storage.get_asset_check_partition_info(keys) if keys else []
    return {
        (info.partition_key, info.check_key.asset_key)
        for info in infos
        if info.latest_execution_status == AssetCheckExecutionRecordStatus.FAILED
    }
