"""Silver: MinHash signatures beside datasketch, near-dedup, decontamination and quality-gate
throughput, and peak memory of a batch's lookup against a 1,000,000-record MinHash index.

Signatures are compared with datasketch's normal use (a ``MinHash(num_perm=128, seed=1)`` per
document, its shingles through ``update_batch``) and with ``MinHash.bulk``, both sides on one
thread in a helper process started with POLARS_MAX_THREADS=1 (bench/silver_signatures.py), timed
in CPU seconds (``ratio_wall_clock``: the same in wall-clock seconds), on two sets of documents:
long ones, LONG_DOC_BYTES log-uniform, cut from the sample corpus's responses joined end to end in
a seeded shuffle (each response in at most one document, so no two documents share text the
corpus does not), and the corpus's own records (prompt + response, a few hundred bytes each).
``ratio`` is the long documents' (target: SIGNATURE_TARGET). Signatures on the records and
near-dedup are also measured here, on all of polars' threads.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl

from bench.sample import sample_records
from bench.timing import best_seconds
from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.silver.decontam import EvalNgramIndex, find_contamination, read_eval_sets
from pipeline_assets.lib.silver.dedup import exact_hashes, joined_text, near_dedup
from pipeline_assets.lib.silver.minhash import signatures
from pipeline_assets.lib.silver.quality import quality_gate

LONG_DOC_BYTES = (2_000, 20_000)
LONG_DOC_SEED = 15
SHORT_LOOP_SAMPLE = 5_000  # datasketch's side on the short records is timed on a slice and scaled
INDEX_RECORDS = 1_000_000
LOOKUP_BATCH = 10_000
SIGNATURE_TARGET = 5.0
MEMORY_TARGET_GB = 2.0


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        records = sample_records(Path(tmp))
        eval_items = read_eval_sets(Path(tmp) / "eval")
        texts = joined_text(records, SFT.dedup)
        documents = long_documents(records["response"].to_list())
        long = _one_thread_signatures(documents, Path(tmp) / "long.parquet", len(documents))
        short = _one_thread_signatures(texts, Path(tmp) / "short.parquet", SHORT_LOOP_SAMPLE)
        all_threads = best_seconds(lambda: signatures(texts))
        batch = records.with_columns(exact_hashes(records))
        near = best_seconds(lambda: near_dedup(batch, None))
        index = EvalNgramIndex.build(eval_items)
        decontam = best_seconds(lambda: find_contamination(records, index))
        quality = best_seconds(lambda: quality_gate(records))
        peak_gb = _lookup_peak_memory_gb(Path(tmp))
    n, m = len(texts), len(documents)
    megabytes = sum(len(d.encode()) for d in documents) / 1e6
    ratio = long["loop_seconds"] / long["signatures_seconds"]
    return {
        "documents": n,
        "long_documents": m,
        "long_document_mean_kb": round(megabytes * 1e3 / m, 1),
        "measured": (
            f"one thread: signatures {m / long['signatures_seconds']:,.0f} long docs/s "
            f"({megabytes / long['signatures_seconds']:.1f} MB/s), "
            f"{n / short['signatures_seconds']:,.0f} short docs/s; "
            f"all threads: signatures {n / all_threads:,.0f} short docs/s, "
            f"near-dedup (signatures+LSH+clusters) {n / near:,.0f} short docs/s"
        ),
        "baseline": (
            "one thread: datasketch update_batch loop "
            f"{m / long['loop_seconds']:,.0f} long docs/s, "
            f"{n / short['loop_seconds']:,.0f} short docs/s; MinHash.bulk "
            f"{m / long['bulk_seconds']:,.0f} long docs/s, "
            f"{n / short['bulk_seconds']:,.0f} short docs/s"
        ),
        "ratio": ratio,
        "ratio_wall_clock": long["loop_wall_seconds"] / long["signatures_wall_seconds"],
        "ratio_vs_bulk": long["bulk_seconds"] / long["signatures_seconds"],
        "ratio_short_docs": short["loop_seconds"] / short["signatures_seconds"],
        "ratio_short_docs_vs_bulk": short["bulk_seconds"] / short["signatures_seconds"],
        "decontamination_rows_per_second": round(n / decontam),
        "quality_gate_rows_per_second": round(n / quality),
        "lookup_peak_memory_gb_at_1m_index": round(peak_gb, 3),
        "target": (
            f"signatures >= {SIGNATURE_TARGET}x the update_batch loop "
            "on 2-20 KB documents, one thread each; "
            f"peak < {MEMORY_TARGET_GB} GB at 1M indexed records"
        ),
        "target_met": ratio >= SIGNATURE_TARGET and peak_gb < MEMORY_TARGET_GB,
    }


def long_documents(responses: list[str], seed: int = LONG_DOC_SEED) -> list[str]:
    """Documents of LONG_DOC_BYTES (UTF-8, log-uniform), cut at whitespace from the responses joined
    by blank lines in a seeded shuffle, until the text runs out."""
    rng = random.Random(seed)
    stream = "\n\n".join(rng.sample(responses, len(responses))).encode()
    breaks = [match.start() for match in re.finditer(rb"\s", stream)]  # never inside a character
    low, high = LONG_DOC_BYTES
    documents, start = [], 0
    while start + high <= len(stream):
        size = math.exp(rng.uniform(math.log(low), math.log(high)))
        end = breaks[bisect.bisect_right(breaks, start + size) - 1]
        if end - start >= low:
            documents.append(stream[start:end].decode())
        start = end + 1
    assert len(set(documents)) == len(documents)
    return documents


def _one_thread_signatures(texts: list[str], path: Path, loop_sample: int) -> dict:
    pl.DataFrame({"text": texts}).write_parquet(path)
    done = subprocess.run(
        [sys.executable, "-m", "bench.silver_signatures", str(path), str(loop_sample)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "POLARS_MAX_THREADS": "1"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _lookup_peak_memory_gb(root: Path) -> float:
    """Build a 1M-entry index in one process, look a batch up against it in a fresh one."""
    table = root / "minhash_index"
    subprocess.run(
        [sys.executable, "-m", "bench.silver_index", "build", str(table), str(INDEX_RECORDS)],
        check=True,
    )
    done = subprocess.run(
        [sys.executable, "-m", "bench.silver_index", "lookup", str(table), str(LOOKUP_BATCH)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_gb"]
