"""The base model a snapshot trains from: the one its gold/tokenizer version was made from, checked
against what PIPELINE_BASE_MODEL names now. Training, the search, DPO and evaluation ask here, so a
model changed under a snapshot is refused by name instead of training ids of another vocabulary."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline_assets.defs.retries import refusal
from pipeline_assets.lib.gold.base_model import BaseModel, BaseModelError
from pipeline_assets.resources.base_model import SETTING, BaseModelResource
from pipeline_assets.resources.lake import LakeResource

RUN_TAGS = ("base_model.uri", "base_model.sha256")  # the MLflow run's and the registered version's
# DPO's reference (and starting) model when no sft champion exists: "base_model/<sha256[:12]>"
REFERENCE_PREFIX = "base_model/"


def snapshot_base_model(
    tokenizer_row: Mapping, tokenizer_version: int, base_model: BaseModelResource
) -> BaseModel | None:
    """The base model gold/tokenizer ``tokenizer_version`` (``tokenizer_row``) speaks, as
    ``base_model`` gives it now; None for the built-in tokenizer (a preset from scratch)."""
    recorded = tokenizer_row.get("base_model_version")
    tokenizer = f"gold/tokenizer v{tokenizer_version}"
    redo = "materialize gold/tokenizer again, then gold/sequences (every batch) and a new snapshot"
    if recorded is None:
        if base_model.configured:
            raise refusal(
                f"{SETTING}={base_model.uri} is set, but {tokenizer}, which this snapshot was "
                f"tokenized with, is the built-in tokenizer: {redo}; or unset {SETTING}"
            )
        return None
    if not base_model.configured:
        raise refusal(
            f"{tokenizer} is the tokenizer of base model {recorded[:12]} "
            f"({tokenizer_row.get('origin')}), but {SETTING} is unset: set it to that model again"
        )
    try:
        model = base_model.inspect()
    except BaseModelError as error:
        raise refusal(f"{SETTING}={base_model.uri}: {error}") from error
    if model.version != recorded:
        raise refusal(
            f"{SETTING}={base_model.uri} is base model {model.version[:12]} now, but {tokenizer} "
            f"holds the tokenizer of base model {recorded[:12]}: {redo}"
        )
    return model


def tokenizer_base_model(
    lake: LakeResource, tokenizer_version: int, base_model: BaseModelResource
) -> BaseModel | None:
    """``snapshot_base_model`` of the gold/tokenizer version a snapshot was encoded with."""
    rows = lake.read("gold", "tokenizer", version=tokenizer_version)
    if rows is None or rows.is_empty():
        raise refusal(f"gold/tokenizer v{tokenizer_version} does not exist in {lake.uri}")
    return snapshot_base_model(rows.row(0, named=True), tokenizer_version, base_model)


def reference_name(model: BaseModel) -> str:
    """How DPO's reference pass names a base model it scored with (in place of MODEL/VERSION)."""
    return f"{REFERENCE_PREFIX}{model.version[:12]}"


def run_tags(uri: str, model: BaseModel | None) -> dict[str, str]:
    """What the MLflow run and the registered version record of the base model (nothing without
    one)."""
    return {} if model is None else dict(zip(RUN_TAGS, (uri, model.version), strict=True))
