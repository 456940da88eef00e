"""Silver's and gold's block stages on a two-node Ray cluster (RAY_ADDRESS): three batches from
landing to gold, the same rows as in one process, an eval item's copy decontaminated on both."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import polars as pl
import pytest
from dagster import materialize

from pipeline_assets.defs.bronze.assets import bronze
from pipeline_assets.defs.gold.assets import gold_sequences, gold_tokenizer
from pipeline_assets.defs.gold.policy import GoldPolicy
from pipeline_assets.defs.policies import SilverPolicy
from pipeline_assets.defs.reference.assets import eval_sets
from pipeline_assets.defs.resources import batch_gates
from pipeline_assets.defs.silver.assets import silver
from pipeline_assets.lib.gold.tokenizer import tokenizer_to_json, train_bpe
from pipeline_assets.resources import engine as engine_module
from pipeline_assets.resources.base_model import BaseModelResource
from pipeline_assets.resources.engine import (
    LOCAL_RAY_TASK_EVENTS,
    RayEngine,
    init_arguments,
    local_ray_options,
)
from pipeline_assets.resources.eval_sets import EvalSetsResource
from pipeline_assets.resources.lake import LakeResource
from pipeline_assets.resources.landing import LandingResource
from pipeline_assets.resources.quality_models import QualityModelsResource
from pipeline_assets_tests.conftest import record, write_landing_file
from pipeline_assets_tests.defs.bronze_helpers import register
from pipeline_assets_tests.hf_models import classifier_folder

BATCHES = 3
SEQ_LEN = 128
WORDS = [f"w{i}" for i in range(400)]
LEAKED = (1, 20)  # (batch, row): a record whose response is also an eval item's prompt


@pytest.fixture(scope="module")
def batches() -> list[list[dict]]:
    """Three batches of 150 records: near duplicates within each, and an exact copy of the first
    batch's first record in each later one."""
    rng = random.Random(11)
    batches = []
    for batch in range(BATCHES):
        rows = [
            record(i, response=" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))))
            for i in range(batch * 1000, batch * 1000 + 150)
        ]
        rows[3]["response"] = " ".join(rng.choice(WORDS) for _ in range(120))
        rows[7] = {
            **rows[3],
            "id": rows[7]["id"],
            "response": rows[3]["response"] + " again",
        }  # one word more
        batches.append(rows)
    for rows in batches[1:]:
        rows[11] = {**batches[0][0], "id": rows[11]["id"]}
    return batches


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a worker node, one CPU each, in this test's process tree."""
    from ray.cluster_utils import Cluster

    folder = Path(
        tempfile.mkdtemp(prefix="ray-")
    )  # short: Ray's socket paths must fit in 107 bytes
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")  # no token file under the user's home
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.setenv(
            "RAY_TMPDIR", str(folder)
        )  # Ray's session files, and the address file of the newest cluster
        # Ray reads its auth settings once a process: read them again (a local Ray before, in
        # this pytest worker, ran with a token)
        from ray._private.authentication_test_utils import reset_auth_token_state

        reset_auth_token_state()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "object_store_memory": 200 * 1024**2,
            },
        )
        cluster.add_node(num_cpus=1, object_store_memory=200 * 1024**2)
        try:
            yield cluster.address
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory) -> dict:
    """A reward model's shape as the user's scorer: on Ray, its stage runs on an actor pool."""
    folder = classifier_folder(tmp_path_factory.mktemp("scorer") / "reward", num_labels=1)
    return {"name": "reward", "model": str(folder)}


@pytest.fixture(scope="module")
def tokenizer_file(batches, tmp_path_factory) -> str:
    """One tokenizer both runs encode with (PIPELINE_TOKENIZER), trained on the batches' text."""
    texts = [f"{row['prompt']} {row['response']}" for rows in batches for row in rows]
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(tokenizer_to_json(train_bpe(texts, vocab_size=300)))
    return str(path)


