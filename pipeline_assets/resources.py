"""Settings from the environment (the README's Settings table) and the resources built from them.

A fresh checkout runs with no configuration: everything lives under ``./.pipeline``. Assets never
build paths or clients themselves: they ask the lake and landing resources.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
from botocore.exceptions import ClientError
from dagster import ConfigurableResource, EnvVar, PipesSubprocessClient
from dagster_aws.s3 import S3Resource
from deltalake import DeltaTable, WriterProperties, write_deltalake
from deltalake.exceptions import TableNotFoundError
from pydantic import Field, ValidationError

from pipeline_assets.engine import BlockEngine, KubeRayEngine, RayEngine
from pipeline_assets.lib import uris
from pipeline_assets.lib.cost import Prices
from pipeline_assets.lib.decontam import DecontamConfig, read_eval_sets
from pipeline_assets.lib.formats import FORMATS, PREFERENCE, SFT, RecordFormat, format_named
from pipeline_assets.lib.gold import DEFAULT_LONG_RECORDS, LONG_RECORD_MODES
from pipeline_assets.lib.locks import FileLock, S3Lease
from pipeline_assets.lib.minhash import MinHashConfig
from pipeline_assets.lib.normalize import NormalizeConfig
from pipeline_assets.lib.preference_gold import (
    VALIDATION_FRACTION as PREFERENCE_VALIDATION_FRACTION,
)
from pipeline_assets.lib.preference_rules import MAX_PAIRS_PER_PROMPT
from pipeline_assets.lib.promotion import rollback_target
from pipeline_assets.lib.quality import QualityThresholds
from pipeline_assets.lib.replay import ROLLOUT_SOURCE
from pipeline_assets.lib.retention import Removed
from pipeline_assets.lib.silver import SilverConfig
from pipeline_assets.lib.stages import RAY_MIN_ROWS
from pipeline_assets.lib.torchrun import TRAINER_MODULE, torchrun_command, torchrun_env
from pipeline_assets.trainer.config import DEFAULT_BETA as _DPO_BETA
from pipeline_assets.trainer.config import (
    DPO_EVAL_EVERY,
    DPO_LOG_EVERY,
    DPO_LR,
    DPO_STEPS,
    DPO_WARMUP_STEPS,
    PRESETS,
    TrainConfig,
)
from pipeline_assets.trainer.storage import CheckpointStore, local_scratch


def _env(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def _through_env(name: str, value: str) -> str:
    """``value`` as a resource's config: ``EnvVar(name)`` when it came from that variable, so Dagster
    shows the name, never the value (a URI with a password), in the UI, run config and events."""
    return EnvVar(name) if os.environ.get(name, "").strip() == value else value


def _resolved(value: str) -> str:
    """A config value as the resource sees it: Dagster resolves an ``EnvVar`` when it runs the resource;
    a resource used outside a run (the CLI) reads the variable itself."""
    return (value.get_value() or "").strip() if isinstance(value, EnvVar) else value


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


def _non_negative_env(name: str, default: float) -> float:
    value = _float_env(name, default)
    if value < 0:
        raise ValueError(f"{name}={value:g} must be zero or more")
    return value


def _count_env(name: str, default: int) -> int:
    value = _float_env(name, default)
    if value < 1:
        raise ValueError(f"{name}={value:g} must be 1 or more")
    return int(value)


def _length_ratio_env(name: str) -> float:
    value = _non_negative_env(name, 0.0)
    if 0 < value <= 1:
        raise ValueError(
            f"{name}={value:g} must be more than 1 (a ratio of lengths), or 0 to only count it"
        )
    return value


def _choice_env(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _env(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")
    return value


def _kuberay_env() -> str:
    path = _env("PIPELINE_KUBERAY", "")
    if path and os.environ.get("RAY_ADDRESS"):
        raise ValueError(
            "RAY_ADDRESS and PIPELINE_KUBERAY are both set: the data layers run on one Ray cluster, name one"
        )
    return path


def _json_env(name: str) -> dict:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value


def parse_field_mappings(raw: str) -> dict[str, dict[str, str]]:
    """``{"<source>": {"<their field>": "<our field>"}}``, e.g. ``{"logs": {"completion": "response"}}``."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"PIPELINE_FIELD_MAPPINGS is not valid JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(
        isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())
        for m in value.values()
    ):
        raise ValueError(
            'PIPELINE_FIELD_MAPPINGS must look like {"<source>": {"<their field>": "<our field>"}}'
        )
    return value


