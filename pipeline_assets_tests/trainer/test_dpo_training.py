"""DPO in the trainer: a preference snapshot's rows read with their reference log-probabilities, the
policy starting at the reference (rewards 0, loss log 2), held-out preference accuracy that rises,
the metrics a run reports, and the SFT guarantees under torchrun: two ranks give one process's
gradients, a SIGTERM then a rerun ends with the uninterrupted parameters (a resume reads DPO's
rows and reference log-probabilities from the step it stopped at; the restart after a SIGKILL
resumes through the same code from the newest periodic checkpoint, whatever the objective:
trainer/test_torchrun.py, with both model backends)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import signal
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.distributed as dist

from pipeline_assets.lib import uris
from pipeline_assets.trainer.config import TrainConfig, parse_args
from pipeline_assets.trainer.data import (
    REFERENCE_TABLE,
    rank_micro_batches,
    read_preference_snapshot,
    stream_indexes,
)
from pipeline_assets.trainer.dpo import chosen_and_rejected, document_logps, dpo_loss
from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.parallel import Distributed
from pipeline_assets.trainer.train import Trainer
from pipeline_assets_tests.trainer.launch import (
    assert_close_gradients,
    assert_rerun_resumes_and_matches,
    final_weights,
    partition_dir,
    probe_gradients,
    run_job,
    stop_by_sigterm,
    tiny_config,
    with_checkpoints_at,
)
from pipeline_assets_tests.trainer.preference_synthetic import (
    PreferenceLake,
    export_init_model,
    score_rows,
    write_preference_lake,
    write_reference_logps,
)

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dpo")


@pytest.fixture(scope="module")
def lake(workspace) -> PreferenceLake:
    return write_preference_lake(
        str(workspace / "lake"), export_init_model(workspace / "sft-champion")
    )


def dpo_config(lake: PreferenceLake, checkpoint_uri: str, **overrides) -> TrainConfig:
    values = dict(
        partition=f"dpo-v{lake.snapshot}",
        objective="dpo",
        init_from=str(lake.init_model),
        reference_logps_version=lake.reference_version,
        steps=30,
        warmup_steps=5,
        eval_every=15,
    )
    return tiny_config(lake.lake_uri, lake.snapshot, checkpoint_uri, **{**values, **overrides})


@pytest.fixture(scope="module")
def config(lake, workspace) -> TrainConfig:
    return dpo_config(lake, str(workspace / "uninterrupted"))


class RecordingReporter:
    """What rank 0 would send to MLflow and Dagster Pipes, kept in lists."""

    mlflow_run_id = None

    def __init__(self):
        self.metrics_logged, self.tags_set, self.datasets = [], {}, []

    def metrics(self, step: int, values: dict) -> None:
        self.metrics_logged.append((step, values))

    def tags(self, tags: dict) -> None:
        self.tags_set.update(tags)

    def dataset(self, uri: str, version: int, name: str) -> None:
        self.datasets.append((uri, version, name))

    def info(self, message: str) -> None: ...

    def warning(self, message: str) -> None: ...

    def params(self, params: dict) -> None: ...

    def artifact(self, path: Path) -> None: ...


@contextlib.contextmanager
def one_rank(tmp_path: Path):
    """A one-rank gloo group in this process, one thread as a torchrun rank has; the signal handlers
    the Trainer installs are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        yield Distributed(0, 0, 1, torch.device("cpu"), "gloo", dist.new_group(backend="gloo"))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _first_micro_batches(trainer: Trainer) -> list[dict]:
    config = trainer.config
    return [
        trainer.snapshot.train.batch(indexes, trainer.env.device)
        for indexes in rank_micro_batches(
            len(trainer.snapshot.train),
            config.seed,
            0,
            0,
            1,
            config.micro_batch_size,
            config.grad_accum_steps,
        )
    ]


# --- the data -------------------------------------------------------------------------------------


def _stored_logps(
    lake: PreferenceLake, split: str, version: int | None = None
) -> list[list[float]]:
    """The split's reference log-probabilities as gold/reference_logps holds them, in global
    sequence order."""
    stored = pl.read_delta(
        uris.join(lake.lake_uri, *REFERENCE_TABLE), version=version or lake.reference_version
    )
    return (
        stored.join(lake.manifest.offsets(), on=["batch_id", "split"])
        .filter(pl.col("split") == split)
        .sort(pl.col("sequence_index") + pl.col("offset"))["reference_logps"]
        .to_list()
    )