def _landing_to_gold(
    root, rows_by_batch, instance, tokenizer_file, scorer
) -> tuple[dict[str, pl.DataFrame], list[dict]]:
    """Each batch from landing to its gold shard, one run a batch; the tables by record origin, and
    each run's silver and gold metadata."""
    landing_dir = root / "landing"
    resources = {
        "lake": LakeResource(uri=str(root / "lake")),
        "landing": LandingResource(uri=str(landing_dir)),
        "eval_sets": EvalSetsResource(uri=str(root / "eval")),
        "silver_policy": SilverPolicy(),
        "quality_models": QualityModelsResource(models=json.dumps([scorer])),
        "batch_gates": batch_gates(),
        "gold_policy": GoldPolicy(tokenizer_path=tokenizer_file, seq_len=SEQ_LEN),
        "base_model": BaseModelResource(uri=""),
        "ray_engine": RayEngine(home=str(root / "home"), rows_per_block=40),
    }
    (root / "eval").mkdir(parents=True, exist_ok=True)
    batch, row = LEAKED
    leaked = {
        "eval_set": "leaky_bench",
        "item_id": "q1",
        "prompt": rows_by_batch[batch][row]["response"],
        "response": "an answer",
    }
    (root / "eval" / "leaky_bench.jsonl").write_text(json.dumps(leaked) + "\n")
    assets = [eval_sets, bronze, silver, gold_tokenizer, gold_sequences]
    assert materialize(
        assets, selection=[gold_tokenizer], instance=instance, resources=resources
    ).success
    metadata = []
    for number, rows in enumerate(rows_by_batch):
        write_landing_file(landing_dir, "synth", f"part-{number}.jsonl", rows)
        batch = register(instance, resources)
        result = materialize(
            assets,
            selection=[eval_sets, bronze, silver, gold_sequences],
            partition_key=batch,
            instance=instance,
            resources=resources,
        )
        assert result.success
        metadata.append(
            {
                step: {
                    k: v.value
                    for k, v in result.asset_materializations_for_node(step)[0].metadata.items()
                }
                for step in ("silver", "gold__sequences")
            }
        )
    lake = resources["lake"]
    where = {
        rid: f"{file}:{line}"
        for rid, file, line in lake.read("bronze", "records")
        .select("record_id", "source_file", "source_line")
        .iter_rows()
    }
    tables = {
        name: _by_origin(lake.read("silver", name), where)
        for name in ("records", "rejects", "minhash_index", "minhash_bands")
    }
    return {
        **tables,
        "gold/sequences": _sequences_by_origin(lake.read("gold", "sequences"), where),
    }, metadata


def _sequences_by_origin(sequences: pl.DataFrame, where: dict[str, str]) -> pl.DataFrame:
    """Each shard's sequences with their records named by origin. A shard's shuffle is seeded by its
    batch key, which names the registration time, so the sequences are compared in the order of
    their records."""
    return (
        sequences.with_columns(
            pl.col("record_ids").list.eval(pl.element().replace_strict(where, default=None))
        )
        .drop("batch_id", "sequence_index")
        .sort("split", "record_ids")
    )


def _by_origin(frame: pl.DataFrame, where: dict[str, str]) -> pl.DataFrame:
    """Record ids (which name the batch's registration time) as the file and line they came from;
    the columns that say when a run happened, dropped."""
    ids = [c for c in ("record_id", "cluster_id", "duplicate_of") if c in frame.columns]
    return (
        frame.with_columns(pl.col(c).replace_strict(where, default=None) for c in ids)
        .drop(
            [
                c
                for c in ("batch_id", "ingested_at", "evidence", "duplicate_of_batch")
                if c in frame.columns
            ]
        )
        .sort("record_id", *(["band"] if "band" in frame.columns else []))
    )