def parse_source_formats(raw: str) -> dict[str, str]:
    """``{"<source>": "<record format>"}``, e.g. ``{"prefs": "preference"}``; a source not named is sft."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"PIPELINE_SOURCE_FORMATS is not valid JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError('PIPELINE_SOURCE_FORMATS must look like {"<source>": "<record format>"}')
    unknown = sorted({v for v in value.values() if v not in FORMATS})
    if unknown:
        raise ValueError(
            f"PIPELINE_SOURCE_FORMATS names unknown record format(s) {', '.join(unknown)}; one of {', '.join(FORMATS)}"
        )
    return value


_PRICES = Prices()  # the default prices, one place
_RETENTION_DAYS = 7.0
_SEARCH_FRACTION = 0.02  # the default share of records hyperparameter search selects on, one place
_TOKENIZER_SAMPLE_CHARS = 100_000_000  # the default cap on the tokenizer's training text, one place


@dataclass(frozen=True)
class Settings:
    home: str
    landing_uri: str
    lake_uri: str
    checkpoint_uri: str
    eval_sets_uri: str
    mlflow_tracking_uri: str
    dagster_home: str
    field_mappings: dict[str, dict[str, str]] = field(default_factory=dict)
    source_formats: dict[str, str] = field(default_factory=dict)
    max_quarantine_rate: float = 0.05
    volume_tolerance: float = 0.20
    freshness_sla_hours: float = 24.0
    quality_thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    max_pairs_per_prompt: int = MAX_PAIRS_PER_PROMPT
    max_length_ratio: float = (
        0.0  # preference pairs: 0 counts the ratio only, a number also rejects beyond it
    )
    tokenizer_path: str = ""
    seq_len: int = 512
    vocab_size: int = 8192
    tokenizer_sample_chars: int = _TOKENIZER_SAMPLE_CHARS
    long_records: str = DEFAULT_LONG_RECORDS
    validation_fraction: float = 0.02
    preference_validation_fraction: float = PREFERENCE_VALIDATION_FRACTION
    search_fraction: float = _SEARCH_FRACTION
    shuffle_seed: int = 20261121
    snapshot_min_new_fraction: float = 0.10
    train_nproc: int = 2
    train_threads_per_rank: int = 1
    train_device: str = "auto"
    train_preset: str = "tiny"
    train_steps: int = 200
    dpo_steps: int = DPO_STEPS
    dpo_lr: float = DPO_LR
    dpo_beta: float = _DPO_BETA
    train_checkpoint_every: int = 50
    mlflow_artifact_root: str = ""
    model_name: str = "sft-model"
    dpo_model_name: str = "dpo-model"
    core_hour_usd: float = _PRICES.core_hour
    gpu_hour_usd: float = _PRICES.gpu_hour
    spot_discount: float = _PRICES.spot_discount
    promotion_margin: float = 0.005
    slice_tolerance: float = 0.02
    eval_max_tokens: int = 2_000_000
    mlflow_experiment: str = "pipeline_assets"
    mlflow_ui_url: str = "http://127.0.0.1:5000"
    executor: str = "in_process"
    retry_delay_seconds: float = 10.0
    s3_max_attempts: int = 6  # AWS_MAX_ATTEMPTS: tries of one S3 request, the first included
    retention_days: float = _RETENTION_DAYS
    ray_min_rows: int = RAY_MIN_ROWS
    kuberay_config: str = ""  # a file of dagster-ray KubeRayInteractiveJob settings; empty: RAY_ADDRESS or a local Ray

    def prices(self) -> Prices:
        return Prices(
            core_hour=self.core_hour_usd,
            gpu_hour=self.gpu_hour_usd,
            spot_discount=self.spot_discount,
        )

    @classmethod
    def from_env(cls) -> "Settings":
        home = str(Path(_env("PIPELINE_HOME", "./.pipeline")).resolve())
        return cls(
            home=home,
            landing_uri=_env("PIPELINE_LANDING_URI", f"{home}/landing"),
            lake_uri=_env("PIPELINE_LAKE_URI", f"{home}/lake"),
            checkpoint_uri=_env("PIPELINE_CHECKPOINT_URI", f"{home}/checkpoints"),
            eval_sets_uri=_env("PIPELINE_EVAL_SETS_URI", f"{home}/reference/eval_sets"),
            mlflow_tracking_uri=_env("MLFLOW_TRACKING_URI", f"sqlite:///{home}/mlflow.db"),
            dagster_home=_env("DAGSTER_HOME", f"{home}/dagster"),
            field_mappings=parse_field_mappings(os.environ.get("PIPELINE_FIELD_MAPPINGS", "")),
            source_formats=parse_source_formats(os.environ.get("PIPELINE_SOURCE_FORMATS", "")),
            max_quarantine_rate=_float_env("PIPELINE_MAX_QUARANTINE_RATE", 0.05),
            volume_tolerance=_float_env("PIPELINE_VOLUME_TOLERANCE", 0.20),
            freshness_sla_hours=_float_env("PIPELINE_FRESHNESS_SLA_HOURS", 24.0),
            quality_thresholds=_json_env("PIPELINE_QUALITY_THRESHOLDS"),
            max_pairs_per_prompt=_count_env("PIPELINE_MAX_PAIRS_PER_PROMPT", MAX_PAIRS_PER_PROMPT),
            max_length_ratio=_length_ratio_env("PIPELINE_PREFERENCE_MAX_LENGTH_RATIO"),
            tokenizer_path=_env("PIPELINE_TOKENIZER", ""),
            seq_len=int(_float_env("PIPELINE_SEQ_LEN", 512)),
            vocab_size=int(_float_env("PIPELINE_VOCAB_SIZE", 8192)),
            tokenizer_sample_chars=_count_env(
                "PIPELINE_TOKENIZER_SAMPLE_CHARS", _TOKENIZER_SAMPLE_CHARS
            ),
            long_records=_choice_env(
                "PIPELINE_LONG_RECORDS", DEFAULT_LONG_RECORDS, LONG_RECORD_MODES
            ),
            validation_fraction=_float_env("PIPELINE_VALIDATION_FRACTION", 0.02),
            preference_validation_fraction=_float_env(
                "PIPELINE_PREFERENCE_VALIDATION_FRACTION", PREFERENCE_VALIDATION_FRACTION
            ),
            search_fraction=_float_env("PIPELINE_SEARCH_FRACTION", _SEARCH_FRACTION),
            shuffle_seed=int(_float_env("PIPELINE_SHUFFLE_SEED", 20261121)),
            snapshot_min_new_fraction=_float_env("PIPELINE_SNAPSHOT_MIN_NEW_FRACTION", 0.10),
            train_nproc=int(_float_env("PIPELINE_TRAIN_NPROC", 2)),
            train_threads_per_rank=int(_float_env("PIPELINE_TRAIN_THREADS_PER_RANK", 1)),
            train_device=_env("PIPELINE_TRAIN_DEVICE", "auto"),
            train_preset=_env("PIPELINE_TRAIN_PRESET", "tiny"),
            train_steps=int(_float_env("PIPELINE_TRAIN_STEPS", 200)),
            dpo_steps=_count_env("PIPELINE_DPO_STEPS", DPO_STEPS),
            dpo_lr=_float_env("PIPELINE_DPO_LR", DPO_LR),
            dpo_beta=_float_env("PIPELINE_DPO_BETA", _DPO_BETA),
            train_checkpoint_every=int(_float_env("PIPELINE_TRAIN_CHECKPOINT_EVERY", 50)),
            mlflow_artifact_root=_env("PIPELINE_MLFLOW_ARTIFACT_URI", f"{home}/mlartifacts"),
            model_name=_env("PIPELINE_MODEL_NAME", "sft-model"),
            dpo_model_name=_env("PIPELINE_DPO_MODEL_NAME", "dpo-model"),
            core_hour_usd=_float_env("PIPELINE_PRICE_CORE_HOUR", _PRICES.core_hour),
            gpu_hour_usd=_float_env("PIPELINE_PRICE_GPU_HOUR", _PRICES.gpu_hour),
            spot_discount=_float_env("PIPELINE_SPOT_DISCOUNT", _PRICES.spot_discount),
            promotion_margin=_float_env("PIPELINE_PROMOTION_MARGIN", 0.005),
            slice_tolerance=_float_env("PIPELINE_SLICE_TOLERANCE", 0.02),
            eval_max_tokens=int(_float_env("PIPELINE_EVAL_MAX_TOKENS", 2_000_000)),
            mlflow_experiment=_env("PIPELINE_MLFLOW_EXPERIMENT", "pipeline_assets"),
            mlflow_ui_url=_env("PIPELINE_MLFLOW_UI_URL", "http://127.0.0.1:5000"),
            executor=_env("PIPELINE_EXECUTOR", "in_process"),
            retry_delay_seconds=_float_env("PIPELINE_RETRY_DELAY_SECONDS", 10.0),
            s3_max_attempts=int(_float_env("AWS_MAX_ATTEMPTS", 6)),
            retention_days=_non_negative_env("PIPELINE_RETENTION_DAYS", _RETENTION_DAYS),
            ray_min_rows=int(_non_negative_env("PIPELINE_RAY_MIN_ROWS", RAY_MIN_ROWS)),
            kuberay_config=_kuberay_env(),
        )


# --- Lake ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaCommit:
    """What a write produced: the table version, where it lives, and how long it took."""

    uri: str
    version: int
    rows: int
    bytes_in_memory: int
    wall_seconds: float
    cpu_seconds: float


_PARTITION_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class LakeResource(ConfigurableResource):
    """Delta tables at ``<uri>/<layer>/<name>``, on a local path or ``s3://``."""

    uri: str = Field(description="root of the lake: a local path or s3://bucket/prefix")
    lock_timeout_seconds: float = Field(
        default=300.0, description="how long a writer waits for a table's lock"
    )
    lease_seconds: float = Field(
        default=60.0,
        description="s3:// lake: a lock whose holder died is taken over this long after its last renewal",
    )

    def table_uri(self, layer: str, name: str) -> str:
        return uris.join(self.uri, layer, name)

    def storage_options(self) -> dict[str, str] | None:
        return uris.delta_storage_options(self.uri)

    def lock(self, layer: str, name: str) -> FileLock | S3Lease:
        """One process at a time in a read-modify-write of a table (Delta appends never conflict):
        ``<lake>/<layer>/_<name>.lock``, released when its holder exits or dies."""
        lock_uri = uris.join(self.uri, layer, f"_{name}.lock")
        if not uris.is_s3(lock_uri):
            return FileLock(lock_uri, timeout=self.lock_timeout_seconds)
        return S3Lease(
            self._s3_client(),
            lock_uri,
            timeout=self.lock_timeout_seconds,
            ttl_seconds=self.lease_seconds,
        )

    def table(self, layer: str, name: str, version: int | None = None) -> DeltaTable | None:
        try:
            return DeltaTable(
                self.table_uri(layer, name), version=version, storage_options=self.storage_options()
            )
        except TableNotFoundError:
            return None

    def version(self, layer: str, name: str) -> int | None:
        table = self.table(layer, name)
        return None if table is None else table.version()

    def scan(self, layer: str, name: str, version: int | None = None) -> pl.LazyFrame | None:
        """A lazy scan (partition pruning applies to filters), or None while the table does not exist."""
        table = self.table(layer, name, version)
        return None if table is None else pl.scan_delta(table)

    def read(
        self, layer: str, name: str, *, version: int | None = None, where: pl.Expr | None = None
    ) -> pl.DataFrame | None:
        scan = self.scan(layer, name, version)
        if scan is None:
            return None
        return (scan if where is None else scan.filter(where)).collect()

    def replace_partition(
        self,
        layer: str,
        name: str,
        frame: pl.DataFrame,
        *,
        column: str,
        value: str,
        add_columns: bool = False,
        rows_per_group: int | None = None,
        partition_by: tuple[str, ...] = (),
    ) -> DeltaCommit:
        """Atomically replace every row whose ``column`` equals ``value`` (Delta's replaceWhere).

        ``add_columns``: columns the table lacks are added (null in its older rows), for a table
        written before its contract gained a nullable column. ``rows_per_group``: as in ``overwrite``.
        ``partition_by``: the table's partition columns, when more than ``column``."""
        _check_partition(layer, name, frame, column, value)
        return self._write(
            layer,
            name,
            frame,
            mode="overwrite",
            partition_by=list(partition_by or [column]),
            predicate=f"{column} = '{value}'",
            **({"schema_mode": "merge"} if add_columns else {}),
            **_row_groups(rows_per_group),
        )

    def replace_partition_streaming(
        self,
        layer: str,
        name: str,
        frames: Iterable[pl.DataFrame],
        schema: pl.Schema,
        *,
        column: str,
        value: str,
        rows_per_group: int,
    ) -> DeltaCommit:
        """``replace_partition`` of the rows of ``frames`` (each of ``schema``), written as they come.
        delta-rs encodes a row group once it holds ``rows_per_group`` rows (by default only at the
        end, a million rows): a few frames' worth lets the encoding of one overlap the making of the
        next. Nothing is committed unless every frame was made; an exception raised while making one
        is raised here."""
        checked = (_check_partition(layer, name, frame, column, value) for frame in frames)
        return self._write_frames(
            layer,
            name,
            checked,
            schema,
            mode="overwrite",
            partition_by=[column],
            predicate=f"{column} = '{value}'",
            **_row_groups(rows_per_group),
        )

    def append(self, layer: str, name: str, frame: pl.DataFrame) -> DeltaCommit:
        return self._write(layer, name, frame, mode="append")

    def overwrite(
        self, layer: str, name: str, frame: pl.DataFrame, rows_per_group: int | None = None
    ) -> DeltaCommit:
        """A new version holding only ``frame``; earlier versions stay readable by time travel.
        ``rows_per_group``: the Parquet row-group size, for tables read a range of rows at a time."""
        return self._write(layer, name, frame, mode="overwrite", **_row_groups(rows_per_group))

    def tables(self) -> list[tuple[str, str]]:
        """Every Delta table of the lake, as (layer, name)."""
        if not uris.is_s3(self.uri):
            return sorted(
                (log.parent.parent.name, log.parent.name)
                for log in Path(self.uri).glob("*/*/_delta_log")
            )
        bucket, prefix = uris.split_s3(self.uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        pages = (
            self._s3_client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=prefix)
        )
        found = set()
        for page in pages:
            for item in page.get("Contents", []):
                parts = item["Key"][len(prefix) :].split("/")
                if len(parts) > 3 and parts[2] == "_delta_log":
                    found.add((parts[0], parts[1]))
        return sorted(found)

    def vacuum(
        self, layer: str, name: str, retention_hours: float, keep_versions: list[int]
    ) -> Removed:
        """Delete the files no version newer than ``retention_hours`` and none of ``keep_versions``
        reads. Delta's vacuum picks them; they are deleted here, so that the table gains no version
        (a ``gold-v<N>`` snapshot stays the table's newest version until the next one is cut)."""
        table = self.table(layer, name)
        if table is None:
            return Removed()
        doomed = table.vacuum(
            retention_hours=int(retention_hours),
            dry_run=True,
            enforce_retention_duration=False,
            keep_versions=keep_versions,
        )
        table_uri = self.table_uri(layer, name)
        paths = [
            path if path.startswith(("/", uris.S3_PREFIX)) else uris.join(table_uri, path)
            for path in doomed
        ]
        return self._delete_files(paths)

    def _delete_files(self, paths: list[str]) -> Removed:
        """Delete these files; a file already gone counts for nothing."""
        removed = Removed()
        for path in paths:
            if not uris.is_s3(path):
                local = Path(path)
                if local.is_file():
                    removed += Removed(1, local.stat().st_size)
                    local.unlink()
                continue
            bucket, key = uris.split_s3(path)
            client = self._s3_client()
            try:
                size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
            except ClientError:
                continue  # already gone
            client.delete_object(Bucket=bucket, Key=key)
            removed += Removed(1, size)
        return removed

    def _s3_client(self):
        import boto3  # only S3 lakes need it

        return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)

    def _write(self, layer: str, name: str, frame: pl.DataFrame, **options) -> DeltaCommit:
        table_uri = self.table_uri(layer, name)
        started = (time.perf_counter(), time.process_time())
        write_deltalake(
            table_uri,
            frame.to_arrow(compat_level=_arrow_layout(frame.schema)),
            storage_options=self.storage_options(),
            **options,
        )
        return self._committed(table_uri, frame.height, frame.estimated_size(), started)

    def _write_frames(
        self, layer: str, name: str, frames: Iterable[pl.DataFrame], schema: pl.Schema, **options
    ) -> DeltaCommit:
        table_uri = self.table_uri(layer, name)
        started = (time.perf_counter(), time.process_time())
        compat = _arrow_layout(schema)
        arrow_schema = schema.to_frame().to_arrow(compat_level=compat).schema
        written = {"rows": 0, "bytes": 0}
        failed: list[BaseException] = []

        def batches():
            try:
                for frame in frames:
                    written["rows"] += frame.height
                    written["bytes"] += frame.estimated_size()
                    yield from frame.to_arrow(compat_level=compat).cast(arrow_schema).to_batches()
            except BaseException as exc:  # delta-rs reports it as its own error, without the type
                failed.append(exc)
                raise

        existed = self.table(layer, name) is not None
        try:
            write_deltalake(
                table_uri,
                pa.RecordBatchReader.from_batches(arrow_schema, batches()),
                storage_options=self.storage_options(),
                **options,
            )
        except Exception:
            if not existed:
                _remove_uncommitted(table_uri)
            if failed:
                raise failed[0] from None
            raise
        return self._committed(table_uri, written["rows"], written["bytes"], started)

    def _committed(
        self, table_uri: str, rows: int, bytes_in_memory: int, started: tuple[float, float]
    ) -> DeltaCommit:
        """The write just committed: the table's new version, and the write's wall and CPU seconds since ``started``."""
        wall, cpu = started
        version = DeltaTable(table_uri, storage_options=self.storage_options()).version()
        return DeltaCommit(
            uri=table_uri,
            version=version,
            rows=rows,
            bytes_in_memory=bytes_in_memory,
            wall_seconds=time.perf_counter() - wall,
            cpu_seconds=time.process_time() - cpu,
        )


