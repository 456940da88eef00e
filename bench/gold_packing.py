"""Gold: tokenize + pack tokens/s beside HF tokenizers' encode_batch alone on the same text, and
best-fit-decreasing packing efficiency beside greedy sequential packing on the same documents."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.sample import sample_records
from bench.timing import best_seconds
from pipeline_assets.lib.gold.chat_format import PAD, prefix_text, response_text
from pipeline_assets.lib.gold.packing import plan_best_fit_decreasing, plan_greedy_sequential
from pipeline_assets.lib.gold.sequences import build_sequences
from pipeline_assets.lib.gold.splits import assign_split
from pipeline_assets.lib.gold.tokenizer import encode_records, train_bpe

SEQ_LEN = 512
SPEED_TARGET = 0.7
EFFICIENCY_TARGET = 0.995


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        records = assign_split(sample_records(Path(tmp)), 0.02, key="record_id")
    texts = [
        (prefix_text(s, p), response_text(r))
        for s, p, r in records.select("system", "prompt", "response").iter_rows()
    ]
    tokenizer = train_bpe([a + b for a, b in texts], vocab_size=8192)
    flat = [t for pair in texts for t in pair]
    baseline = best_seconds(lambda: tokenizer.encode_batch(flat, add_special_tokens=False))
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(flat, add_special_tokens=False))

    def tokenize_and_pack():
        encoded = encode_records(tokenizer, records).join(
            records.select("record_id", "split"), on="record_id"
        )
        return build_sequences(encoded, SEQ_LEN, seed=1, pad_id=tokenizer.token_to_id(PAD))

    measured = best_seconds(tokenize_and_pack)
    lengths = encode_records(tokenizer, records)["n_tokens"].to_numpy()
    best_fit = plan_best_fit_decreasing(lengths, SEQ_LEN).efficiency(SEQ_LEN)
    greedy = plan_greedy_sequential(lengths, SEQ_LEN).efficiency(SEQ_LEN)
    ratio = baseline / measured
    return {
        "records": records.height,
        "tokens": tokens,
        "measured": f"tokenize+pack {tokens / measured:,.0f} tokens/s; best-fit-decreasing packs "
        f"{best_fit:.2%} real tokens",
        "baseline": f"encode_batch alone {tokens / baseline:,.0f} tokens/s; greedy sequential "
        f"packs {greedy:.2%}",
        "ratio": ratio,
        "packing_efficiency_bfd": round(best_fit, 5),
        "packing_efficiency_greedy": round(greedy, 5),
        "target": f"tokenize+pack >= {SPEED_TARGET} of encode_batch; >= {EFFICIENCY_TARGET:.1%} "
        "real tokens",
        "target_met": ratio >= SPEED_TARGET and best_fit >= EFFICIENCY_TARGET,
    }
