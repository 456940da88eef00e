"""The sizer against a measured run it was not calibrated on.

Calibration: one home runs the sample corpus in two passes of different sizes (a third of each
landing file's lines, then the rest, training 20 then 40 steps), and the tokenizer is made a second
time so that every stage has two sizes to fit. Target: a fresh home runs a corpus three times as
large in one pass, against the same eval sets, training 120 steps. The sizer, given only the target's record count, average characters and
training tokens, predicts each stage's seconds; the target's own pipeline report says what they
were. Baseline: scaling each stage's calibration time in proportion to the records (tokens for
training), with no fixed part. Both are judged by their worst stage.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import zstandard

from pipeline_assets.lib.sample_corpus import write_sample_corpus
from pipeline_assets.lib.sizing import text_chars

CALIBRATION_RECORDS, TARGET_RECORDS = 6_000, 18_000
FIRST_PASS_SHARE = 1 / 3
STEPS = {"first pass": 20, "second pass": 40, "target": 120}
TOLERANCE = 0.30
TIMEOUT_S = 900


def cli(home: Path, *args: str, steps: int = 20) -> str:
    """``pipeline-assets ARGS`` in ``home``."""
    return _command(home, [sys.executable, "-m", "pipeline_assets.cli", *args], steps)


def _command(home: Path, command: list[str], steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "DAGSTER_", "MLFLOW_"))}
    env.update(PIPELINE_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), PIPELINE_TRAIN_STEPS=str(steps),
               PIPELINE_PROMOTION_MARGIN="-1", PIPELINE_SLICE_TOLERANCE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[-4:])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def calibrate(tmp: Path) -> Path:
    staging, home = tmp / "staging", tmp / "calibration"
    write_sample_corpus(staging, records=CALIBRATION_RECORDS, eval_sets_dir=home / "reference" / "eval_sets")
    files = sorted(p for p in staging.rglob("*") if p.is_file() and not p.name.startswith("_"))
    for name, part in (("first pass", 0), ("second pass", 1)):
        for path in files:  # every file in both passes: each batch has as many files as the target's
            split_landing_file(path, FIRST_PASS_SHARE, part, home / "landing" / path.parent.relative_to(staging))
        print(f"calibration, {name}", flush=True)
        cli(home, "run", steps=STEPS[name])
    # The tokenizer is made once; made again by hand (Dagster's CLI) on the larger corpus, it has a second size to fit.
    _command(home, [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "pipeline_assets.definitions",
                    "--select", "gold/tokenizer"], steps=STEPS["second pass"])
    return home


def split_landing_file(path: Path, share: float, part: int, folder: Path) -> None:
    """Part 0 (the first ``share`` of the lines or rows) or part 1 (the rest) of a landing file, same format."""
    stem, _, suffix = path.name.partition(".")
    out = folder / f"{stem}-part{part}.{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == "parquet":
        rows = pl.read_parquet(path)
        cut = round(rows.height * share)
        (rows.head(cut) if part == 0 else rows.slice(cut)).write_parquet(out)
        return
    codec = {"jsonl.gz": (gzip.decompress, gzip.compress),
             "jsonl.zst": (zstandard.ZstdDecompressor().decompressobj().decompress, zstandard.ZstdCompressor().compress),
             "jsonl": (bytes, bytes)}[suffix]
    lines = codec[0](path.read_bytes()).splitlines(keepends=True)
    cut = round(len(lines) * share)
    out.write_bytes(codec[1](b"".join(lines[:cut] if part == 0 else lines[cut:])))


def measure_target(tmp: Path) -> tuple[Path, dict]:
    home = tmp / "target"
    write_sample_corpus(home / "landing", records=TARGET_RECORDS, eval_sets_dir=tmp / "target_eval_sets")
    # the same benchmarks as the calibration's: eval sets do not grow with the corpus
    shutil.copytree(tmp / "calibration" / "reference", home / "reference")
    print("target run", flush=True)
    cli(home, "run", steps=STEPS["target"])
    bronze = pl.read_delta(str(home / "lake" / "bronze" / "records"))
    quarantined = pl.read_delta(str(home / "lake" / "bronze" / "quarantine")).height
    report = pl.read_delta(str(home / "lake" / "ops" / "pipeline_report"))
    return home, {"records": bronze.height + quarantined, "avg_chars": text_chars(bronze) / (bronze.height + quarantined),
                  "report": report}


def proportional(calibration_report: pl.DataFrame, target_report: pl.DataFrame) -> dict[str, float]:
    """Each stage's calibration seconds times the growth of its records (tokens for training)."""
    def scale(report: pl.DataFrame) -> dict[str, float]:
        return dict(report.select("stage", pl.when(pl.col("stage") == "training").then(pl.col("tokens"))
                                  .otherwise(pl.lit(report.filter(pl.col("stage") == "bronze")["rows"][0]))).iter_rows())
    before, after = scale(calibration_report), scale(target_report)
    walls = dict(calibration_report.select("stage", "wall_seconds").iter_rows())
    return {stage: walls[stage] * after[stage] / before[stage] for stage in walls}