def _remove_uncommitted(table_uri: str) -> None:
    """A first write that failed leaves its folder (and any data files it had flushed) without a log:
    a table no reader can open. On S3 there are no folders; flushed objects stay invisible to Delta
    (as a crashed writer's do) until vacuum."""
    folder = Path(table_uri)
    if not uris.is_s3(table_uri) and folder.is_dir() and not (folder / "_delta_log").exists():
        shutil.rmtree(folder)


def _row_groups(rows_per_group: int | None) -> dict:
    # Given any WriterProperties, delta-rs writes columns uncompressed unless told: snappy is its default.
    properties = WriterProperties(max_row_group_size=rows_per_group, compression="SNAPPY")
    return {"writer_properties": properties} if rows_per_group else {}


def _check_partition(
    layer: str, name: str, frame: pl.DataFrame, column: str, value: str
) -> pl.DataFrame:
    if not set(value) <= _PARTITION_VALUE_CHARS:
        raise ValueError(f"partition value {value!r} has characters outside [A-Za-z0-9._-]")
    if frame.height and frame[column].unique().to_list() != [value]:
        raise ValueError(f"every row written to {layer}/{name} must have {column} = {value!r}")
    return frame


def _arrow_layout(schema: pl.Schema) -> pl.CompatLevel:
    """Text as Arrow string views: handed over without a copy, which takes a fifth off writing a
    text-heavy table. The Parquet writer cannot take a categorical's views: those keep the old
    layout."""
    categorical = any(
        isinstance(t, (pl.Categorical, pl.Enum)) for t in _all_dtypes(schema.dtypes())
    )
    return pl.CompatLevel.oldest() if categorical else pl.CompatLevel.newest()


