"""``make bench``: every benchmark beside its baseline, written to bench/results/.

Each benchmark returns a dict with its measurements, its baseline's, the ratio and the target;
the runner writes one JSON file per benchmark and a summary table (summary.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench import (
    bronze_ingest,
    gold_packing,
    silver_decision,
    silver_dedup,
    silver_language,
    silver_lookup,
    silver_scorers,
    sizer,
    training,
    trl_sft,
)

BENCHMARKS = {
    "bronze_ingest": bronze_ingest.run,
    "silver_dedup": silver_dedup.run,
    "silver_language": silver_language.run,
    "silver_scorers": silver_scorers.run,
    "silver_lookup": silver_lookup.run,
    "silver_decision": silver_decision.run,
    "gold_packing": gold_packing.run,
    "training": training.run,
    "trl_sft": trl_sft.run,
    "sizer": sizer.run,
}


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--only", choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, bench in BENCHMARKS.items():
        if args.only and name != args.only:
            continue
        print(f"== {name}", flush=True)
        result = {
            "benchmark": name,
            "at": datetime.now(timezone.utc).isoformat(),
            "machine": machine(),
            **bench(),
        }
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2), flush=True)
    lines = [
        "| benchmark | measured | baseline | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in (
        json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))
    ):  # this run's and earlier ones
        lines.append(
            f"| {r['benchmark']} | {r['measured']} | {r['baseline']} | {r['ratio']:.3f} | "
            f"{r['target']} | {r['target_met']} |"
        )
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