def test_landing_to_gold_on_a_two_node_ray_cluster_equals_one_process(
    two_node_cluster, batches, tokenizer_file, scorer, instance, tmp_path, monkeypatch
):
    local, local_metadata = _landing_to_gold(
        tmp_path / "local", batches, instance, tokenizer_file, scorer
    )
    assert {m["silver"]["block_stages_ran_on"] for m in local_metadata} == {"this process"}
    assert {m["gold__sequences"]["tokenized_on"] for m in local_metadata} == {"this process"}
    assert [m["silver"]["index_lookup_ran_on"] for m in local_metadata] == [
        "nothing to look up",
        *["this process"] * 2,
    ]

    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster)
    on_ray, ray_metadata = _landing_to_gold(
        tmp_path / "ray", batches, instance, tokenizer_file, scorer
    )

    # four blocks a batch, each task's polars on its one CPU
    both_nodes = "Ray, 2 node(s), 1 polars thread(s) a task"
    assert {m["silver"]["block_stages_ran_on"] for m in ray_metadata} == {both_nodes}
    assert {m["gold__sequences"]["tokenized_on"] for m in ray_metadata} == {both_nodes}
    assert [m["silver"]["index_lookup_ran_on"] for m in ray_metadata] == [
        "nothing to look up",
        *["Ray, 2 node(s)"] * 2,
    ]  # a task a band
    # only keys, verdicts, index hashes and task results reach the step's process (issue 37)
    step_bytes = [m["silver"]["step_bytes_per_record"] for m in ray_metadata]
    print(f"bytes through silver's step a record, by batch: {step_bytes}")
    for m in ray_metadata:
        print(f"  by kind: {m['silver']['step_bytes_per_record_by_kind']}")
    for m in ray_metadata:  # the sizer's parts: what spreads over a cluster, and the step's own
        silver = m["silver"]
        assert silver["search_wall_seconds"] > 0  # the band searches within the batch
        assert silver["block_wall_seconds"] == pytest.approx(
            silver["prepare_wall_seconds"]
            + silver["search_wall_seconds"]
            + silver["write_wall_seconds"],
            abs=0.002,
        )
        assert min(silver["decide_seconds"], silver["commit_seconds"]) > 0
        assert silver["block_stage_seconds"] > 0
    found = [m["silver"]["index_entries_found"] for m in ray_metadata]
    assert found == [m["silver"]["index_entries_found"] for m in local_metadata] and found[
        0
    ] == 0 < min(found[1:])
    assert set(local["rejects"]["stage"]) >= {"exact_dup", "near_dup", "decontaminated"}
    leaked = on_ray["rejects"].filter(pl.col("stage") == "decontaminated")
    assert leaked["eval_item_id"].to_list() == ["q1"], (
        "the eval item's copy, found by the index the workers built from the items sent to Ray"
    )
    assert local["gold/sequences"]["record_ids"].list.len().sum() == local["records"].height, (
        "every silver record in a shard"
    )
    # the scorer's model loaded once a process: once in the step's process for the three batches,
    # once an actor on Ray (one actor a batch on two cores, for its four blocks)
    assert [m["silver"]["scorers"]["reward"]["model_loads"] for m in local_metadata] == [1, 0, 0]
    assert [m["silver"]["scorers"]["reward"]["model_loads"] for m in ray_metadata] == [1, 1, 1]
    assert [m["silver"]["scorers"]["reward"]["actors"] for m in ray_metadata] == [1, 1, 1]
    assert all(m["silver"]["scorers"]["reward"]["ran_on"].startswith("Ray, ") for m in ray_metadata)
    # the scorer's model ran on the actor pool, one torch thread an actor: its scores agree with
    # the step's process within fp32 rounding, every other column exactly
    assert (on_ray["records"]["score_reward"] - local["records"]["score_reward"]).abs().max() < 1e-4
    for name, frame in local.items():
        assert (
            on_ray[name]
            .drop("score_reward", strict=False)
            .equals(frame.drop("score_reward", strict=False))
        ), name
    assert 0 < max(step_bytes) <= 1_500


class _NotesPickling:
    """A value that notes each time it is pickled, in this process, in a file."""

    def __init__(self, notes: str) -> None:
        self.notes = notes

    def __reduce__(self):
        with open(self.notes, "a") as notes:
            notes.write("pickled\n")
        return (_NotesPickling, (self.notes,))


def _given(call: int, shared: _NotesPickling) -> tuple[int, str]:
    return call, shared.notes


