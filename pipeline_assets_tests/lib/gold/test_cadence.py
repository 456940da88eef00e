"""When a snapshot may be cut: the share rule, and never without a train and a validation
sequence (a handful of records, or a batch of duplicates, makes neither)."""

from pipeline_assets.lib.gold.cadence import CadenceInputs, lacks_a_split, snapshot_due


def test_a_snapshot_needs_a_train_and_a_validation_sequence():
    assert lacks_a_split({"train": 12, "validation": 1, "search": 0}) is None
    only_train = lacks_a_split({"train": 1, "validation": 0, "search": 0})
    assert "no validation sequence" in only_train and "1 train" in only_train
    assert "no train and no validation" in lacks_a_split({})


def test_the_first_snapshot_is_due_and_later_ones_at_the_share():
    first = snapshot_due(CadenceInputs({"b1": 100}, None, 0), 0.1)
    assert first == (True, "first snapshot (1 batch shard(s))")
    assert snapshot_due(CadenceInputs({"b2": 9}, "gold-v0", 100), 0.1)[0] is False
    assert snapshot_due(CadenceInputs({"b2": 10}, "gold-v0", 100), 0.1)[0] is True
