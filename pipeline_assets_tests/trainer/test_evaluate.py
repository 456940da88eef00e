"""Held-out loss per document: packed rows score each document as if it were alone."""

from __future__ import annotations

import math
import os
import subprocess

import polars as pl
import pytest
import torch

from pipeline_assets.lib.gold.sequences import SCORED_COLUMNS
from pipeline_assets.lib.training.torchrun import SCORER_MODULE, torchrun_command, torchrun_env
from pipeline_assets.trainer.config import ModelConfig
from pipeline_assets.trainer.evaluate import packed_document_losses, sequence_losses, slice_losses
from pipeline_assets.trainer.export import save_exported
from pipeline_assets.trainer.model import Transformer

CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=32)
SEQ_LEN, PAD = 24, 0


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).eval()


def documents() -> dict[str, tuple[list[int], list[bool]]]:
    """record -> (ids, loss mask): a prompt part (not counted) then a response part (counted)."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, prompt, response in (("a", 3, 4), ("b", 5, 6), ("c", 2, 9), ("d", 4, 3)):
        ids = torch.randint(
            1, CONFIG.vocab_size, (prompt + response,), generator=generator
        ).tolist()
        out[name] = (ids, [False] * prompt + [True] * response)
    return out


def packed_rows(docs) -> pl.DataFrame:
    """Two packed rows: a+b, then c+d, padded to SEQ_LEN (padding is a piece with no
    counted target)."""
    rows = []
    for names in (("a", "b"), ("c", "d")):
        ids = [t for n in names for t in docs[n][0]]
        mask = [m for n in names for m in docs[n][1]]
        positions = [p for n in names for p in range(len(docs[n][0]))]
        padding = SEQ_LEN - len(ids)
        rows.append(
            {
                "input_ids": ids + [PAD] * padding,
                "loss_mask": mask + [False] * padding,
                "position_ids": positions + list(range(padding)),
                "record_ids": list(names),
            }
        )
    return pl.DataFrame(rows)


def alone(model: Transformer, ids: list[int], mask: list[bool]) -> tuple[float, int]:
    """The reference: the document alone in its row, summed in Python over its counted targets."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    losses = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    counted = [t for t in range(1, len(ids)) if mask[t]]
    return sum(float(losses[t - 1]) for t in counted), len(counted)


def test_packed_documents_score_as_if_each_were_alone(model):
    docs = documents()
    scored = packed_document_losses(model, packed_rows(docs), batch_size=1)
    assert scored["record_id"].to_list() == ["a", "b", "c", "d"]
    for row in scored.iter_rows(named=True):
        loss_sum, tokens = alone(model, *docs[row["record_id"]])
        assert row["tokens"] == tokens
        assert row["loss_sum"] == pytest.approx(loss_sum, rel=1e-5)


def test_a_record_split_over_two_rows_is_summed_and_batching_changes_nothing(model):
    docs = documents()
    rows = packed_rows(docs).with_columns(
        record_ids=pl.Series([["a", "b"], ["c", "a"]])
    )  # "d" is now a's second piece
    one_by_one = packed_document_losses(model, rows, batch_size=1)
    together = packed_document_losses(model, rows, batch_size=16)
    assert one_by_one.drop("loss_sum").equals(together.drop("loss_sum"))
    assert one_by_one["loss_sum"].to_list() == pytest.approx(
        together["loss_sum"].to_list(), rel=1e-5
    )
    a = one_by_one.filter(pl.col("record_id") == "a").row(0, named=True)
    expected = [alone(model, *docs[name]) for name in ("a", "d")]
    assert a["tokens"] == sum(tokens for _, tokens in expected)
    assert a["loss_sum"] == pytest.approx(sum(loss for loss, _ in expected), rel=1e-5)


