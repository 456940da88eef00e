"""The DPO reference pass under torchrun: the reference model's log-probabilities of every packed
preference row.

    torchrun --standalone --nproc-per-node=N -m pipeline_assets.trainer.reference \
        --rows ROWS.parquet --model DIR --out DIR [--device auto] [--batch-size 16] [--log-every 50]

``ROWS.parquet`` holds packed preference rows as gold packs them (``lib.gold.preference_packing``):
at least split, sequence_index, input_ids, loss_mask, position_ids and pair_ids (batch_id too when
the rows come from several gold shards: it is then part of each row's key). Rank r of N scores rows
r, r+N, ... with the exported model in ``DIR``, without gradients, on its GPU when there is one, and
writes ``<out>/reference-rank<r>.parquet``: one row per input row, its key (batch_id when given,
split, sequence_index) and ``reference_logps``, per document of the row in row order (chosen,
rejected, chosen, ...), the summed log-probability of its response tokens
(``trainer.dpo.document_logps``, the log-softmax in at least fp32). A row whose documents are not
two per pair of ``pair_ids`` fails the run. ``read_reference_logps`` gathers the ranks' files. No
process group: the ranks share nothing but the input file. Run by hand with the same arguments to
debug a reference pass.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import polars as pl
import torch

from pipeline_assets.trainer.data import COLUMNS, LOGPS_COLUMN, PackedSequences
from pipeline_assets.trainer.dpo import summed_document_logps
from pipeline_assets.trainer.export import load_exported
from pipeline_assets.trainer.hf_model import HuggingFaceLM
from pipeline_assets.trainer.model import Transformer
from pipeline_assets.trainer.score import scoring_device

KEY_COLUMNS = ("split", "sequence_index")
SHARD_COLUMN = (
    "batch_id"  # part of the key when present: sequence_index restarts in every gold shard
)
LOGPS_TYPE = pl.List(pl.Float64)
RANK_FILE = "reference-rank{rank}.parquet"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m pipeline_assets.trainer.reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=Path, required=True, help="packed preference rows to score (Parquet)"
    )
    parser.add_argument(
        "--model", type=Path, required=True, help="the exported reference model's folder"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for each rank's reference log-probabilities"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--log-every", type=int, default=50, help="a progress line every this many batches"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = scoring_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    rows = read_rank_rows(args.rows, rank, world_size)
    model, _ = load_exported(args.model, device=str(device))
    where = f"rank {rank}/{world_size}"
    try:
        logps = reference_logps(
            model,
            rows,
            args.batch_size,
            lambda done: _progress(where, done, rows.height),
            args.log_every,
        )
    except ValueError as error:
        raise SystemExit(f"{where}: {error}") from error
    args.out.mkdir(parents=True, exist_ok=True)
    logps.write_parquet(args.out / RANK_FILE.format(rank=rank))
    documents = int(logps[LOGPS_COLUMN].list.len().sum()) if logps.height else 0
    print(
        f"{where}: reference log-probabilities of {logps.height} rows, {documents:,} documents on "
        f"{device}",
        flush=True,
    )


def read_rank_rows(path: Path, rank: int, world_size: int) -> pl.DataFrame:
    """Rows rank, rank + world_size, ... of the file: the key columns and what scoring reads."""
    available = pl.read_parquet_schema(path)
    missing = [name for name in (*KEY_COLUMNS, *COLUMNS, "pair_ids") if name not in available]
    if missing:
        raise SystemExit(f"{path} lacks column(s) {', '.join(missing)}")
    columns = [*key_columns(available), *COLUMNS, "pair_ids"]
    return pl.read_parquet(path, columns=columns).gather_every(world_size, offset=rank)


def key_columns(columns) -> list[str]:
    """What names a row: (batch_id,) split, sequence_index."""
    return [SHARD_COLUMN, *KEY_COLUMNS] if SHARD_COLUMN in columns else list(KEY_COLUMNS)


@torch.no_grad()
def reference_logps(
    model: Transformer | HuggingFaceLM,
    rows: pl.DataFrame,
    batch_size: int = 16,
    progress=None,
    log_every: int = 50,
) -> pl.DataFrame:
    """rows: the key columns, input_ids, loss_mask, position_ids, pair_ids -> the key columns and
    ``reference_logps`` (one value per document, in row order), row for row. ``progress(rows_done)``
    is called every ``log_every`` batches. A ValueError names the first row whose documents are not
    two per pair."""
    model.eval()
    device = next(model.parameters()).device
    per_row: list[list[float]] = []
    for number, start in enumerate(range(0, rows.height, batch_size), start=1):
        chunk = rows.slice(start, batch_size)
        per_row.extend(_batch_logps(model, chunk, device))
        _check_documents(chunk, per_row[start:])
        if progress is not None and number % log_every == 0:
            progress(start + chunk.height)
    return rows.select(key_columns(rows.columns)).with_columns(
        pl.Series(LOGPS_COLUMN, per_row, dtype=LOGPS_TYPE)
    )


def read_reference_logps(out_dir: Path, expected_rows: int) -> pl.DataFrame:
    """Every rank's file in ``out_dir``, as one frame sorted by key; a ValueError unless it holds
    ``expected_rows`` rows, each once."""
    parts = sorted(Path(out_dir).glob(RANK_FILE.format(rank="*")))
    if not parts:
        raise ValueError(f"no {RANK_FILE.format(rank='*')} in {out_dir}")
    logps = pl.concat([pl.read_parquet(part) for part in parts])
    key = key_columns(logps.columns)
    doubled = logps.filter(pl.struct(key).is_duplicated())
    if doubled.height:
        raise ValueError(
            f"{doubled.n_unique(key)} row(s) scored twice, e.g. "
            f"{doubled.select(key).row(0, named=True)}"
        )
    if logps.height != expected_rows:
        raise ValueError(
            f"{logps.height} rows scored in {len(parts)} rank file(s), expected {expected_rows}"
        )
    return logps.sort(key)


def _batch_logps(
    model: Transformer | HuggingFaceLM, chunk: pl.DataFrame, device: torch.device
) -> list[list[float]]:
    """Per row of the chunk, its documents' summed response log-probabilities."""
    width = int(chunk["input_ids"].list.len().max())
    sequences = PackedSequences(
        **{name: chunk[name].list.to_array(width).to_numpy() for name in COLUMNS}
    )
    batch = sequences.batch(np.arange(chunk.height), device)
    target_logps = -model(batch["input_ids"], batch["position_ids"], next_token_losses=True)
    # row by row, so each row's documents are counted by the same rule that scores them
    return [
        summed_document_logps(
            target_logps[i : i + 1], batch["loss_mask"][i : i + 1], batch["position_ids"][i : i + 1]
        )
        .double()
        .tolist()
        for i in range(chunk.height)
    ]


def _check_documents(chunk: pl.DataFrame, logps: list[list[float]]) -> None:
    for index, (pairs, documents) in enumerate(
        zip(chunk["pair_ids"].list.len().fill_null(0), logps)
    ):
        if len(documents) != 2 * pairs:
            key = chunk.select(key_columns(chunk.columns)).row(index, named=True)
            raise ValueError(
                f"row {key} holds {len(documents)} documents but pair_ids lists {pairs} pairs: "
                f"a packed row holds a chosen and a rejected document per pair"
            )


def _progress(where: str, done: int, total: int) -> None:
    print(f"{where}: {done:,}/{total:,} rows scored", flush=True)


if __name__ == "__main__":
    main()
