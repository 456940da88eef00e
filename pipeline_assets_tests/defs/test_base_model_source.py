"""reference/base_model as an observed source: versioned by its files, watched cheaply, checked
before anything trains on it, local or on S3."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from dagster import Definitions, Failure, RunRequest, SkipReason, build_sensor_context
from dagster._core.definitions.data_version import StaleStatus

from pipeline_assets.defs.base_models import snapshot_base_model
from pipeline_assets.defs.gold.assets import gold_tokenizer
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.keys import GOLD_TOKENIZER, REFERENCE_BASE_MODEL
from pipeline_assets.defs.reference.assets import (
    NO_BASE_MODEL,
    base_model,
    base_model_watcher,
    observe_base_model_job,
    observed_version,
)
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.lib.gold.base_model import folder_sha256
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets_tests.conftest import BUCKET
from pipeline_assets_tests.defs.staleness import stale_status
from pipeline_assets_tests.hf_models import llama_folder


def _observe(instance, resource: BaseModelResource):
    defs = Definitions(
        assets=[base_model], jobs=[observe_base_model_job], resources={"base_model": resource}
    )
    return defs.resolve_job_def(observe_base_model_job.name).execute_in_process(
        instance=instance, raise_on_error=False
    )


def _watcher_says(instance, resource: BaseModelResource):
    with build_sensor_context(instance=instance, resources={"base_model": resource}) as context:
        return base_model_watcher(context)


def _metadata(instance) -> dict:
    [record] = instance.fetch_observations(REFERENCE_BASE_MODEL, limit=1).records
    return {name: value.value for name, value in record.asset_observation.metadata.items()}


def test_unset_is_observed_as_the_built_in_preset_and_not_watched(instance):
    resource = BaseModelResource(uri="")
    assert isinstance(_watcher_says(instance, resource), SkipReason)
    assert _observe(instance, resource).success
    assert observed_version(instance, REFERENCE_BASE_MODEL) == NO_BASE_MODEL
    assert "PIPELINE_BASE_MODEL is unset" in _metadata(instance)["uri"]


def test_a_local_model_is_versioned_by_its_files_and_a_changed_template_is_a_new_version(
    instance, tmp_path
):
    folder = llama_folder(tmp_path / "model")
    resource = BaseModelResource(uri=str(folder))
    assert isinstance(_watcher_says(instance, resource), RunRequest), "never observed"
    assert _observe(instance, resource).success
    first = observed_version(instance, REFERENCE_BASE_MODEL)
    assert first == folder_sha256(folder)
    metadata = _metadata(instance)
    assert metadata["architecture"] == "LlamaForCausalLM"
    assert metadata["tied_embeddings"] is True and metadata["parameters"] > 0
    assert isinstance(_watcher_says(instance, resource), SkipReason), "nothing changed"

    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|eot_id|>", "<|eot_id|>\n"))
    assert isinstance(_watcher_says(instance, resource), RunRequest)
    assert _observe(instance, resource).success
    assert observed_version(instance, REFERENCE_BASE_MODEL) == folder_sha256(folder) != first


def test_a_model_without_a_chat_template_fails_its_observation_naming_the_setting(
    instance, tmp_path
):
    folder = llama_folder(tmp_path / "model")
    (folder / "chat_template.jinja").unlink()
    result = _observe(instance, BaseModelResource(uri=str(folder)))
    assert not result.success
    [failure] = [event for event in result.all_events if event.is_step_failure]
    message = failure.step_failure_data.user_failure_data.description
    assert message.startswith(f"PIPELINE_BASE_MODEL={folder}: ")
    assert "no chat template" in message
    assert observed_version(instance, REFERENCE_BASE_MODEL) is None


def test_a_model_on_s3_is_fetched_once_and_has_the_version_of_its_files(
    instance, tmp_path, s3_endpoint
):
    folder = llama_folder(tmp_path / "model")
    client = boto3.client("s3")
    for file in folder.iterdir():
        client.upload_file(str(file), BUCKET, f"models/llama/{file.name}")
    resource = BaseModelResource(
        uri=f"s3://{BUCKET}/models/llama", cache_dir=str(tmp_path / "cache")
    )
    assert _observe(instance, resource).success
    assert observed_version(instance, REFERENCE_BASE_MODEL) == folder_sha256(folder)
    cached = resource.local_folder()
    weights_fetched = (cached / "model.safetensors").stat().st_mtime_ns
    assert resource.local_folder() == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == weights_fetched, "fetched again"

    client.put_object(Bucket=BUCKET, Key="models/llama/chat_template.jinja", Body=b"{{ messages }}")
    assert isinstance(_watcher_says(instance, resource), RunRequest)
    assert Path(resource.local_folder() / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (cached / "model.safetensors").stat().st_mtime_ns == weights_fetched


def test_a_changed_model_shows_the_tokenizer_stale_because_of_it(instance, tmp_path, lake):
    folder = llama_folder(tmp_path / "model")
    resource = BaseModelResource(uri=str(folder))
    defs = Definitions(
        assets=[base_model, gold_tokenizer],
        jobs=[observe_base_model_job],
        resources={
            "base_model": resource,
            "lake": lake,
            "gold_policy": GoldPolicy(),
            "batch_gates": batch_gates(),
        },
    )
    assert _observe(instance, resource).success
    made = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, asset_selection=[GOLD_TOKENIZER]
    )
    assert made.success
    assert stale_status(defs, instance, GOLD_TOKENIZER)[0] == StaleStatus.FRESH

    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|eot_id|>", "<|eot_id|>\n"))
    assert _observe(instance, resource).success
    status, causes = stale_status(defs, instance, GOLD_TOKENIZER)
    assert status == StaleStatus.STALE
    assert [cause.key.asset_key for cause in causes] == [REFERENCE_BASE_MODEL]


def test_a_snapshot_trains_only_from_the_model_its_tokenizer_came_from(tmp_path):
    folder = llama_folder(tmp_path / "model")
    resource = BaseModelResource(uri=str(folder))
    row = {"base_model_version": folder_sha256(folder), "origin": f"base model {folder}"}
    assert snapshot_base_model(row, 3, resource).version == row["base_model_version"]
    assert snapshot_base_model({"base_model_version": None}, 3, BaseModelResource(uri="")) is None

    refusals = {
        "unset under a base-model tokenizer": (row, BaseModelResource(uri="")),
        "set under the built-in tokenizer": ({"base_model_version": None}, resource),
    }
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + "\n")
    refusals["changed under the snapshot"] = (row, resource)
    for why, (tokenizer_row, base) in refusals.items():
        with pytest.raises(Failure) as refused:
            snapshot_base_model(tokenizer_row, 3, base)
        message = refused.value.description
        assert "gold/tokenizer v3" in message and "PIPELINE_BASE_MODEL" in message, why
        assert not refused.value.allow_retries, why


def test_the_model_is_hashed_once_while_its_files_stay_as_they_were(tmp_path, monkeypatch):
    from pipeline_assets.lib.gold import base_model as lib_base_model

    hashed = []
    real = lib_base_model.folder_sha256
    monkeypatch.setattr(
        lib_base_model, "folder_sha256", lambda path: hashed.append(path) or real(path)
    )
    folder = llama_folder(tmp_path / "model")
    resource = BaseModelResource(uri=str(folder), cache_dir=str(tmp_path / "cache"))
    first = resource.inspect().version
    assert resource.inspect().version == first == real(folder) and len(hashed) == 1

    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + "\n")
    assert resource.inspect().version == real(folder) != first and len(hashed) == 2
