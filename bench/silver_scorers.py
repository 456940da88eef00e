"""Silver: a scorer's stages against the same model called directly, records/s per CPU core.

The scorer is a small Qwen2ForSequenceClassification with one logit (a reward model's shape),
built from a config with random weights, its BPE tokenizer trained on the bench's records. Three
sides score the sample corpus's responses, each in a helper process started with one thread for
torch, polars and tokenizers, best of REPEATS each, interleaved, after one untimed pass each:

- ``stage``: silver's stages as silver runs them, ``scorer_stages([spec], SFT)`` through
  ``run_in_process`` in blocks of ROWS_PER_BLOCK: tokenizing, then scoring sorted by length in
  batches of SCORING_BATCH.
- ``loop``: what a user's script does without batching: tokenize one record, forward it alone.
- ``batches``: plain batches of SCORING_BATCH in the records' order, padded by the tokenizer,
  unsorted: what sorting by length buys.

Before timing, the stage's scores must equal the loop's within TOLERANCE (and so must the
batches'): the sides do the same work. Records/s per core are records over CPU seconds of the
process; wall seconds beside them. ``ratio`` is the stage's records/s over the loop's (above 1:
batching repays the stage's own work), ``ratio_to_unsorted_batches`` over the plain batches'.

    python -m bench.silver_scorers RECORDS.parquet MODEL_FOLDER
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench.sample import sample_records
from pipeline_assets.lib.formats import SFT
from pipeline_assets.lib.silver.scorers import ScorerSpec
from pipeline_assets.lib.silver.scoring import SCORING_BATCH, scorer_stages
from pipeline_assets.lib.stages import ROWS_PER_BLOCK, run_in_process

RECORDS = 1_000  # the sample corpus of this size: about 1% of its lines are malformed
REPEATS = 3
TOLERANCE = 1e-4
MAX_TOKENS = 256
SCORER = "bench"
PAD = "<|endoftext|>"
TARGET = 1.0  # the stage costs less than it saves: at least the one-record loop's records/s
ONE_THREAD = {"POLARS_MAX_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        records = sample_records(Path(tmp), records=RECORDS)
        path = Path(tmp) / "records.parquet"
        records.select("record_id", "response").write_parquet(path)
        folder = reward_model_folder(Path(tmp) / "reward", records["response"].to_list())
        done = subprocess.run(
            [sys.executable, "-m", "bench.silver_scorers", str(path), str(folder)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, **ONE_THREAD},
        )
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    n = seconds["records"]
    per_core = {side: n / seconds[f"{side}_seconds"] for side in ("stage", "loop", "batches")}
    ratio = per_core["stage"] / per_core["loop"]
    return {
        "records": n,
        "tokens": seconds["tokens"],
        "max_score_difference": seconds["max_score_difference"],
        "measured": f"scorer stage {per_core['stage']:,.0f} records/s per core",
        "baseline": (
            f"one record a forward {per_core['loop']:,.0f}; "
            f"unsorted batches of {SCORING_BATCH} {per_core['batches']:,.0f} records/s per core"
        ),
        "ratio": ratio,
        "ratio_to_unsorted_batches": per_core["stage"] / per_core["batches"],
        "ratio_wall_clock": seconds["loop_wall_seconds"] / seconds["stage_wall_seconds"],
        "ratio_to_unsorted_batches_wall_clock": (
            seconds["batches_wall_seconds"] / seconds["stage_wall_seconds"]
        ),
        "target": f"stage >= {TARGET}x the one-record loop's records/s, one thread each",
        "target_met": ratio >= TARGET,
    }


def reward_model_folder(folder: Path, texts: list[str]) -> Path:
    """A Qwen2 reward model (one logit) with random weights and a tokenizer trained on texts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = _trained_tokenizer(texts)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_TOKENS,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    folder.mkdir(parents=True)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _trained_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4_000,
        special_tokens=[PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=PAD, pad_token=PAD, model_max_length=MAX_TOKENS
    )


# --- The helper process: the three sides, one thread each ----------------------------------------


def main(records_path: str, folder: str) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if pl.thread_pool_size() != 1 or os.environ.get("TOKENIZERS_PARALLELISM") != "false":
        raise SystemExit("run with POLARS_MAX_THREADS=1 and TOKENIZERS_PARALLELISM=false")
    torch.set_num_threads(1)
    records = pl.read_parquet(records_path)
    texts = records["response"].to_list()
    stages = scorer_stages([ScorerSpec(SCORER, folder)], SFT)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sides = {
        "stage": lambda: run_in_process(stages, records, ROWS_PER_BLOCK).kept[f"score_{SCORER}"],
        "loop": lambda: one_at_a_time(model, tokenizer, texts),
        "batches": lambda: unsorted_batches(model, tokenizer, texts),
    }
    with torch.inference_mode():
        scores = {side: np.asarray(work(), dtype=np.float64) for side, work in sides.items()}
        difference = _checked_agreement(scores)
        timings = {side: [] for side in sides}
        for _ in range(REPEATS):
            for side, work in sides.items():
                timings[side].append(_timed(work))
    out = {"records": records.height, "tokens": _tokens(tokenizer, texts)}
    out["max_score_difference"] = difference
    for side, runs in timings.items():
        out[f"{side}_seconds"] = min(cpu for cpu, _ in runs)
        out[f"{side}_wall_seconds"] = min(wall for _, wall in runs)
    return out


def one_at_a_time(model, tokenizer, texts: list[str]) -> list[float]:
    scores = []
    for text in texts:
        encoded = tokenizer(text, return_tensors="pt", **_encoding(tokenizer))
        scores.append(model(**encoded).logits[0, 0].item())
    return scores


def unsorted_batches(model, tokenizer, texts: list[str]) -> list[float]:
    scores = []
    for start in range(0, len(texts), SCORING_BATCH):
        batch = texts[start : start + SCORING_BATCH]
        encoded = tokenizer(batch, padding=True, return_tensors="pt", **_encoding(tokenizer))
        scores.extend(model(**encoded).logits[:, 0].tolist())
    return scores


def _encoding(tokenizer) -> dict:
    """The stage's encoding (``encode_texts``): truncated to the model's length, a special
    token's spelling in the text kept as text."""
    return {
        "truncation": True,
        "max_length": tokenizer.model_max_length,
        "split_special_tokens": True,
    }


def _checked_agreement(scores: dict[str, np.ndarray]) -> float:
    """The largest difference of the stage's and the batches' scores from the loop's; refuses to
    time sides that disagree, or scores that do not vary (a constant agrees with anything)."""
    loop = scores["loop"]
    if np.ptp(loop) < 100 * TOLERANCE:
        raise SystemExit(f"the scores hardly vary ({np.ptp(loop):.2e}): nothing to compare")
    worst = max(float(np.abs(scores[side] - loop).max()) for side in ("stage", "batches"))
    if worst > TOLERANCE:
        raise SystemExit(f"the sides score differently (up to {worst:.2e}): not the same work")
    return worst


def _tokens(tokenizer, texts: list[str]) -> int:
    return sum(len(ids) for ids in tokenizer(texts, **_encoding(tokenizer))["input_ids"])


def _timed(work) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