def test_sequence_losses_and_slices(model):
    docs = documents()
    encoded = pl.DataFrame(
        {
            "record_id": list(docs),
            "input_ids": [d[0] for d in docs.values()],
            "loss_mask": [d[1] for d in docs.values()],
        }
    )
    scored = sequence_losses(model, encoded, max_len=SEQ_LEN, pad_id=PAD)
    for row in scored.iter_rows(named=True):
        assert row["loss_sum"] == pytest.approx(alone(model, *docs[row["record_id"]])[0], rel=1e-5)
    slices = slice_losses(
        scored,
        pl.DataFrame({"record_id": ["a", "b", "c", "d", "a"], "slice": ["x", "x", "y", "y", "y"]}),
    )
    y = slices.filter(pl.col("slice") == "y").row(0, named=True)
    parts = scored.filter(pl.col("record_id").is_in(["a", "c", "d"]))
    assert y["tokens"] == parts["tokens"].sum() and y["documents"] == 3
    assert y["loss"] == pytest.approx(parts["loss_sum"].sum() / parts["tokens"].sum())
    assert y["perplexity"] == pytest.approx(math.exp(y["loss"]))


def test_short_items_are_packed_and_a_long_one_is_cut(model):
    docs = documents()
    long_ids = torch.randint(
        1, CONFIG.vocab_size, (SEQ_LEN + 7,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    docs["long"] = (long_ids, [True] * len(long_ids))
    encoded = pl.DataFrame(
        {
            "record_id": list(docs),
            "input_ids": [d[0] for d in docs.values()],
            "loss_mask": [d[1] for d in docs.values()],
        }
    )
    positions = []
    hook = model.register_forward_hook(
        lambda module, inputs, output: positions.append(inputs[0].numel())
    )
    try:
        scored = sequence_losses(model, encoded, max_len=SEQ_LEN, pad_id=PAD)
    finally:
        hook.remove()
    # a..d hold 36 tokens: two rows of 24 between them, not a row each; the long item, cut to 24,
    # fills a third
    assert sum(positions) == 3 * SEQ_LEN
    cut = scored.filter(pl.col("record_id") == "long").row(0, named=True)
    loss_sum, tokens = alone(model, long_ids[:SEQ_LEN], [True] * SEQ_LEN)
    assert cut["tokens"] == tokens == SEQ_LEN - 1
    assert cut["loss_sum"] == pytest.approx(loss_sum, rel=1e-5)


def test_the_scoring_program_under_torchrun_gives_each_model_the_in_process_losses(model, tmp_path):
    """Two ranks split the rows; summed per record, each model's losses are those scored here."""
    torch.manual_seed(1)
    other = Transformer(CONFIG).eval()
    rows = pl.concat([packed_rows(documents())] * 3).select(
        SCORED_COLUMNS
    )  # 6 rows, a record in several
    rows.write_parquet(tmp_path / "rows.parquet")
    for name, net in (("candidate", model), ("champion", other)):
        (tmp_path / name).mkdir()
        save_exported(net.state_dict(), CONFIG, tmp_path / name, {})
    command = torchrun_command(
        2,
        [
            "--rows",
            str(tmp_path / "rows.parquet"),
            "--out",
            str(tmp_path / "scores"),
            "--model",
            f"candidate={tmp_path / 'candidate'}",
            "--model",
            f"champion={tmp_path / 'champion'}",
        ],
        module=SCORER_MODULE,
    )
    finished = subprocess.run(
        command, env={**os.environ, **torchrun_env(1)}, capture_output=True, text=True
    )
    assert finished.returncode == 0, finished.stderr[-2000:]

    for name, net in (("candidate", model), ("champion", other)):
        parts = sorted((tmp_path / "scores").glob(f"{name}-rank*.parquet"))
        assert [p.name for p in parts] == [f"{name}-rank0.parquet", f"{name}-rank1.parquet"]
        scored = (
            pl.concat([pl.read_parquet(p) for p in parts])
            .group_by("record_id")
            .agg(pl.sum("loss_sum"), pl.sum("tokens"))
        )
        expected = packed_document_losses(net, rows)
        got = scored.sort("record_id")
        assert got["record_id"].to_list() == expected["record_id"].to_list()
        assert got["tokens"].to_list() == expected["tokens"].to_list()
        assert got["loss_sum"].to_numpy() == pytest.approx(
            expected["loss_sum"].to_numpy(), rel=1e-5
        )
    candidate = pl.read_parquet(tmp_path / "scores" / "candidate-rank0.parquet")["loss_sum"].sum()
    assert candidate != pytest.approx(
        pl.read_parquet(tmp_path / "scores" / "champion-rank0.parquet")["loss_sum"].sum()
    )
