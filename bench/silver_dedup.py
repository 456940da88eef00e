"""Silver: MinHash signatures beside datasketch (per-document loop and MinHash.bulk), near-dedup,
decontamination and quality-gate throughput, and peak memory of a batch's lookup against a
1,000,000-record MinHash index.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from datasketch import MinHash

from bench.sample import sample_records
from bench.timing import best_seconds
from pipeline_assets.lib.decontam import EvalNgramIndex, find_contamination, read_eval_sets
from pipeline_assets.lib.dedup import DEDUP_TEXT, exact_hashes, near_dedup
from pipeline_assets.lib.minhash import shingles, signatures
from pipeline_assets.lib.quality import quality_gate

LOOP_SAMPLE = 5_000  # datasketch's loop is timed on a slice and scaled
INDEX_RECORDS = 1_000_000
LOOKUP_BATCH = 10_000
SIGNATURE_TARGET = 5.0
MEMORY_TARGET_GB = 2.0


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        records = sample_records(Path(tmp))
        eval_items = read_eval_sets(Path(tmp) / "eval")
        texts = records.select(DEDUP_TEXT).to_series().to_list()
        ours = best_seconds(lambda: signatures(texts))
        loop = best_seconds(lambda: _datasketch_loop(texts[:LOOP_SAMPLE])) * len(texts) / LOOP_SAMPLE
        bulk = best_seconds(lambda: MinHash.bulk([list(shingles(t)) for t in texts[:LOOP_SAMPLE]], num_perm=128, seed=1)) * len(texts) / LOOP_SAMPLE
        batch = records.with_columns(exact_hashes(records))
        near = best_seconds(lambda: near_dedup(batch, None))
        index = EvalNgramIndex.build(eval_items)
        decontam = best_seconds(lambda: find_contamination(records, index))
        quality = best_seconds(lambda: quality_gate(records))
        peak_gb = _lookup_peak_memory_gb(Path(tmp))
    n = len(texts)
    ratio = loop / ours
    return {
        "documents": n,
        "measured": f"signatures {n / ours:,.0f} docs/s; near-dedup (signatures+LSH+clusters) {n / near:,.0f} docs/s",
        "baseline": f"datasketch update_batch loop {n / loop:,.0f} docs/s; MinHash.bulk {n / bulk:,.0f} docs/s",
        "ratio": ratio,
        "ratio_vs_bulk": bulk / ours,
        "decontamination_rows_per_second": round(n / decontam),
        "quality_gate_rows_per_second": round(n / quality),
        "lookup_peak_memory_gb_at_1m_index": round(peak_gb, 3),
        "target": f"signatures >= {SIGNATURE_TARGET}x the loop; peak < {MEMORY_TARGET_GB} GB at 1M indexed records",
        "target_met": ratio >= SIGNATURE_TARGET and peak_gb < MEMORY_TARGET_GB,
    }


def _datasketch_loop(texts: list[str]) -> None:
    for text in texts:
        minhash = MinHash(num_perm=128, seed=1)
        minhash.update_batch(list(shingles(text)))


def _lookup_peak_memory_gb(root: Path) -> float:
    """Build a 1M-entry index in one process, look a batch up against it in a fresh one."""
    table = root / "minhash_index"
    subprocess.run([sys.executable, "-m", "bench.silver_index", "build", str(table), str(INDEX_RECORDS)], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "bench.silver_index", "lookup", str(table), str(LOOKUP_BATCH)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_gb"]
