"""The sources maintained outside the pipeline, observed rather than materialized.

reference/eval_sets: benchmark items the data must not contain. Its data version is the sha256 of
its files, so a changed benchmark shows silver as stale ("upstream data changed") until
`pipeline-assets backfill-decontamination` redoes it.

reference/base_model: the user's pretrained model (PIPELINE_BASE_MODEL). Its data version is the
sha256 of the folder's files, so a changed model shows the tokenizer, gold and training stale.

reference/quality_models: the models silver scores records with (the language-ID model and
PIPELINE_QUALITY_MODELS). Its data version is the fingerprint of their URIs, settings and files'
sha256, so a changed scorer shows silver stale until `pipeline-assets backfill-decontamination`
re-scores it.
"""

from collections.abc import Callable

from dagster import (
    AssetKey,
    AssetSelection,
    DagsterInstance,
    DataVersion,
    DefaultSensorStatus,
    EventLogRecord,
    ObserveResult,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    observable_source_asset,
    sensor,
)

from pipeline_assets.defs.keys import (
    REFERENCE_BASE_MODEL,
    REFERENCE_EVAL_SETS,
    REFERENCE_QUALITY_MODELS,
)
from pipeline_assets.defs.retries import refusal
from pipeline_assets.lib.gold.base_model import BaseModelError
from pipeline_assets.lib.silver.scorers import ScorerError
from pipeline_assets.resources import quality_models as quality_models_setting
from pipeline_assets.resources.base_model import SETTING, BaseModelResource
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.quality_models import QualityModelsResource

_DATA_VERSION_TAG = "dagster/data_version"  # the tag an observation's data version is stored under


@observable_source_asset(
    key=REFERENCE_EVAL_SETS,
    description="Benchmark items (JSONL: eval_set, item_id, prompt, response) under "
    "PIPELINE_EVAL_SETS_URI. Silver decontaminates against them; evaluation scores on them. Data "
    "version: sha256 of the files.",
    group_name="reference",
    tags={"dagster/kind/jsonl": ""},
)
def eval_sets(eval_sets: EvalSetsResource) -> ObserveResult:
    files = eval_sets.files()
    items = eval_sets.items(files)  # a malformed file fails the observation, naming file and line
    counts = items.group_by("eval_set").len("items").sort("eval_set")
    return ObserveResult(
        data_version=DataVersion(eval_sets.fingerprint(files)),
        metadata={
            "uri": eval_sets.uri,
            "files": sorted(files),
            "items": items.height,
            "items_by_eval_set": dict(counts.iter_rows()),
        },
    )


observe_eval_sets_job = define_asset_job(
    "observe_eval_sets",
    selection=AssetSelection.assets(REFERENCE_EVAL_SETS),
    description="Observe reference/eval_sets: records the sha256 of its files as its data version.",
)


@sensor(
    name="eval_sets_watcher",
    job=observe_eval_sets_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests an observation of reference/eval_sets when its files' sha256 differs "
    "from the data version last observed (and once, when it was never observed).",
)
def eval_sets_watcher(context: SensorEvaluationContext, eval_sets: EvalSetsResource):
    current = eval_sets.fingerprint(eval_sets.files())
    return _observe_when_changed(context, REFERENCE_EVAL_SETS, current, _data_version, "eval sets")


def _observe_when_changed(
    context: SensorEvaluationContext,
    key: AssetKey,
    current: str,
    observed: Callable[[EventLogRecord], str | None],
    what: str,
) -> RunRequest | SkipReason:
    """An observation of ``key`` when ``current`` differs from what its last observation recorded
    (``observed``: its data version or its files' listing), or when it was never observed."""
    latest = _latest_observation(context.instance, key)
    if latest is not None and current == observed(latest):
        return SkipReason(f"{what} unchanged ({current[:12]})")
    # One request per change: the same files after the same observation give the same run key.
    after = latest.storage_id if latest else 0
    return RunRequest(run_key=f"{current}@after-{after}")


NO_BASE_MODEL = "unset"  # reference/base_model's data version when PIPELINE_BASE_MODEL is unset
_LISTING = "listing_sha256"  # names, sizes and times of the models' files, as last observed


