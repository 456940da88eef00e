"""What evaluation runs under torchrun: per-document held-out losses of exported models on the same
rows.

    torchrun --standalone --nproc-per-node=N -m pipeline_assets.trainer.score \
        --rows ROWS.parquet --model candidate=DIR [--model champion=DIR] --out DIR [--device auto]

``ROWS.parquet`` holds packed sequences (input_ids, loss_mask, position_ids, record_ids), as gold
packs them. Rank r of N scores rows r, r+N, ... with each model in turn, on its GPU when there is
one, and writes ``<out>/<model>-rank<r>.parquet`` (record_id, loss_sum, tokens); a document split
over rows of two ranks is summed by the reader. No process group: the ranks share nothing but the
input file. Run by hand with the same arguments to debug an evaluation.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import polars as pl
import torch

from pipeline_assets.lib.gold.sequences import SCORED_COLUMNS
from pipeline_assets.trainer.evaluate import packed_document_losses
from pipeline_assets.trainer.export import load_exported


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m pipeline_assets.trainer.score",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=Path, required=True, help="packed sequences to score (Parquet)"
    )
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="an exported model folder, named; repeat for each model",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for each model's and rank's losses"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--batch-size", type=int, default=16)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = scoring_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    rows = pl.read_parquet(args.rows, columns=list(SCORED_COLUMNS)).gather_every(
        world_size, offset=rank
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for named in args.model:
        name, _, folder = named.partition("=")
        if not name or not folder:
            raise SystemExit(f"--model takes NAME=DIR, got {named!r}")
        model, _ = load_exported(Path(folder), device=str(device))
        losses = packed_document_losses(model, rows, args.batch_size)
        losses.write_parquet(
            args.out / f"{name}-rank{rank}.parquet"
        )  # the name evaluation's asset reads
        print(
            f"rank {rank}/{world_size}: {name} scored {rows.height} sequences, "
            f"{int(losses['tokens'].sum()):,} tokens on {device}",
            flush=True,
        )


def scoring_device(choice: str, local_rank: int) -> torch.device:
    """The GPU of this rank when asked for (or auto and one is there), else the CPU: every scoring
    program's rule."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


if __name__ == "__main__":
    main()