def _all_dtypes(dtypes) -> list[pl.DataType]:
    """These types and every type nested in them (list items, struct fields)."""
    found = []
    for dtype in dtypes:
        found.append(dtype)
        if isinstance(dtype, (pl.List, pl.Array)):
            found += _all_dtypes([dtype.inner])
        elif isinstance(dtype, pl.Struct):
            found += _all_dtypes([f.dtype for f in dtype.fields])
    return found


# --- Landing zone -------------------------------------------------------------------------------


class LandingFileGone(FileNotFoundError):
    """A registered landing file no longer exists: retrying will not bring it back."""


@dataclass(frozen=True)
class LandingFile:
    """A file in the landing zone: ``<landing>/<source>/<name>``."""

    uri: str
    source: str
    size: int
    modified: str  # mtime in ns for local files, the ETag for S3 objects


class LandingResource(ConfigurableResource):
    """The landing zone: one folder (or S3 prefix) per source, files of the four landing formats.

    Names that start with ``_`` or ``.`` (markers, manifests, temporary uploads) are not data.
    """

    uri: str = Field(description="landing zone root: a local path or s3://bucket/prefix")
    field_mappings: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='per source, their field -> ours, e.g. {"logs": {"completion": "response"}}',
    )
    source_formats: dict[str, str] = Field(
        default_factory=dict,
        description='per source, its record format, e.g. {"prefs": "preference"}; sft unless named',
    )
    s3: S3Resource = Field(default_factory=S3Resource)

    def relative_name(self, uri: str) -> str:
        """``<source>/<file>``: how provenance columns and messages name a landing file."""
        root = self.uri.rstrip("/") + "/"
        return uri[len(root) :] if uri.startswith(root) else uri

    def mapping_for(self, source: str) -> dict[str, str]:
        return self.field_mappings.get(source, {})

    @property
    def formats_by_source(self) -> dict[str, str]:
        """Each named source's record format: the RL overlay's rollout pairs' source, then the setting's."""
        return {ROLLOUT_SOURCE: PREFERENCE.name, **self.source_formats}

    def format_for(self, source: str) -> RecordFormat:
        return format_named(self.formats_by_source.get(source, SFT.name))

    def list_files(self) -> list[LandingFile]:
        files = self._list_s3() if uris.is_s3(self.uri) else self._list_local()
        return sorted(files, key=lambda f: f.uri)

    def read_bytes(self, uri: str) -> bytes:
        """The file's bytes; ``LandingFileGone`` when it no longer exists. Any other error (I/O,
        timeout, a 5xx or a throttle from the store) is raised as it is: it may pass on a retry."""
        if not uris.is_s3(uri):
            try:
                return Path(uri).read_bytes()
            except FileNotFoundError as exc:
                raise LandingFileGone(uri) from exc
        bucket, key = uris.split_s3(uri)
        try:
            return self.s3.get_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise LandingFileGone(uri) from exc
            raise

    def _list_local(self) -> list[LandingFile]:
        root = Path(self.uri)
        if not root.is_dir():
            return []
        found = []
        for path in root.rglob("*"):
            relative = path.relative_to(root).parts
            if len(relative) < 2 or _is_hidden(relative) or not path.is_file():
                continue
            stat = path.stat()
            found.append(LandingFile(str(path), relative[0], stat.st_size, str(stat.st_mtime_ns)))
        return found

    def _list_s3(self) -> list[LandingFile]:
        bucket, prefix = uris.split_s3(self.uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        found = []
        pages = (
            self.s3.get_client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                relative = tuple(obj["Key"][len(prefix) :].split("/"))
                if len(relative) < 2 or _is_hidden(relative) or obj["Key"].endswith("/"):
                    continue
                uri = f"s3://{bucket}/{obj['Key']}"
                found.append(LandingFile(uri, relative[0], obj["Size"], obj["ETag"].strip('"')))
        return found


def _is_hidden(parts: tuple[str, ...]) -> bool:
    return any(part.startswith(("_", ".")) for part in parts)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- Policies -----------------------------------------------------------------------------------


class IngestPolicy(ConfigurableResource):
    """Thresholds the bronze checks judge by."""

    max_quarantine_rate: float = Field(
        default=0.05, description="blocking: a source's quarantined share of a batch"
    )
    volume_tolerance: float = Field(
        default=0.20, description="warning: rows per input MB against the trailing median"
    )
    freshness_sla_hours: float = Field(
        default=24.0, description="warning: age of a source's newest record"
    )
    trailing_batches: int = Field(
        default=10, description="how many earlier batches the volume baseline uses"
    )


class GoldPolicy(ConfigurableResource):
    """How gold tokenizes, splits and packs, and what its checks allow."""

    tokenizer_path: str = Field(
        default="", description="a tokenizer.json to use; empty: train byte-level BPE on silver"
    )
    vocab_size: int = 8192
    tokenizer_sample_chars: int = Field(
        default=_TOKENIZER_SAMPLE_CHARS,
        ge=1,
        description="the trained tokenizer's sample of silver's training split: its texts total at most this many characters",
    )
    seq_len: int = 512
    long_records: str = Field(
        default=DEFAULT_LONG_RECORDS,
        description="a record longer than seq_len: truncate its response, or drop it; either way it keeps its prompt",
    )
    validation_fraction: float = 0.02
    preference_validation_fraction: float = Field(
        default=PREFERENCE_VALIDATION_FRACTION,
        description="preference pairs: the share of prompts held out (all of "
        "a prompt's pairs on one side) for preference accuracy",
    )
    search_fraction: float = Field(
        default=_SEARCH_FRACTION,
        description="records hyperparameter search selects on, "
        "taken from train only (validation, the promotion gate's rows, never changes)",
    )
    shuffle_seed: int = 20261121
    min_packing_efficiency: float = Field(
        default=0.98, description="blocking: real tokens / all tokens"
    )
    snapshot_min_new_fraction: float = Field(
        default=0.10,
        description="cut a new snapshot when silver text changed since the last one reaches this share of it",
    )
    psi_warn: float = 0.10
    psi_fail: float = 0.25
    volume_tolerance: float = Field(
        default=0.20, description="warning: tokens against the previous snapshot"
    )


def _block_engine(settings: Settings) -> BlockEngine:
    if settings.kuberay_config:
        return KubeRayEngine.from_file(settings.kuberay_config)
    return RayEngine(home=settings.home, min_rows=settings.ray_min_rows)


def build_resources(settings: Settings | None = None) -> dict[str, ConfigurableResource]:
    settings = settings or Settings.from_env()
    return {
        "lake": LakeResource(uri=settings.lake_uri),
        "landing": LandingResource(
            uri=settings.landing_uri,
            field_mappings=settings.field_mappings,
            source_formats=settings.source_formats,
            s3=S3Resource(max_attempts=settings.s3_max_attempts - 1),
        ),  # it counts retries
        "ingest_policy": IngestPolicy(
            max_quarantine_rate=settings.max_quarantine_rate,
            volume_tolerance=settings.volume_tolerance,
            freshness_sla_hours=settings.freshness_sla_hours,
        ),
        "eval_sets": EvalSetsResource(uri=settings.eval_sets_uri),
        "silver_policy": SilverPolicy(
            quality_thresholds=settings.quality_thresholds,
            max_pairs_per_prompt=settings.max_pairs_per_prompt,
            max_length_ratio=settings.max_length_ratio,
        ),
        "ray_engine": _block_engine(settings),
        "gold_policy": GoldPolicy(
            tokenizer_path=settings.tokenizer_path,
            seq_len=settings.seq_len,
            long_records=settings.long_records,
            vocab_size=settings.vocab_size,
            tokenizer_sample_chars=settings.tokenizer_sample_chars,
            validation_fraction=settings.validation_fraction,
            preference_validation_fraction=settings.preference_validation_fraction,
            search_fraction=settings.search_fraction,
            shuffle_seed=settings.shuffle_seed,
            snapshot_min_new_fraction=settings.snapshot_min_new_fraction,
        ),
        "launcher": TorchrunLauncher(
            checkpoint_uri=settings.checkpoint_uri,
            nproc_per_node=settings.train_nproc,
            threads_per_rank=settings.train_threads_per_rank,
            device=settings.train_device,
            scratch_dir=str(Path(settings.home) / "scratch"),
        ),
        "training_policy": TrainingPolicy(
            preset=settings.train_preset,
            steps=settings.train_steps,
            checkpoint_every_steps=settings.train_checkpoint_every,
        ),
        "dpo_policy": DpoPolicy(
            steps=settings.dpo_steps,
            lr=settings.dpo_lr,
            beta=settings.dpo_beta,
            checkpoint_every_steps=settings.train_checkpoint_every,
        ),
        "mlflow_tracking": MlflowResource(
            tracking_uri=_through_env("MLFLOW_TRACKING_URI", settings.mlflow_tracking_uri),
            artifact_root=settings.mlflow_artifact_root,
            experiment=settings.mlflow_experiment,
            ui_url=settings.mlflow_ui_url,
        ),
        "pipes_subprocess_client": PipesSubprocessClient(),
        "hparam_search_policy": HparamSearchPolicy(),
        "cost_policy": CostPolicy(
            core_hour_usd=settings.core_hour_usd,
            gpu_hour_usd=settings.gpu_hour_usd,
            spot_discount=settings.spot_discount,
        ),
        "registry_policy": RegistryPolicy(
            model_name=settings.model_name,
            dpo_model_name=settings.dpo_model_name,
            promotion_margin=settings.promotion_margin,
            slice_tolerance=settings.slice_tolerance,
            eval_max_tokens=settings.eval_max_tokens,
        ),
        "retention_policy": RetentionPolicy(days=settings.retention_days),
        "rl_policy": RlPolicy.from_env(),
    }


# --- Reference data -----------------------------------------------------------------------------


class EvalSetsResource(ConfigurableResource):
    """Benchmark items (JSONL files) the data must not contain: a local folder or an S3 prefix."""

    uri: str = Field(description="folder or s3://bucket/prefix holding <eval_set>.jsonl files")
    s3: S3Resource = Field(default_factory=S3Resource)

    def files(self) -> dict[str, bytes]:
        """File name -> bytes, for every *.jsonl under the uri (empty when there is none)."""
        if uris.is_s3(self.uri):
            bucket, prefix = uris.split_s3(self.uri)
            client = self.s3.get_client()
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix.rstrip("/") + "/"
            )
            keys = [
                o["Key"]
                for page in pages
                for o in page.get("Contents", [])
                if o["Key"].endswith(".jsonl")
            ]
            return {
                k.rsplit("/", 1)[-1]: client.get_object(Bucket=bucket, Key=k)["Body"].read()
                for k in sorted(keys)
            }
        root = Path(self.uri)
        return (
            {p.name: p.read_bytes() for p in sorted(root.glob("*.jsonl"))} if root.is_dir() else {}
        )

    def items(self, files: dict[str, bytes]) -> pl.DataFrame:
        """Every eval item (eval_set, item_id, prompt, response)."""
        with tempfile.TemporaryDirectory() as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            return read_eval_sets(Path(folder))

    def fingerprint(self, files: dict[str, bytes]) -> str:
        """The eval sets' data version: sha256 over each file's name and the sha256 of its bytes."""
        digest = hashlib.sha256()
        for name, data in sorted(files.items()):
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return digest.hexdigest()


class SilverPolicy(ConfigurableResource):
    """How silver normalizes, deduplicates, decontaminates and gates, and what its checks allow."""

    unicode_form: str = "NFC"
    strip_control: bool = True
    collapse_whitespace: bool = True
    minhash_num_perm: int = 128
    minhash_seed: int = 1
    minhash_shingle_words: int = 5
    minhash_threshold: float = 0.8
    decontam_ngram: int = 13
    quality_thresholds: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description='per source rule overrides, e.g. {"logs": {"min_words": 3}}',
    )
    max_pass_rate_drop: float = Field(
        default=0.20, description="blocking: a source's pass rate below its trailing median"
    )
    psi_warn: float = 0.10
    psi_fail: float = 0.25
    drift_min_rows: int = Field(
        default=500,
        description="below this many rows on either side, PSI is mostly sampling noise: not judged",
    )
    volume_tolerance: float = Field(
        default=0.20, description="warning: kept rows against the trailing median"
    )
    trailing_batches: int = 10
    max_pairs_per_prompt: int = Field(
        default=MAX_PAIRS_PER_PROMPT,
        description="preference pairs kept a prompt, "
        "over every batch; the rest are rejected as pair_cap",
    )
    max_length_ratio: float = Field(
        default=0.0,
        description="preference pairs: reject chars(chosen) / chars(rejected) "
        "beyond this either way; 0 only counts the pairs beyond 4 (length bias)",
    )

    def decontam_config(self) -> DecontamConfig:
        return DecontamConfig(ngram=self.decontam_ngram)

    def silver_config(self) -> SilverConfig:
        return SilverConfig(
            normalize=NormalizeConfig(
                self.unicode_form or None, self.strip_control, self.collapse_whitespace
            ),
            minhash=MinHashConfig(
                num_perm=self.minhash_num_perm,
                seed=self.minhash_seed,
                shingle_words=self.minhash_shingle_words,
                threshold=self.minhash_threshold,
            ),
            decontam=self.decontam_config(),
            quality_by_source={
                source: QualityThresholds(**overrides)
                for source, overrides in self.quality_thresholds.items()
            },
            max_pairs_per_prompt=self.max_pairs_per_prompt,
            max_length_ratio=self.max_length_ratio or None,
        )