@observable_source_asset(
    key=REFERENCE_BASE_MODEL,
    description="The pretrained Hugging Face model PIPELINE_BASE_MODEL names (local folder or "
    "s3://), checked before anything trains on it. Data version: sha256 of its files ('unset': the "
    "built-in preset, trained from scratch).",
    group_name="reference",
    tags={"dagster/kind/huggingface": ""},
)
def base_model(base_model: BaseModelResource) -> ObserveResult:
    if not base_model.configured:
        return ObserveResult(
            data_version=DataVersion(NO_BASE_MODEL),
            metadata={"uri": f"{SETTING} is unset: the built-in preset trains from scratch"},
        )
    listing = base_model.listing_fingerprint()
    try:
        model = base_model.inspect()
    except BaseModelError as error:
        raise refusal(f"{SETTING}={base_model.uri}: {error}") from error
    return ObserveResult(
        data_version=DataVersion(model.version),
        metadata={
            "uri": base_model.uri,
            "sha256": model.version,
            "architecture": model.architecture,
            "parameters": model.parameters,
            "vocab_size": model.vocab_size,
            "tokenizer_size": model.tokenizer_size,
            "tied_embeddings": model.tied_embeddings,
            _LISTING: listing,
        },
    )


observe_base_model_job = define_asset_job(
    "observe_base_model",
    selection=AssetSelection.assets(REFERENCE_BASE_MODEL),
    description="Observe reference/base_model: checks the model and records the sha256 of its "
    "files as its data version.",
)


@sensor(
    name="base_model_watcher",
    job=observe_base_model_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests an observation of reference/base_model when the names, sizes or times "
    "of its files differ from those last observed (and once, when it was never observed).",
)
def base_model_watcher(context: SensorEvaluationContext, base_model: BaseModelResource):
    if not base_model.configured:
        return SkipReason(f"{SETTING} is unset: no base model to watch")
    current = base_model.listing_fingerprint()
    return _observe_when_changed(
        context, REFERENCE_BASE_MODEL, current, observed_listing, "base model"
    )


@observable_source_asset(
    key=REFERENCE_QUALITY_MODELS,
    description="The models silver scores records with: the language-ID model and the scorers "
    "PIPELINE_QUALITY_MODELS lists (local or s3://), checked before any batch is scored. Data "
    "version: a fingerprint of their URIs, settings and files' sha256.",
    group_name="reference",
    tags={"dagster/kind/huggingface": ""},
)
def quality_models(quality_models: QualityModelsResource) -> ObserveResult:
    listing = quality_models.listing_fingerprint()
    try:
        quality_models.checked_specs()
    except ScorerError as error:
        raise refusal(f"{quality_models_setting.SETTING}: {error}") from error
    return ObserveResult(
        data_version=DataVersion(quality_models.fingerprint()),
        metadata={"models": quality_models.identities(), _LISTING: listing},
    )


observe_quality_models_job = define_asset_job(
    "observe_quality_models",
    selection=AssetSelection.assets(REFERENCE_QUALITY_MODELS),
    description="Observe reference/quality_models: checks every scorer and records the "
    "fingerprint of the models' identities as its data version.",
)


@sensor(
    name="quality_models_watcher",
    job=observe_quality_models_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests an observation of reference/quality_models when PIPELINE_QUALITY_MODELS "
    "or the names, sizes or times of a scorer's files differ from those last observed (and once, "
    "when it was never observed).",
)
def quality_models_watcher(context: SensorEvaluationContext, quality_models: QualityModelsResource):
    current = quality_models.listing_fingerprint()
    return _observe_when_changed(
        context,
        REFERENCE_QUALITY_MODELS,
        current,
        observed_listing,
        "quality models",
    )


def observed_listing(record: EventLogRecord) -> str | None:
    value = record.asset_observation.metadata.get(_LISTING)
    return None if value is None else value.value


def observed_version(instance: DagsterInstance, key: AssetKey = REFERENCE_EVAL_SETS) -> str | None:
    """The data version a reference source was last observed at (None: never observed)."""
    latest = _latest_observation(instance, key)
    return None if latest is None else _data_version(latest)


def observation_is_current(defs_resources: dict, instance: DagsterInstance, key: AssetKey) -> bool:
    """Whether the source's last observation still describes it (its files did not change)."""
    if key == REFERENCE_EVAL_SETS:
        resource = defs_resources["eval_sets"]
        return resource.fingerprint(resource.files()) == observed_version(instance, key)
    if key == REFERENCE_QUALITY_MODELS:
        latest = _latest_observation(instance, key)
        listing = defs_resources["quality_models"].listing_fingerprint()
        return latest is not None and observed_listing(latest) == listing
    resource, latest = defs_resources["base_model"], _latest_observation(instance, key)
    if latest is None:
        return False
    if not resource.configured:
        return _data_version(latest) == NO_BASE_MODEL
    return observed_listing(latest) == resource.listing_fingerprint()


def _latest_observation(
    instance: DagsterInstance, key: AssetKey = REFERENCE_EVAL_SETS
) -> EventLogRecord | None:
    records = instance.fetch_observations(key, limit=1).records
    return records[0] if records else None


def _data_version(record: EventLogRecord) -> str | None:
    return record.asset_observation.tags.get(_DATA_VERSION_TAG)
