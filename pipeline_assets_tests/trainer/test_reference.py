"""The DPO reference pass: packed rows score each document as if it were alone, two torchrun ranks
give one process's values with every row once, and a row whose documents do not match its pairs
fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

from pipeline_assets.lib.gold.preference_packing import pack_pairs
from pipeline_assets.lib.training.torchrun import torchrun_command, torchrun_env
from pipeline_assets.trainer import reference
from pipeline_assets.trainer.export import load_exported, save_exported
from pipeline_assets.trainer.reference import read_reference_logps, reference_logps
from pipeline_assets_tests.trainer.dpo_batches import (
    CONFIG,
    PAD_ID,
    SEQ_LEN,
    policy_and_reference,
    random_pairs,
)

MODULE = "pipeline_assets.trainer.reference"
# Rows with a padding tail and one exactly full (2 * 8 + 24 + 24 = 64 tokens), as in test_dpo.
SHAPES = [(8, 24, 24), (5, 9, 7), (3, 4, 12), (6, 2, 5), (1, 1, 1), (9, 10, 3), (2, 7, 7)]
SHARDS = [("b1", "train"), ("b1", "validation"), ("b2", "train")]  # sequence_index restarts in each


def tokenized_pairs() -> pl.DataFrame:
    """Pairs of every shard, their pair_ids unique over the shards, with batch_id and split."""
    frames = []
    for seed, (batch_id, split) in enumerate(SHARDS):
        pairs = random_pairs(SHAPES, seed=seed)
        frames.append(
            pairs.with_columns(
                pair_id=pl.lit(f"{batch_id}-{split}-") + pl.col("pair_id"),
                batch_id=pl.lit(batch_id),
                split=pl.lit(split),
            )
        )
    return pl.concat(frames)


def packed_rows(pairs: pl.DataFrame) -> pl.DataFrame:
    """Each shard's pairs packed, with the key gold gives its rows (batch_id, split,
    sequence_index)."""
    frames = []
    for batch_id, split in SHARDS:
        shard = pairs.filter((pl.col("batch_id") == batch_id) & (pl.col("split") == split))
        frames.append(
            pack_pairs(shard, SEQ_LEN, PAD_ID).rows.with_columns(
                batch_id=pl.lit(batch_id),
                split=pl.lit(split),
                sequence_index=pl.int_range(pl.len(), dtype=pl.Int64),
            )
        )
    return pl.concat(frames)


def alone(model: torch.nn.Module, prefix: list[int], response: list[int]) -> float:
    """The expected value: the document alone in its row, its response tokens' log-probabilities
    summed by hand."""
    ids = prefix + response
    with torch.no_grad():
        logp = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0].double().log_softmax(-1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(len(prefix), len(ids)))


@pytest.fixture(scope="module")
def pairs() -> pl.DataFrame:
    return tokenized_pairs()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The reference model exported as training exports it."""
    _, model = policy_and_reference()
    folder = tmp_path_factory.mktemp("reference-model")
    save_exported(model.state_dict(), CONFIG, folder, {})
    return folder


def _environment() -> dict[str, str]:
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MLFLOW_TRACKING_URI", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    return {**environment, **torchrun_env(1)}


def test_packed_rows_give_each_document_its_log_probability_alone(pairs, exported):
    rows = packed_rows(pairs)
    model, _ = load_exported(exported)
    by_id = {pair["pair_id"]: pair for pair in pairs.iter_rows(named=True)}

    scored = reference_logps(model, rows, batch_size=3)  # batches that end mid-shard

    assert scored.columns == ["batch_id", "split", "sequence_index", "reference_logps"]
    assert scored.schema["reference_logps"] == pl.List(pl.Float64)
    assert scored.drop("reference_logps").equals(rows.select("batch_id", "split", "sequence_index"))
    expected = [
        [
            alone(model, by_id[pair_id]["prefix_ids"], by_id[pair_id][response])
            for pair_id in pair_ids
            for response in ("chosen_ids", "rejected_ids")
        ]
        for pair_ids in rows["pair_ids"].to_list()
    ]
    assert scored["reference_logps"].list.len().to_list() == [
        2 * len(ids) for ids in rows["pair_ids"].to_list()
    ]
    assert scored["reference_logps"].explode().to_list() == pytest.approx(
        sum(expected, []), rel=1e-5, abs=1e-5
    )