# --- Training -----------------------------------------------------------------------------------


class TorchrunLauncher(ConfigurableResource):
    """How training jobs start: one node, ``nproc_per_node`` ranks; gloo on CPU, NCCL on GPU."""

    checkpoint_uri: str = Field(
        description="root of training checkpoints: a local path or s3://bucket/prefix"
    )
    nproc_per_node: int = Field(
        default=2, description="ranks (processes) per node: GPUs on a GPU node"
    )
    threads_per_rank: int = Field(default=1, description="OMP_NUM_THREADS of each rank")
    device: str = Field(
        default="auto", description="auto (CUDA when present), cuda or cpu; the backend follows"
    )
    max_restarts: int = Field(
        default=0, description="torchrun's own restarts; Dagster's retry policy also resumes"
    )
    scratch_dir: str = Field(default="", description="local staging for checkpoints on S3")

    def command(
        self,
        trainer_args: list[str],
        nproc_per_node: int | None = None,
        module: str = TRAINER_MODULE,
    ) -> list[str]:
        return torchrun_command(
            nproc_per_node or self.nproc_per_node, trainer_args, self.max_restarts, module
        )

    def env(self) -> dict[str, str]:
        return torchrun_env(self.threads_per_rank)

    def scoring_ranks(self) -> tuple[int, int]:
        """(ranks, threads a rank) for evaluation's scoring: a rank a GPU; on CPU, one rank with the
        threads all the ranks would have, since a second process gains nothing on CPU and costs a start."""
        import torch  # only where a run scores, not at every code-location load

        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            return self.nproc_per_node, self.threads_per_rank
        return 1, self.nproc_per_node * self.threads_per_rank

    def scratch(self) -> str:
        """Local working space: staged checkpoints for S3, fetched exports, report pictures."""
        return local_scratch(self.scratch_dir)

    def store(self, partition: str, root: str | None = None) -> CheckpointStore:
        return CheckpointStore(root or self.checkpoint_uri, partition, self.scratch())

    def partitions(self) -> list[str]:
        """The folders directly under the checkpoint root: one per trained snapshot."""
        return self.store("").folders()


