"""The local Ray's options: everything under PIPELINE_HOME, within Ray's socket-path limit."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from pipeline_assets.resources.engine import actor_pool, local_ray_options

RAY_SESSION_CHARS = 70  # what Ray's session folder and socket names add to its temporary folder
SOCKET_PATH_LIMIT = 107


def test_a_long_home_and_a_long_system_temp_still_give_ray_a_short_folder_under_home(
    tmp_path, monkeypatch
):
    home = tmp_path / ("a-long-pipeline-home-" * 4)
    long_temp = tmp_path / ("a-long-system-temp-" * 3)  # as macOS's /var/folders/... is
    long_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_temp))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.setenv(name, "")  # restored after the test: local_ray_options sets them

    options = local_ray_options(home)
    folder = Path(options["_temp_dir"])
    try:
        assert len(str(folder)) + RAY_SESSION_CHARS <= SOCKET_PATH_LIMIT
        assert folder.resolve() == (home / "ray" / "tmp").resolve(), (
            "Ray's files land under PIPELINE_HOME"
        )
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert token.parent == home / "ray" and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert options["include_dashboard"] is False and options["_node_ip_address"] == "127.0.0.1"
    finally:
        if folder.is_symlink():
            folder.unlink()


KUBERAY_SETTINGS = """\
image: registry.example.com/pipeline-assets:1.4
ray_job:
  metadata: {namespace: ml-data}
  spec:
    ray_cluster_spec:
      worker_group_specs:
        - groupName: cpu
          replicas: 4
          rayStartParams: {}
          template:
            spec:
              containers:
                - name: ray-worker
                  resources: {requests: {cpu: "8", memory: 32Gi}}
"""


def test_the_kuberay_setting_gives_silver_and_gold_a_rayjob_for_every_batch(tmp_path, monkeypatch):
    """No Kubernetes here: what is shown is the engine the setting chooses, wired into the code
    location, and the RayJob it would create; dagster-ray creates and connects to it when a
    step starts."""
    from dagster import DagsterInstance, build_init_resource_context

    from pipeline_assets.definitions import build_definitions
    from pipeline_assets.defs.keys import GOLD_SEQUENCES, SILVER_RECORDS
    from pipeline_assets.resources.engine import BLOCK_TASK_ENV, KubeRayEngine
    from pipeline_assets.resources.settings import Settings

    settings_file = tmp_path / "kuberay.yaml"
    settings_file.write_text(KUBERAY_SETTINGS)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.setenv("PIPELINE_KUBERAY", str(settings_file))
    defs = build_definitions(Settings.from_env())
    engine = defs.resources["ray_engine"]
    assert isinstance(engine, KubeRayEngine) and engine.uses_ray(1), (
        "on KubeRay every batch runs on the cluster"
    )
    assert {"ray_engine"} <= defs.resolve_assets_def(SILVER_RECORDS).required_resource_keys
    assert {"ray_engine"} <= defs.resolve_assets_def(GOLD_SEQUENCES).required_resource_keys

    manifest = engine.ray_job.to_k8s(
        build_init_resource_context(instance=DagsterInstance.ephemeral()),
        image=engine.image,
        env_vars=engine.get_env_vars_to_inject(),
    )
    assert manifest["kind"] == "RayJob" and manifest["spec"]["submissionMode"] == "InteractiveMode"
    assert engine.namespace == "ml-data"
    cluster = manifest["spec"]["rayClusterSpec"]
    pods = [
        cluster["headGroupSpec"]["template"]["spec"],
        *(group["template"]["spec"] for group in cluster["workerGroupSpecs"]),
    ]
    for pod in pods:
        container = pod["containers"][0]
        assert container["image"] == "registry.example.com/pipeline-assets:1.4"
        assert {
            "name": "POLARS_MAX_THREADS",
            "value": BLOCK_TASK_ENV["POLARS_MAX_THREADS"],
        } in container["env"]
    assert cluster["workerGroupSpecs"][0]["replicas"] == 4

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(ValueError, match="RAY_ADDRESS and PIPELINE_KUBERAY are both set"):
        Settings.from_env()
    monkeypatch.delenv("RAY_ADDRESS")
    settings_file.write_text(
        KUBERAY_SETTINGS.replace("  metadata: {namespace: ml-data}", "  namespace: ml-data")
    )
    with pytest.raises(
        ValueError, match=r"PIPELINE_KUBERAY=.*unknown field\(s\) ray_job.namespace"
    ):
        build_definitions(Settings.from_env())


def test_the_model_stages_pool_takes_a_gpu_an_actor_or_half_the_cores_never_more_than_blocks():
    on_gpus = actor_pool({"CPU": 64.0, "GPU": 8.0}, blocks=20)
    assert (on_gpus["compute"].min_size, on_gpus["num_gpus"]) == (8, 1)
    assert actor_pool({"CPU": 64.0, "GPU": 8.0}, blocks=3)["compute"].max_size == 3
    on_cpus = actor_pool({"CPU": 16.0}, blocks=20)
    assert (on_cpus["compute"].max_size, on_cpus["num_cpus"]) == (8, 1)
    assert "num_gpus" not in on_cpus
    assert actor_pool({"CPU": 1.0}, blocks=20)["compute"].max_size == 1
