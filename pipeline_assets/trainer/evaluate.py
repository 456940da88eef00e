"""Held-out loss per document, so that any slice (a source, an eval set) can be summed from it.

Packed rows are evaluated as they were trained: attention stays within each document, so a
document's loss does not depend on what it was packed with. Pure torch and polars: the scoring
program (``trainer/score.py``, under torchrun) calls it for the candidate and the champion on
exactly the same rows.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from pipeline_assets.lib.gold.sequences import pack_documents
from pipeline_assets.trainer.hf_model import HuggingFaceLM
from pipeline_assets.trainer.model import Transformer, counted_targets

DOCUMENT_LOSSES_SCHEMA = {"record_id": pl.String, "loss_sum": pl.Float64, "tokens": pl.Int64}


@torch.no_grad()
def packed_document_losses(
    model: Transformer | HuggingFaceLM, rows: pl.DataFrame, batch_size: int = 16
) -> pl.DataFrame:
    """rows: input_ids, loss_mask, position_ids, record_ids (gold sequences) -> per record: summed
    loss over its counted targets and how many there are. A record split over several rows is
    summed."""
    model.eval()
    device = next(model.parameters()).device
    parts = []
    for start in range(0, rows.height, batch_size):
        chunk = rows.slice(start, batch_size)
        input_ids, loss_mask, position_ids = (
            _matrix(chunk[name]) for name in ("input_ids", "loss_mask", "position_ids")
        )
        token_losses, counted = _token_losses(
            model, input_ids.to(device), loss_mask.to(device), position_ids.to(device)
        )
        piece = (
            np.cumsum(position_ids.numpy() == 0, axis=1)[:, 1:] - 1
        )  # the piece each target belongs to
        parts.append(_per_piece(token_losses, counted, piece, chunk["record_ids"]))
    if not parts:
        return pl.DataFrame(schema=DOCUMENT_LOSSES_SCHEMA)
    return (
        pl.concat(parts)
        .group_by("record_id")
        .agg(pl.sum("loss_sum"), pl.sum("tokens"))
        .sort("record_id")
    )


def sequence_losses(
    model: Transformer | HuggingFaceLM,
    encoded: pl.DataFrame,
    max_len: int,
    pad_id: int,
    batch_size: int = 16,
) -> pl.DataFrame:
    """encoded: record_id, input_ids, loss_mask (one document a row, e.g. eval-set items) -> the
    same per-record sums, each document cut to ``max_len`` tokens and packed
    (``lib.gold.sequences.pack_documents``)."""
    return packed_document_losses(model, pack_documents(encoded, max_len, pad_id), batch_size)


def slice_losses(document_losses: pl.DataFrame, slices: pl.DataFrame) -> pl.DataFrame:
    """Token-weighted mean loss and perplexity per slice. ``slices``: record_id, slice (a record may
    be in several slices; "overall" is whatever the caller puts there)."""
    return (
        document_losses.join(slices, on="record_id", how="inner")
        .group_by("slice")
        .agg(pl.sum("loss_sum"), pl.sum("tokens"), documents=pl.len())
        .with_columns(loss=pl.col("loss_sum") / pl.col("tokens"))
        .with_columns(perplexity=pl.col("loss").exp())
        .select("slice", "loss", "perplexity", "tokens", "documents")
        .sort("slice")
    )


def _matrix(column: pl.Series) -> torch.Tensor:
    values = column.list.to_array(int(column.list.len().max())).to_numpy()
    return torch.from_numpy(values.astype(np.int64) if values.dtype != bool else values)


def _token_losses(model, input_ids, loss_mask, position_ids) -> tuple[np.ndarray, np.ndarray]:
    """Per target token (B, T-1): its loss, and whether it counts (the trainer's rule)."""
    losses = model(input_ids, position_ids, next_token_losses=True)
    return losses.cpu().numpy(), counted_targets(loss_mask, position_ids).cpu().numpy()


def _per_piece(
    token_losses: np.ndarray, counted: np.ndarray, piece: np.ndarray, record_ids: pl.Series
) -> pl.DataFrame:
    """Sum the counted targets' losses per (row, piece), then name each piece by its record."""
    rows, columns = np.nonzero(counted)
    lengths = record_ids.list.len().to_numpy().astype(np.int64)
    first_piece = np.concatenate(
        [[0], np.cumsum(lengths)[:-1]]
    )  # of each row, in the flattened pieces
    flat = first_piece[rows] + piece[rows, columns]
    loss_sum = np.bincount(
        flat, weights=token_losses[rows, columns].astype(np.float64), minlength=int(lengths.sum())
    )
    tokens = np.bincount(flat, minlength=int(lengths.sum()))
    frame = pl.DataFrame(
        {"record_id": record_ids.explode(), "loss_sum": loss_sum, "tokens": tokens.astype(np.int64)}
    )
    return (
        frame.filter(pl.col("tokens") > 0)
        .group_by("record_id")
        .agg(pl.sum("loss_sum"), pl.sum("tokens"))
    )