def test_two_torchrun_ranks_give_the_values_of_one_every_row_once(
    pairs, exported, tmp_path, monkeypatch, capsys
):
    rows = packed_rows(pairs).reverse()  # not in key order: the reader sorts
    rows.write_parquet(tmp_path / "rows.parquet")
    # a row a batch and one thread, as each torchrun rank has: the same arithmetic
    # whatever the split
    arguments = [
        "--rows",
        str(tmp_path / "rows.parquet"),
        "--model",
        str(exported),
        "--batch-size",
        "1",
    ]
    command = torchrun_command(
        2, [*arguments, "--out", str(tmp_path / "two"), "--log-every", "2"], module=MODULE
    )
    finished = subprocess.run(
        command, env=_environment(), capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference.main([*arguments, "--out", str(tmp_path / "one"), "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)

    assert sorted(path.name for path in (tmp_path / "two").iterdir()) == [
        "reference-rank0.parquet",
        "reference-rank1.parquet",
    ]
    two_ranks = read_reference_logps(tmp_path / "two", rows.height)
    one_rank = read_reference_logps(tmp_path / "one", rows.height)
    assert two_ranks.equals(one_rank)
    assert two_ranks.select("batch_id", "split", "sequence_index").equals(
        rows.select("batch_id", "split", "sequence_index").sort(
            "batch_id", "split", "sequence_index"
        )
    )
    documents = int(rows["pair_ids"].list.len().sum()) * 2
    assert (
        f"rank 0/1: reference log-probabilities of {rows.height} rows, {documents} documents on cpu"
        in capsys.readouterr().out
    )
    assert (
        f"rank 1/2: 2/{rows.height // 2} rows scored" in finished.stdout
    )  # a progress line every two batches


def test_a_row_whose_documents_do_not_match_its_pairs_fails_the_run(pairs, exported, tmp_path):
    rows = packed_rows(pairs)
    bad = pl.int_range(pl.len()) == 3
    rows = rows.with_columns(
        pair_ids=pl.when(bad)
        .then(pl.col("pair_ids").list.concat(pl.lit(["stray"])))
        .otherwise(pl.col("pair_ids"))
    )
    rows.write_parquet(tmp_path / "rows.parquet")
    key = rows.row(3, named=True)
    command = [
        sys.executable,
        "-m",
        MODULE,
        "--rows",
        str(tmp_path / "rows.parquet"),
        "--model",
        str(exported),
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
    ]

    finished = subprocess.run(
        command, env=_environment(), capture_output=True, text=True, timeout=60
    )

    assert finished.returncode != 0
    pairs_listed = len(key["pair_ids"])
    assert (
        f"rank 0/1: row {{'batch_id': '{key['batch_id']}', "
        f"'split': '{key['split']}', 'sequence_index': "
        f"{key['sequence_index']}}} holds {2 * (pairs_listed - 1)} documents "
        f"but pair_ids lists {pairs_listed} "
        "pairs"
    ) in finished.stderr
    assert not (tmp_path / "out" / "reference-rank0.parquet").exists()


def test_the_reader_finds_a_missing_or_doubled_row(tmp_path):
    def rank_file(rank: int, indexes: list[int]) -> None:
        pl.DataFrame(
            {
                "split": ["train"] * len(indexes),
                "sequence_index": indexes,
                "reference_logps": [[-1.0, -2.0]] * len(indexes),
            },
            schema_overrides={"reference_logps": pl.List(pl.Float64)},
        ).write_parquet(tmp_path / f"reference-rank{rank}.parquet")

    rank_file(0, [2, 0])
    rank_file(1, [1])
    assert read_reference_logps(tmp_path, 3)["sequence_index"].to_list() == [0, 1, 2]
    with pytest.raises(ValueError, match="3 rows scored in 2 rank file.s., expected 4"):
        read_reference_logps(tmp_path, 4)
    rank_file(1, [0, 1])
    with pytest.raises(
        ValueError, match=r"1 row\(s\) scored twice, e.g. \{'split': 'train', 'sequence_index': 0\}"
    ):
        read_reference_logps(tmp_path, 4)
    with pytest.raises(ValueError, match="no reference-rank"):
        read_reference_logps(tmp_path / "empty", 1)