def test_what_every_task_is_given_is_sent_to_ray_once(two_node_cluster, tmp_path, monkeypatch):
    """Silver's prepare tasks all need the eval items: they are sent once a batch, not once a task
    (a copy a task, in Ray's object store, grew the step's memory with the batch's size)."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster)
    notes = tmp_path / "notes"
    engine = RayEngine(home=str(tmp_path / "home"))
    try:
        done = engine.map_tasks(
            _given, [(call,) for call in range(6)], 6, (_NotesPickling(str(notes)),)
        )
    finally:
        ray.shutdown()
    assert done.results == [(call, str(notes)) for call in range(6)]
    assert notes.read_text().splitlines() == ["pickled"]


def _gcs_rss_mb(session_dir: str) -> float:
    """The resident memory of the GCS server of the Ray whose session folder is ``session_dir``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"gcs_server" in command and session_dir.encode() in command:
                status = Path(f"/proc/{pid}/status").read_text()
                return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        except OSError:
            continue
    raise AssertionError(f"no GCS server of {session_dir}")


def test_a_users_ray_init_options_come_after_ours_their_system_config_merged(tmp_path, monkeypatch):
    """A user's ``ray_init_options`` override ours key by key: their ``_system_config`` is merged
    over the local Ray's (the GCS cap kept unless they set it), their runtime env's variables over
    the block tasks' threads, and the variables Dagster injects last."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.setenv(name, "")  # restored after: local_ray_options sets them
    ours = local_ray_options(tmp_path)
    users = {
        "_system_config": {"object_spilling_threshold": 0.9},
        "num_cpus": 1,
        "runtime_env": {"env_vars": {"POLARS_MAX_THREADS": "2", "MINE": "1"}, "pip": ["x"]},
    }
    arguments = init_arguments(ours, users, {"DAGSTER_RUN_ID": "r"})
    assert arguments["_system_config"] == {
        "task_events_max_num_task_in_gcs": LOCAL_RAY_TASK_EVENTS,
        "object_spilling_threshold": 0.9,
    }
    assert arguments["num_cpus"] == 1 and arguments["include_dashboard"] is False
    assert arguments["runtime_env"] == {
        "env_vars": {"POLARS_MAX_THREADS": "2", "MINE": "1", "DAGSTER_RUN_ID": "r"},
        "pip": ["x"],
    }
    capped = init_arguments(ours, {"_system_config": {"task_events_max_num_task_in_gcs": 5}}, {})
    assert capped["_system_config"] == {"task_events_max_num_task_in_gcs": 5}
    assert users["_system_config"] == {"object_spilling_threshold": 0.9}, "theirs left as given"
    on_a_cluster = init_arguments({}, users, {})
    assert on_a_cluster["_system_config"] == {"object_spilling_threshold": 0.9}


def test_a_local_rays_gcs_keeps_a_bounded_number_of_task_events(tmp_path, monkeypatch):
    """Ray's GCS keeps every task's events up to a cap (100,000 by default), about 4 KB each: a
    large batch's many tasks grew it to a gigabyte. The local Ray the engine starts caps them, so
    its memory stops growing once the cap is reached (a cap of 1,000 here, to see it in seconds)."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(engine_module, "LOCAL_RAY_TASK_EVENTS", 1_000)
    # Ray keeps one auth mode a process, read at its first use: this pytest worker may have run the
    # two-node cluster (auth off). Set this home's token, then have Ray read it again.
    local_ray_options(tmp_path / "home")
    reset_auth_token_state()
    engine = RayEngine(home=str(tmp_path / "home"), min_rows=0)
    try:
        engine.map_tasks(len, [("x",)] * 2_000, 2_000)  # starts the local Ray
        session = ray._private.worker._global_node.get_session_dir_path()
        capped = _gcs_rss_mb(session)
        for _ in range(4):
            done = engine.map_tasks(len, [("x" * 2_000,)] * 2_000, 2_000)
        grown = _gcs_rss_mb(session) - capped
    finally:
        ray.shutdown()
    assert done.results == [2_000] * 2_000 and done.ran_on.startswith("Ray")
    assert grown < 12, f"the GCS grew by {grown:.0f} MB over 8,000 more tasks (37 MB uncapped)"