def test_a_batch_carries_every_documents_reference_logp_in_row_order_a_block_at_a_time(lake):
    snapshot = read_preference_snapshot(
        lake.lake_uri, lake.snapshot, lake.reference_version, block=8, cached_blocks=2
    )
    stored = _stored_logps(lake, "train")
    assert (
        len(snapshot.train) == len(stored) > 4 * 8
        and len(snapshot.validation) > 0
        and len(snapshot.search) == 0
    )

    for start in range(0, len(snapshot.train), 6):  # the first epoch, six rows a step
        indexes = stream_indexes(
            len(snapshot.train), 3, start, min(6, len(snapshot.train) - start), block=8
        )
        batch = snapshot.train.batch(indexes, torch.device("cpu"))
        expected = [value for index in indexes for value in stored[index]]
        assert (
            batch["reference_logps"].dtype == torch.float64
            and batch["reference_logps"].tolist() == expected
        )
        assert batch["input_ids"].shape == (len(indexes), 64)
        assert snapshot.train.cached_sequences <= 2 * 8
    assert snapshot.about() == {
        "data_snapshot": "dpo-v0",
        "reference_model": "sft-model/1",
        "reference_logps_version": lake.reference_version,
    }


def test_missing_doubled_or_miscounted_reference_logps_fail_clearly(tmp_path):
    lake = write_preference_lake(
        str(tmp_path / "lake"), export_init_model(tmp_path / "init"), n_pairs=100
    )
    scored = score_rows(lake.lake_uri, lake.manifest, lake.init_model)

    def version_holding(frame: pl.DataFrame) -> int:
        return write_reference_logps(lake.lake_uri, lake.manifest, frame, mode="overwrite")

    def read(version: int):
        return read_preference_snapshot(lake.lake_uri, lake.snapshot, version)

    with pytest.raises(
        ValueError,
        match=r"does not hold a row per sequence of dpo-v0 \(validation: \d+ rows for \d+",
    ):
        read(
            version_holding(
                scored.filter(
                    ~((pl.col("split") == "validation") & (pl.col("sequence_index") == 0))
                )
            )
        )
    version_holding(scored)
    doubled = write_reference_logps(
        lake.lake_uri, lake.manifest, scored, reference_model="sft-model/2"
    )
    with pytest.raises(
        ValueError, match=r"found those of 2 reference models \(sft-model/1, sft-model/2\)"
    ):
        read(doubled)
    with pytest.raises(ValueError, match="cannot read .*reference_logps at version 99"):
        read(99)

    short = (
        (pl.col("split") == "train")
        & (pl.col("batch_id") == "b0")
        & (pl.col("sequence_index") == 2)
    )
    miscounted = read(
        version_holding(
            scored.with_columns(
                reference_logps=pl.when(short)
                .then(pl.col("reference_logps").list.slice(1))
                .otherwise("reference_logps")
            )
        )
    )
    documents = len(scored.filter(short)["reference_logps"][0])
    with pytest.raises(
        ValueError,
        match=f"train sequence 2 has {documents} documents but {documents - 1} reference",
    ):
        miscounted.train.batch(np.array([0, 2]), torch.device("cpu"))


# --- the configuration ----------------------------------------------------------------------------


def test_the_dpo_flags_round_trip_and_what_dpo_needs_is_required(config):
    assert parse_args(config.to_args()) == config
    assert {"--objective", "--beta", "--init-from", "--reference-logps-version"} <= set(
        config.to_args()
    )
    sft = dataclasses.replace(config, objective="sft", init_from="", reference_logps_version=-1)
    assert parse_args(sft.to_args()) == sft and "--init-from" not in sft.to_args()
    assert TrainConfig.__dataclass_fields__["beta"].default == 0.1

    with pytest.raises(ValueError, match="needs --init-from"):
        dataclasses.replace(config, init_from="")
    with pytest.raises(ValueError, match="needs --reference-logps-version"):
        dataclasses.replace(config, reference_logps_version=-1)
    with pytest.raises(ValueError, match="for --objective dpo only"):
        dataclasses.replace(sft, reference_logps_version=3)
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        dataclasses.replace(config, objective="ppo")


def test_an_init_model_of_another_architecture_is_refused(lake, tmp_path):
    with (
        one_rank(tmp_path) as env,
        pytest.raises(
            ValueError,
            match="another architecture .* run with --preset tiny, --width 0, --vocab-size 64",
        ),
    ):
        Trainer(dpo_config(lake, str(tmp_path / "checkpoints"), width=128), env, None)


# --- the objective in one process -----------------------------------------------------------------