def _trainer_default(name: str):
    """The trainer's own default: one source for a by-hand run and for the Dagster resource."""
    return next(item.default for item in dataclasses.fields(TrainConfig) if item.name == name)


class TrainingPolicy(ConfigurableResource):
    """Default hyperparameters of training/checkpoint; a run's config overrides any of them."""

    preset: str = Field(
        default=_trainer_default("preset"), description=f"model size: {', '.join(PRESETS)}"
    )
    steps: int = _trainer_default("steps")
    micro_batch_size: int = _trainer_default("micro_batch_size")
    grad_accum_steps: int = _trainer_default("grad_accum_steps")
    lr: float = _trainer_default("lr")
    warmup_steps: int = _trainer_default("warmup_steps")
    weight_decay: float = _trainer_default("weight_decay")
    seed: int = _trainer_default("seed")
    log_every: int = _trainer_default("log_every")
    eval_every: int = _trainer_default("eval_every")
    checkpoint_every_steps: int = _trainer_default("checkpoint_every_steps")
    checkpoint_every_minutes: float = _trainer_default("checkpoint_every_minutes")
    keep_checkpoints: int = _trainer_default("keep_checkpoints")

    def hyperparameters(self) -> dict:
        return self.model_dump()


class DpoPolicy(ConfigurableResource):
    """Hyperparameters of training/dpo_checkpoint: DPO from the sft champion, against the reference pass.
    The model's architecture is the champion's; a run's config overrides any of these."""

    steps: int = DPO_STEPS
    lr: float = Field(default=DPO_LR, description="far below sft's: DPO nudges a trained model")
    beta: float = Field(default=_DPO_BETA, description="DPO's KL strength")
    micro_batch_size: int = _trainer_default("micro_batch_size")
    grad_accum_steps: int = _trainer_default("grad_accum_steps")
    warmup_steps: int = DPO_WARMUP_STEPS
    weight_decay: float = (
        0.0  # pulling weights towards zero pulls the policy away from its reference
    )
    seed: int = _trainer_default("seed")
    log_every: int = DPO_LOG_EVERY
    eval_every: int = DPO_EVAL_EVERY
    checkpoint_every_steps: int = _trainer_default("checkpoint_every_steps")
    checkpoint_every_minutes: float = _trainer_default("checkpoint_every_minutes")
    keep_checkpoints: int = _trainer_default("keep_checkpoints")

    def hyperparameters(self) -> dict:
        return self.model_dump()


