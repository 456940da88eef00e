"""A small, learnable preference snapshot dpo-v<N> for trainer tests, written with deltalake as gold
and the reference pass would write it: shards of gold/preference_sequences packed by ``pack_pairs``,
the manifest row as version N of gold/preference_snapshots, gold/reference_logps scored by the init
model (an exported tiny model, the stand-in for the SFT champion).

In every pair the chosen response counts upwards from the prompt's last token and the rejected one
counts downwards: a tiny model learns to prefer the first in a few dozen steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import polars as pl
import torch
from deltalake import DeltaTable

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.manifest import PREFERENCE_SNAPSHOTS, Manifest, shard_counts
from pipeline_assets.lib.gold.preference_packing import pack_pairs
from pipeline_assets.trainer.config import PRESETS
from pipeline_assets.trainer.data import LOGPS_COLUMN, REFERENCE_TABLE
from pipeline_assets.trainer.export import load_exported, save_exported
from pipeline_assets.trainer.model import Transformer
from pipeline_assets.trainer.reference import reference_logps

VOCAB, PAD_ID, SEQ_LEN = 64, 0, 64  # the SFT tests' vocabulary (synthetic.VOCAB)
REFERENCE_MODEL = "sft-model/1"
INIT_SEED = 7


@dataclass(frozen=True)
class PreferenceLake:
    lake_uri: str
    snapshot: int  # N of dpo-v<N>
    reference_version: (
        int  # the gold/reference_logps version holding its reference log-probabilities
    )
    init_model: Path  # the exported model the policy starts from and the reference pass scored with
    manifest: Manifest


def counting_pairs(n_pairs: int, seed: int = 0) -> pl.DataFrame:
    """pair_id, split (every fifth pair held out), prefix_ids, chosen_ids (counting up from the
    prompt's last token), rejected_ids (counting down)."""
    rng = np.random.default_rng(seed)
    rows = []
    for number in range(n_pairs):
        prefix = rng.integers(1, VOCAB, int(rng.integers(2, 6))).tolist()
        steps = range(1, int(rng.integers(3, 8)))
        rows.append(
            {
                "pair_id": f"p{number:05d}",
                "split": "validation" if number % 5 == 0 else "train",
                "prefix_ids": prefix,
                "chosen_ids": [(prefix[-1] - 1 + k) % (VOCAB - 1) + 1 for k in steps],
                "rejected_ids": [(prefix[-1] - 1 - k) % (VOCAB - 1) + 1 for k in steps],
            }
        )
    return pl.DataFrame(
        rows,
        schema_overrides={
            name: pl.List(pl.Int64) for name in ("prefix_ids", "chosen_ids", "rejected_ids")
        },
    )


def export_init_model(folder: Path, seed: int = INIT_SEED) -> Path:
    """A seeded tiny model, exported as training exports one."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_exported(Transformer(config).state_dict(), config, folder, {"partition": "gold-v0"})
    return folder


def write_preference_lake(
    lake_uri: str, init_model: Path, n_pairs: int = 400, shards: int = 2, seed: int = 0
) -> PreferenceLake:
    """Shards b0, b1, ... of counting pairs (dealt round-robin), snapshot dpo-v<N> of them and their
    reference log-probabilities by ``init_model``."""
    pairs = counting_pairs(n_pairs, seed).with_row_index("row")
    batches = [f"b{k}" for k in range(shards)]
    for k, batch in enumerate(batches):
        write_shard(lake_uri, batch, pairs.filter(pl.col("row") % shards == k).drop("row"))
    manifest = cut_preference_snapshot(lake_uri, batches)
    version = write_reference_logps(lake_uri, manifest, score_rows(lake_uri, manifest, init_model))
    return PreferenceLake(lake_uri, manifest.number, version, init_model, manifest)


def write_shard(lake_uri: str, batch: str, pairs: pl.DataFrame) -> None:
    """One ingest batch's shard of gold/preference_sequences, each split packed on its own."""
    frames = []
    for split in ("train", "validation"):
        rows = pack_pairs(pairs.filter(pl.col("split") == split), SEQ_LEN, PAD_ID).rows
        frames.append(
            rows.with_columns(
                batch_id=pl.lit(batch),
                tokenizer_version=pl.lit(0, pl.Int64),
                split=pl.lit(split),
                sequence_index=pl.int_range(pl.len(), dtype=pl.Int64),
                real_tokens=pl.col("document_lengths").list.sum().cast(pl.Int32),
            )
        )
    pl.concat(frames).write_delta(
        _table(lake_uri, PREFERENCE_SNAPSHOTS.sequences_table),
        mode="append",
        delta_write_options={"partition_by": ["batch_id"]},
    )


def cut_preference_snapshot(lake_uri: str, batches: list[str]) -> Manifest:
    """The next manifest row of gold/preference_snapshots (row N is version N), at the shards'
    current version."""
    shards_uri = _table(lake_uri, PREFERENCE_SNAPSHOTS.sequences_table)
    version = DeltaTable(shards_uri).version()
    counts = shard_counts(pl.scan_delta(shards_uri, version=version), batches)
    number = _next_version(_table(lake_uri, PREFERENCE_SNAPSHOTS.manifest_table))
    manifest = Manifest.from_counts(
        number, version, 0, SEQ_LEN, batches, counts, PREFERENCE_SNAPSHOTS
    )
    manifest.frame("synthetic", datetime.now(timezone.utc)).write_delta(
        _table(lake_uri, PREFERENCE_SNAPSHOTS.manifest_table), mode="append"
    )
    return manifest


def score_rows(lake_uri: str, manifest: Manifest, model_folder: Path) -> pl.DataFrame:
    """The snapshot's rows scored by the model: batch_id, split, sequence_index (local),
    reference_logps."""
    rows = pl.read_delta(
        _table(lake_uri, PREFERENCE_SNAPSHOTS.sequences_table), version=manifest.sequences_version
    )
    rows = rows.filter(pl.col("batch_id").is_in(list(manifest.batches)))
    model, _ = load_exported(model_folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as a torchrun rank computes: the policy's first forward gives the same values
    try:
        return reference_logps(model, rows, batch_size=8)
    finally:
        torch.set_num_threads(threads)


def write_reference_logps(
    lake_uri: str,
    manifest: Manifest,
    scored: pl.DataFrame,
    reference_model: str = REFERENCE_MODEL,
    mode: str = "append",
) -> int:
    """Append the snapshot's rows to gold/reference_logps (or replace what it holds: ``mode``
    overwrite); returns the version that holds them."""
    uri = _table(lake_uri, REFERENCE_TABLE)
    frame = scored.select(
        snapshot=pl.lit(manifest.key),
        reference_model=pl.lit(reference_model),
        batch_id="batch_id",
        split="split",
        sequence_index="sequence_index",
        reference_logps=LOGPS_COLUMN,
    )
    frame.write_delta(uri, mode=mode)
    return DeltaTable(uri).version()


def _next_version(uri: str) -> int:
    try:
        return DeltaTable(uri).version() + 1
    except Exception:  # no table yet: deltalake raises its own TableNotFoundError
        return 0


def _table(lake_uri: str, table: tuple[str, str]) -> str:
    return uris.join(lake_uri, *table)