def test_at_step_0_the_policy_is_the_reference_so_rewards_are_0_and_the_loss_is_log_2(
    lake, tmp_path
):
    with one_rank(tmp_path) as env:
        trainer = Trainer(dpo_config(lake, str(tmp_path / "checkpoints")), env, None)
        step = trainer.accumulate_gradients(_first_micro_batches(trainer))
        held_out_loss = trainer._validate()
        evaluation = trainer.progress.history[-1]

    assert step["loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert [step[name] for name in REWARDS] == [0.0, 0.0, 0.0, 0.0]  # ties: no pair is won yet
    assert held_out_loss == pytest.approx(math.log(2), abs=1e-12)
    assert evaluation["eval/preference_accuracy"] == 0.0 and evaluation["eval/reward_margin"] == 0.0


def test_a_policy_that_is_not_the_reference_has_rewards_at_step_0(lake, tmp_path):
    other = export_init_model(tmp_path / "other", seed=8)  # the same architecture, other weights
    with one_rank(tmp_path) as env:
        trainer = Trainer(
            dpo_config(lake, str(tmp_path / "checkpoints"), init_from=str(other)), env, None
        )
        step = trainer.accumulate_gradients(_first_micro_batches(trainer))

    assert abs(step["rewards/chosen"]) > 1e-3 and step["loss"] != pytest.approx(
        math.log(2), abs=1e-4
    )


def test_held_out_preference_accuracy_rises_from_ties_and_every_log_step_reports_the_rewards(
    lake, tmp_path
):
    reporter = RecordingReporter()
    config = dpo_config(lake, str(tmp_path / "checkpoints"), steps=20, log_every=5, eval_every=10)
    with one_rank(tmp_path) as env:
        trainer = Trainer(config, env, reporter)
        before = trainer.objective.evaluation(_held_out_means(trainer), "validation")
        code, metadata = trainer.run()

    assert code == 0 and before["eval/preference_accuracy"] == 0.0
    assert metadata["eval/preference_accuracy"] >= 0.75 and metadata["eval/reward_margin"] > 0
    assert (
        metadata["best_validation_loss"] < math.log(2)
        and metadata["final_loss"] < metadata["first_loss"]
    )
    assert metadata["objective"] == "dpo" and metadata["reference_model"] == "sft-model/1"
    logged = [values for _, values in reporter.metrics_logged if "loss" in values]
    assert [step for step, values in reporter.metrics_logged if "loss" in values] == [5, 10, 15, 20]
    assert all({*REWARDS, "tokens_per_second", "grad_norm"} <= set(values) for values in logged)
    evaluations = [values for _, values in reporter.metrics_logged if "validation_loss" in values]
    assert len(evaluations) == 2 and all(
        {"eval/preference_accuracy", "eval/reward_margin"} <= set(values) for values in evaluations
    )
    assert (
        reporter.tags_set["data_snapshot"] == "dpo-v0"
        and reporter.tags_set["reference_model"] == "sft-model/1"
    )
    assert [name.split(":")[1].split("@")[0].strip() for _, _, name in reporter.datasets] == [
        "gold/preference_sequences",
        "gold/reference_logps",
    ]
    about = json.loads(
        (tmp_path / "checkpoints" / "dpo-v0" / "final" / "pipeline.json").read_text()
    )
    assert (
        about["objective"] == "dpo"
        and about["eval/preference_accuracy"] == metadata["eval/preference_accuracy"]
    )


@torch.no_grad()
def _held_out_means(trainer: Trainer) -> dict[str, float]:
    """The objective's means over the held-out split, as an evaluation measures them."""
    held_out = trainer.snapshot.validation
    batch = held_out.batch(np.arange(len(held_out)), trainer.env.device)
    units = trainer.objective.units(batch)
    losses = trainer.model(batch["input_ids"], batch["position_ids"], next_token_losses=True)
    _, sums = trainer.objective.loss(losses, batch, units, 1)
    return {name: (value / units).item() for name, value in sums.items()}


# --- under torchrun -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(config, workspace) -> dict:
    """The reference: the same two-rank job, never stopped."""
    output = run_job(config, workspace / "uninterrupted.log")
    first = re.search(
        r"step 1/\d+: loss ([0-9.]+), rewards/chosen (-?[0-9.]+), rewards/rejected (-?[0-9.]+), "
        r"rewards/margins (-?[0-9.]+), rewards/accuracies ([0-9.]+)",
        output,
    )
    assert (
        first
        and first.group(1) == "0.6931"
        and all(float(value) == 0 for value in first.groups()[1:])
    ), output
    about = json.loads((partition_dir(config) / "final" / "pipeline.json").read_text())
    assert about["eval/preference_accuracy"] >= 0.75, "two ranks learn the counting preference too"
    return final_weights(config)


def test_two_ranks_give_the_gradients_of_one_process_on_the_same_global_batch(
    config, lake, workspace
):
    sharded = probe_gradients(config, workspace / "gradients.pt")

    snapshot = read_preference_snapshot(lake.lake_uri, lake.snapshot, lake.reference_version)
    batch = snapshot.train.batch(
        stream_indexes(len(snapshot.train), config.seed, 0, config.global_batch(2)),
        torch.device("cpu"),
    )
    model, _ = load_exported(lake.init_model)
    logits = model(batch["input_ids"], batch["position_ids"])
    policy = document_logps(logits, batch["input_ids"], batch["loss_mask"], batch["position_ids"])
    loss, _ = dpo_loss(
        *chosen_and_rejected(policy),
        *chosen_and_rejected(batch["reference_logps"]),
        beta=config.beta,
    )
    loss.backward()

    assert sharded["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert_close_gradients(sharded["gradients"], model, atol=1e-7)


def test_sigterm_saves_and_exits_143_and_the_rerun_finishes_identically(
    config, workspace, uninterrupted
):
    stopped = with_checkpoints_at(config, str(workspace / "stopped"))
    stop_step = stop_by_sigterm(stopped, 10, workspace / "stopped-1.log")
    assert_rerun_resumes_and_matches(stopped, stop_step, workspace / "stopped-2.log", uninterrupted)