_RL_ENV = {  # RlPolicy's fields and the variables that set them
    "bank_tasks": "PIPELINE_RL_BANK_TASKS",
    "bank_seed": "PIPELINE_RL_BANK_SEED",
    "held_out_fraction": "PIPELINE_RL_HELD_OUT_FRACTION",
    "group_size": "PIPELINE_RL_GROUP_SIZE",
    "rollout_workers": "PIPELINE_RL_ROLLOUT_WORKERS",
    "max_staleness": "PIPELINE_RL_MAX_STALENESS",
    "max_pending_seconds": "PIPELINE_RL_MAX_PENDING_SECONDS",
}


class RlPolicy(ConfigurableResource):
    """The RL overlay's settings: its prompt bank, its groups, its rollout workers and how stale a rollout may
    be. Each field's default is the one place it is written; ``from_env`` reads its PIPELINE_RL_* variable."""

    bank_tasks: int = Field(
        default=3000, ge=1, description="generated verifiable tasks in rl/prompt_bank"
    )
    bank_seed: int = Field(default=20261126, description="the task generator's seed")
    held_out_fraction: float = Field(
        default=0.2, ge=0, lt=1, description="bank prompts held out, by hash"
    )
    group_size: int = Field(default=8, ge=2, description="completions per prompt: GRPO's group")
    rollout_workers: int = Field(
        default=1, ge=1, description="rollout processes beside the learner"
    )
    max_staleness: int = Field(
        default=2, ge=0, description="policy versions a consumed rollout may lag"
    )
    max_pending_seconds: float = Field(
        default=600.0, gt=0, description="how long a rollout may wait unconsumed"
    )

    @classmethod
    def from_env(cls) -> "RlPolicy":
        """The policy with every PIPELINE_RL_* variable that is set; a bad value fails naming its variable."""
        values = {}
        for field_name, variable in _RL_ENV.items():
            raw = os.environ.get(variable, "").strip()
            if raw:
                values[field_name] = _float_env(variable, 0.0)
        try:
            return cls(**values)
        except ValidationError as exc:
            wrong = {_RL_ENV[str(error["loc"][0])]: error["msg"] for error in exc.errors()}
            raise ValueError(
                "; ".join(f"{name}: {message}" for name, message in wrong.items())
            ) from None


class CostPolicy(ConfigurableResource):
    """Prices for the pipeline report and the sizer, and when a stage counts as slower."""

    core_hour_usd: float = Field(
        default=_PRICES.core_hour, description="$ per vCPU-hour, on-demand"
    )
    gpu_hour_usd: float = Field(default=_PRICES.gpu_hour, description="$ per GPU-hour, on-demand")
    spot_discount: float = Field(
        default=_PRICES.spot_discount, description="fraction off on spot capacity, e.g. 0.6"
    )
    max_throughput_drop: float = Field(
        default=0.30, description="warning: a stage this much below its trailing median"
    )
    trailing_reports: int = 10

    def prices(self) -> Prices:
        return Prices(
            core_hour=self.core_hour_usd,
            gpu_hour=self.gpu_hour_usd,
            spot_discount=self.spot_discount,
        )


class RegistryPolicy(ConfigurableResource):
    """What the registry calls the model and what a candidate must show to become champion."""

    model_name: str = "sft-model"
    dpo_model_name: str = Field(
        default="dpo-model", description="the registered model of DPO's exports"
    )
    promotion_margin: float = Field(
        default=0.005, description="blocking: relative overall-loss improvement required"
    )
    slice_tolerance: float = Field(
        default=0.02, description="blocking: relative loss increase allowed on any slice"
    )
    eval_max_tokens: int = Field(
        default=2_000_000, description="validation tokens scored per model (a fixed sample)"
    )


class RetentionPolicy(ConfigurableResource):
    """How long the retention job keeps what nothing registered needs."""

    days: float = Field(
        default=_RETENTION_DAYS,
        ge=0,
        description="old Delta files, checkpoints: kept this many days",
    )


CHAMPION_HISTORY_TAG = "champion_history"
_HISTORY_KEPT = 50


class HparamSearchPolicy(ConfigurableResource):
    """What training/hparam_search explores, and how hard it prunes."""

    space: dict[str, list] = Field(
        default_factory=lambda: {
            "lr": [1e-3, 3e-3, 1e-2],
            "warmup_steps": [5, 20],
            "weight_decay": [0.0, 0.1],
            "width": [64, 128],
        },
        description="hyperparameter -> values; any TrainConfig field (width: the model's dim)",
    )
    trials: int = Field(default=6, description="configurations sampled from the grid")
    min_steps: int = Field(default=10, description="steps at the first rung")
    max_steps: int = Field(
        default=90, description="steps at the last rung (and the schedule's length)"
    )
    eta: int = Field(
        default=3, description="keep the best 1/eta at each rung; budgets grow eta times"
    )
    seed: int = 0
    nproc_per_node: int = Field(
        default=1, description="ranks per trial: trials are short, one rank each"
    )


@contextmanager
def redacted_errors():
    """Re-raise an error with every URI password in its message redacted (MLflow's errors show the
    tracking URI as configured); the original, which holds it, is not chained."""
    try:
        yield
    except Exception as exc:
        if uris.redact(str(exc)) == str(exc):
            raise
        raise _redacted_copy(exc) from None