def run(keep: Path | None = None) -> dict:
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        tmp = keep or Path(folder)
        calibration = calibrate(tmp)
        _, target = measure_target(tmp)
        report = target["report"]
        measured = dict(report.select("stage", "wall_seconds").iter_rows())
        trained = int(report.filter(pl.col("stage") == "training")["tokens"][0])
        sized = json.loads(cli(calibration, "sizer", "--json", "--records", str(target["records"]),
                               "--avg-chars", f"{target['avg_chars']:.3f}", "--cpu-workers", str(len(os.sched_getaffinity(0))),
                               "--batch-records", str(target["records"]), "--train-tokens", str(trained), "--first-model"))
        calibration_report = pl.read_delta(str(calibration / "lake" / "ops" / "pipeline_report"))
        latest = calibration_report.filter(pl.col("report_id") == calibration_report["report_id"].max())
    predicted = {row["stage"]: row["wall_seconds"] for row in sized["stages"]}
    baseline = proportional(latest, report)
    error = {stage: predicted[stage] / measured[stage] - 1 for stage in measured}
    baseline_error = {stage: baseline[stage] / measured[stage] - 1 for stage in measured}
    worst, worst_baseline = max(abs(e) for e in error.values()), max(abs(e) for e in baseline_error.values())
    return {
        "calibration": {"records": CALIBRATION_RECORDS, "passes": 2, "train_steps": [STEPS["first pass"], STEPS["second pass"]]},
        "target_run": {"records": target["records"], "avg_chars": round(target["avg_chars"], 1), "train_tokens": trained},
        "stages": {stage: {"measured_s": round(measured[stage], 3), "sizer_s": round(predicted[stage], 3),
                           "sizer_error": round(error[stage], 3), "proportional_s": round(baseline[stage], 3),
                           "proportional_error": round(baseline_error[stage], 3)} for stage in measured},
        "fits": sized["totals"]["fits"],
        "measured": f"sizer's worst stage {worst:.1%} off ({max(error, key=lambda s: abs(error[s]))})",
        "baseline": f"proportional scaling's worst stage {worst_baseline:.1%} off "
                    f"({max(baseline_error, key=lambda s: abs(baseline_error[s]))})",
        "ratio": worst / worst_baseline,
        "ratio_is": "the sizer's worst per-stage relative error / proportional scaling's",
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_1m": {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)},
        "target": f"every stage's predicted seconds within {TOLERANCE:.0%} of the measured run's",
        "target_met": worst <= TOLERANCE,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for sizer.json (else printed only)")
    parser.add_argument("--keep", type=Path, help="an empty folder to run in and keep (the homes, to look into)")
    args = parser.parse_args(argv)
    result = {"benchmark": "sizer", **run(args.keep)}
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sizer.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
