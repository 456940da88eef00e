"""A rollout worker between the learner's publish and prune: the version it picked can vanish before
it loads it (the learner published and pruned meanwhile). It reads the newest version again instead
of exiting; a version that is published but broken still stops it with the reason."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from pipeline_assets.trainer.export import WEIGHTS, load_exported
from pipeline_assets.trainer.policy_store import PolicyStore, version_folder
from pipeline_assets.trainer.replay_io import ReplayTable
from pipeline_assets.trainer.rollout import RolloutWorker
from pipeline_assets_tests.trainer.rl_setup import rl_inputs


def _publish(policies: PolicyStore, model, *versions: int) -> None:
    for version in versions:
        policies.publish(version, model, None, {})


def _worker_with_versions(tmp_path, *versions: int) -> tuple[RolloutWorker, object]:
    config = replace(rl_inputs(tmp_path, bank_tasks=60), worker=1, lag=3, max_staleness=1)
    model, _ = load_exported(config.init_from)
    worker = RolloutWorker(config)
    _publish(worker.policies, model, *versions)
    return worker, model


def test_a_version_pruned_between_newest_and_load_sends_the_worker_back_to_the_newest(
    tmp_path, caplog
):
    worker, model = _worker_with_versions(tmp_path, 0, 1, 2, 3, 4)
    newest = worker.policies.newest

    def learner_moves_on_after_newest_is_read():
        seen = newest()
        _publish(worker.policies, model, seen + 1)
        worker.policies.prune(seen + 1, worker.config.max_staleness)  # as the learner does
        worker.policies.newest = newest  # once
        return seen

    worker.policies.newest = learner_moves_on_after_newest_is_read
    with caplog.at_level(logging.INFO, logger="pipeline_assets.trainer.rollout"):
        assert worker.roll_once(0) is False, "v1 was pruned: no batch from it"
        assert "policy v1 was pruned before worker-1 loaded it: reading again" in caplog.text
        assert ReplayTable(worker.config.lake_uri).read().is_empty()

        assert worker.roll_once(0) is True
    rows = ReplayTable(worker.config.lake_uri).read()
    assert set(rows["policy_version"]) == {2}, "the newest version (5) less the lag (3)"


def test_a_published_version_that_does_not_load_stops_the_worker_with_the_reason(tmp_path):
    worker, _ = _worker_with_versions(tmp_path, 0)
    weights = worker.policies.store.local_folder(version_folder(0)) / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])

    with pytest.raises(RuntimeError, match="policy version 0 cannot be loaded: .*checksum"):
        worker.roll_once(0)