def _redacted_copy(exc: Exception) -> Exception:
    """The same error (type, MLflow's error code) with its message redacted, or a RuntimeError saying it."""
    redacted = copy.copy(exc)
    redacted.args = tuple(uris.redact(arg) if isinstance(arg, str) else arg for arg in exc.args)
    if isinstance(getattr(exc, "message", None), str):
        redacted.message = uris.redact(exc.message)
    if uris.redact(str(redacted)) != str(redacted):
        return RuntimeError(f"{type(exc).__name__}: {uris.redact(str(exc))}")
    return redacted.with_traceback(None)


class _RedactedClient:
    """An ``MlflowClient`` whose errors never show the tracking URI's password."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        found = getattr(self._client, name)
        if not callable(found):
            return found

        @functools.wraps(found)
        def call(*args, **kwargs):
            with redacted_errors():
                return found(*args, **kwargs)

        return call


class MlflowResource(ConfigurableResource):
    """Experiment tracking and the model registry (SQLite by default)."""

    tracking_uri: str = Field(
        description="MLFLOW_TRACKING_URI; given as an EnvVar, so a password in it is never shown"
    )
    artifact_root: str = Field(
        description="where run artifacts go: a local path or s3://bucket/prefix"
    )
    experiment: str = "pipeline_assets"
    ui_url: str = Field(
        default="http://127.0.0.1:5000", description="where `make dev` serves the MLflow UI"
    )

    def resolved_tracking_uri(self) -> str:
        """The URI to connect with (it may hold a password: pass it on, never show it)."""
        return _resolved(self.tracking_uri)

    def shown_tracking_uri(self) -> str:
        return uris.redact(self.resolved_tracking_uri())

    def client(self):
        from mlflow import MlflowClient

        return _RedactedClient(MlflowClient(tracking_uri=self.resolved_tracking_uri()))

    def experiment_id(self) -> str:
        client = self.client()
        found = client.get_experiment_by_name(self.experiment)
        if found:
            return found.experiment_id
        # An explicit location: MLflow's default is ./mlruns under whatever folder the process runs in.
        return client.create_experiment(
            self.experiment, artifact_location=uris.join(self.artifact_root, self.experiment)
        )

    def open_run(self, name: str, tags: dict[str, str], reuse_key: dict[str, str]) -> str:
        """A run for one materialization: the unfinished run a retry of it left (same ``reuse_key``
        tags), else a new one. Returns the run id."""
        client, experiment_id = self.client(), self.experiment_id()
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in reuse_key.items())
        for run in client.search_runs([experiment_id], filter_string=query, max_results=5):
            if run.info.status != "FINISHED":
                client.set_tag(
                    run.info.run_id,
                    "pipeline.attempts",
                    int(run.data.tags.get("pipeline.attempts", "1")) + 1,
                )
                return run.info.run_id
        return client.create_run(
            experiment_id, run_name=name, tags={**tags, **reuse_key}
        ).info.run_id

    def run_url(self, run_id: str) -> str:
        return uris.redact(
            f"{self.ui_url.rstrip('/')}/#/experiments/{self.experiment_id()}/runs/{run_id}"
        )

    # --- the model registry: aliases only (stages are deprecated) ---------------------------------
    def registered_version(
        self, model_name: str, run_id: str, artifact_path: str, tags: dict[str, str]
    ) -> str:
        """The version of ``model_name`` holding the run's model: the one registered before (a
        re-materialization registers nothing twice), else a new one. Returns its number."""
        client = self.client()
        if not client.search_registered_models(filter_string=f"name = '{model_name}'"):
            client.create_registered_model(
                model_name, description="Models trained by pipeline_assets"
            )
        for existing in client.search_model_versions(
            f"name = '{model_name}' and run_id = '{run_id}'"
        ):
            return str(existing.version)
        version = client.create_model_version(
            model_name,
            source=f"runs:/{run_id}/{artifact_path}",
            run_id=run_id,
            tags={k: str(v) for k, v in tags.items()},
        )
        return str(version.version)

    def all_registered_versions(self) -> list:
        """Every version of every registered model on this tracking server."""
        client, found, token = self.client(), [], None
        while True:
            page = client.search_model_versions(page_token=token)
            found += list(page)
            token = page.token
            if not token:
                return found

    def version_by_alias(self, model_name: str, alias: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client().get_model_version_by_alias(model_name, alias)
        except MlflowException:
            return None

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.client().set_registered_model_alias(model_name, alias, version)

    def champion_history(self, model_name: str) -> list[dict]:
        tags = self.client().get_registered_model(model_name).tags
        return json.loads(tags.get(CHAMPION_HISTORY_TAG, "[]"))

    def move_champion(
        self, model_name: str, version: str, *, by: str, reason: str, kind: str = "promote"
    ) -> None:
        """Point ``champion`` at ``version`` and record who moved it, why and how (``promote`` or
        ``rollback``), newest last."""
        client = self.client()
        previous = self.version_by_alias(model_name, "champion")
        client.set_registered_model_alias(model_name, "champion", version)
        entry = {
            "version": str(version),
            "previous": str(previous.version) if previous else None,
            "kind": kind,
            "by": by,
            "reason": reason,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        history = (self.champion_history(model_name) + [entry])[-_HISTORY_KEPT:]
        client.set_registered_model_tag(model_name, CHAMPION_HISTORY_TAG, json.dumps(history))
        client.set_model_version_tag(model_name, version, "champion_since", entry["at"])

    def rollback_target(self, model_name: str) -> str | None:
        """The champion before the current one in the recorded history, skipping those rollbacks left."""
        current = self.version_by_alias(model_name, "champion")
        return rollback_target(
            self.champion_history(model_name), current=str(current.version) if current else None
        )

    def existing_version(self, model_name: str, version: str):
        """The registered version, or ``ValueError`` naming what the registry holds."""
        from mlflow.exceptions import MlflowException

        client = self.client()
        try:
            return client.get_model_version(model_name, version)
        except MlflowException:
            pass
        held = sorted(
            int(v.version) for v in client.search_model_versions(f"name = '{model_name}'")
        )
        if not held:
            raise ValueError(
                f"no registered model {model_name!r} in the registry at {self.shown_tracking_uri()}"
            )
        raise ValueError(
            f"{model_name} has no version {version} (registered versions: {', '.join(map(str, held))})"
        )

    def require_model(self, model_name: str) -> None:
        """``ValueError`` unless ``model_name`` is registered."""
        if not self.client().search_registered_models(filter_string=f"name = '{model_name}'"):
            raise ValueError(
                f"no registered model {model_name!r} in the registry at {self.shown_tracking_uri()}"
            )

    def download_model(self, model_name: str, version: str, destination: Path) -> Path:
        import mlflow.artifacts

        found = self.client().get_model_version(model_name, version)
        with redacted_errors():
            return Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=found.source,
                    dst_path=str(destination),
                    tracking_uri=self.resolved_tracking_uri(),
                )
            )
