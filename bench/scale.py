"""Landing to a data snapshot at scale: per stage wall time and rows/s, and the peak RSS of
every process.

``python -m bench.scale`` (in ``make bench``; not in ``make test``): the sample corpus as Markov
text (``pipeline-assets sample-data --text markov``) at 1 million and at 4 million records, landed
in batches of 500,000 (one shard of the corpus a batch: 4 sources x 125,000-line files). Each batch
is landed, then ``pipeline-assets run --select`` the data layers (bronze, silver, gold, the
snapshot) runs as its own process, in a fresh ``PIPELINE_HOME`` per size, exactly as a user would
run it. While it runs, the bench reads the peak RSS (``VmHWM``) of that process and of every process
under it (the local Ray's raylet, GCS and workers included) from ``/proc`` (Linux).

Per stage, the wall seconds and rows come from each materialization's own metadata in the Dagster
instance. Then the trainer runs TRAIN_STEPS steps on the newest snapshot, TRAIN_RANKS ranks under
torchrun, each streaming its share. Goals: the peak RSS of each kind of process grows by at most 25%
from the smallest to the largest size; silver's last batch takes at most 1.5 times its first; a
training rank's peak RSS at the largest size is at most 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

SIZES = (1_000_000, 4_000_000)
BATCH_RECORDS = 500_000
SOURCES = 4  # the Markov corpus' sources: a shard (one file of each) is one batch
DATA_LAYERS = "group:bronze or group:silver or group:gold"
STAGES = {
    "bronze/records": "bronze",
    "silver/records": "silver",
    "gold/sequences": "gold/sequences",
    "gold/tokenizer": "gold/tokenizer",
    "gold/snapshots": "gold/snapshots",
}
RSS_GROWTH_GOAL = 1.25
SILVER_SLOWDOWN_GOAL = 1.5
POLL_SECONDS = 0.2
TRAIN_RANKS, TRAIN_STEPS = 2, 20
TRAINING_RANK_RSS_GOAL_MB = 2048
SILVER_BATCHES = (100_000, 400_000)  # one batch of each: silver's memory is bounded by a block
SILVER_RSS_GROWTH_GOAL = 1.3
SILVER_PARTS = (  # silver's metadata: where its seconds went
    "prepare_wall_seconds",
    "search_wall_seconds",
    "decide_seconds",
    "write_wall_seconds",
    "commit_seconds",
    "block_stage_seconds",
)


def run(
    sizes: tuple[int, ...] = SIZES, batch_records: int = BATCH_RECORDS, root: Path | None = None
) -> dict:
    by_size = {}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for records in sizes:
            by_size[records] = _one_size(Path(tmp) / f"n{records}", records, batch_records)
    small, large = by_size[min(sizes)], by_size[max(sizes)]
    growth = {
        kind: round(large["peak_rss_mb"][kind] / small["peak_rss_mb"][kind], 3)
        for kind in small["peak_rss_mb"]
        if kind in large["peak_rss_mb"]
    }
    silver = [b["stages"]["silver"]["seconds"] for b in large["batches"] if "silver" in b["stages"]]
    slowdown = round(silver[-1] / silver[0], 3) if len(silver) > 1 else None
    worst_growth = max(growth.values()) if growth else None
    rank_rss = large["training"]["rank_peak_rss_mb"]
    return {
        "sizes": by_size,
        "peak_rss_growth": growth,
        "silver_last_over_first_batch": slowdown,
        "training_rank_peak_rss_mb": rank_rss,
        "measured": f"{max(sizes):,} records: peak RSS growth {worst_growth}x over {min(sizes):,} "
        "(worst process kind); "
        f"silver's last batch {slowdown}x its first; a training rank's peak RSS {rank_rss} MB",
        "baseline": f"{min(sizes):,} records landed the same way",
        "ratio": worst_growth if worst_growth is not None else float("nan"),
        "target": f"each process kind's peak RSS <= {RSS_GROWTH_GOAL}x; "
        f"silver's last batch <= {SILVER_SLOWDOWN_GOAL}x "
        f"its first; a training rank <= {TRAINING_RANK_RSS_GOAL_MB} MB",
        "target_met": bool(growth)
        and worst_growth <= RSS_GROWTH_GOAL
        and slowdown is not None
        and slowdown <= SILVER_SLOWDOWN_GOAL
        and rank_rss is not None
        and rank_rss <= TRAINING_RANK_RSS_GOAL_MB,
    }


def _one_size(home: Path, records: int, batch_records: int) -> dict:
    env = _home_env(home)
    started = time.perf_counter()
    shards = _write_corpus(env, home / "corpus", records, batch_records // SOURCES)
    generated = time.perf_counter() - started
    batches = []
    for number, files in enumerate(shards):
        _land(home, files)
        print(f"scale {records:,}: batch {number + 1}/{len(shards)}", file=sys.stderr, flush=True)
        batches.append(_run_batch(env))
    stages = _stage_figures(home / "dagster")
    for batch, figures in zip(batches, _per_batch(stages), strict=False):
        batch["stages"] = figures
    peak = defaultdict(float)
    for batch in batches:
        for kind, mb in batch.pop("rss_mb").items():
            peak[kind] = max(peak[kind], mb)
    print(f"scale {records:,}: training", file=sys.stderr, flush=True)
    return {
        "records": records,
        "batches": batches,
        "corpus_seconds": round(generated, 1),
        "peak_rss_mb": dict(sorted(peak.items())),
        "snapshot_stages": stages["unpartitioned"],
        "training": _train_ranks(home, env),
    }


def silver_batches(sizes: tuple[int, ...] = SILVER_BATCHES, root: Path | None = None) -> dict:
    """One batch of each size, alone in a fresh home: bronze first, then silver on its own while
    the peak RSS of every process under it is read. Goal: no kind of process grows by more than
    SILVER_RSS_GROWTH_GOAL from the smallest batch to the largest."""
    by_size = {}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for records in sizes:
            by_size[records] = _one_silver_batch(Path(tmp) / f"b{records}", records)
    small, large = by_size[min(sizes)], by_size[max(sizes)]
    growth = {
        kind: round(large["peak_rss_mb"][kind] / small["peak_rss_mb"][kind], 3)
        for kind in small["peak_rss_mb"]
        if kind in large["peak_rss_mb"]
    }
    worst = max(growth, key=growth.get)
    return {
        "sizes": by_size,
        "peak_rss_growth": growth,
        "measured": f"silver on a {max(sizes):,}-record batch: peak RSS {growth[worst]}x the "
        f"{min(sizes):,}-record batch's (worst process kind: {worst})",
        "baseline": f"the {min(sizes):,}-record batch",
        "ratio": growth[worst],
        "target": f"every process kind's peak RSS <= {SILVER_RSS_GROWTH_GOAL}x",
        "target_met": growth[worst] <= SILVER_RSS_GROWTH_GOAL,
    }


def _one_silver_batch(home: Path, records: int) -> dict:
    env = {**_home_env(home), "PIPELINE_RAY_MIN_ROWS": "0"}  # on Ray at every size, as compared
    shards = _write_corpus(env, home / "corpus", records, records // SOURCES)
    _land(home, [path for shard in shards for path in shard])  # landed at once: one batch
    print(f"silver batch of {records:,}: bronze", file=sys.stderr, flush=True)
    subprocess.run(
        [_cli(), "run", "--select", "group:bronze"], env=env, check=True, capture_output=True
    )
    print(f"silver batch of {records:,}: silver", file=sys.stderr, flush=True)
    seconds, rss = _watched([_cli(), "run", "--select", "group:silver"], env)
    silver = _newest_metadata(home / "dagster", "silver/records")
    return {
        "records": records,
        "silver_run_seconds": seconds,
        "silver_seconds": silver.get("wall_seconds"),
        "step_bytes_per_record": silver.get("step_bytes_per_record"),
        "silver_parts_seconds": {part: silver.get(part) for part in SILVER_PARTS},
        "peak_rss_mb": rss,
    }


def _home_env(home: Path) -> dict:
    corpus = home / "corpus"
    env = {
        **os.environ,
        "PIPELINE_HOME": str(home),
        "PIPELINE_LANDING_URI": str(home / "landing"),
        "PIPELINE_EVAL_SETS_URI": str(corpus / "_eval_sets"),
    }
    for name in ("PIPELINE_LAKE_URI", "DAGSTER_HOME", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


def _write_corpus(env: dict, corpus: Path, records: int, file_records: int) -> list[list[str]]:
    """The Markov corpus of ``records``, files of ``file_records`` lines; each shard's paths (a
    shard: a file of each source)."""
    subprocess.run(
        [
            _cli(),
            "sample-data",
            "--text",
            "markov",
            "--records",
            str(records),
            "--out",
            str(corpus),
            "--eval-sets-out",
            str(corpus / "_eval_sets"),
            "--file-records",
            str(file_records),
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    manifest = json.loads((corpus / "_sample_manifest.json").read_text())
    shards = sorted({f["shard"] for f in manifest["files"]})
    return [[f["path"] for f in manifest["files"] if f["shard"] == shard] for shard in shards]


def _land(home: Path, files: list[str]) -> None:
    for path in files:
        target = home / "landing" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(home / "corpus" / path, target)


def _run_batch(env: dict) -> dict:
    seconds, rss = _watched([_cli(), "run", "--select", DATA_LAYERS], env)
    return {"run_seconds": seconds, "rss_mb": rss}


def _train_ranks(home: Path, env: dict) -> dict:
    """TRAIN_STEPS of the trainer on the newest snapshot, TRAIN_RANKS ranks under torchrun: each
    rank streams its share of the snapshot; its peak RSS is the goal's."""
    from deltalake import DeltaTable

    from pipeline_assets.lib.training.torchrun import torchrun_command, torchrun_env
    from pipeline_assets.trainer.config import TrainConfig

    lake = home / "lake"
    snapshot = DeltaTable(str(lake / "gold" / "snapshots")).version()
    config = TrainConfig(
        lake_uri=str(lake),
        snapshot=snapshot,
        checkpoint_uri=str(home / "checkpoints"),
        partition=f"gold-v{snapshot}",
        steps=TRAIN_STEPS,
        eval_every=TRAIN_STEPS,
        log_every=TRAIN_STEPS,
        checkpoint_every_steps=TRAIN_STEPS,
        scratch_dir=str(home / "scratch"),
    )
    seconds, rss = _watched(
        torchrun_command(TRAIN_RANKS, config.to_args()), {**env, **torchrun_env(1)}
    )
    return {
        "snapshot": f"gold-v{snapshot}",
        "ranks": TRAIN_RANKS,
        "steps": TRAIN_STEPS,
        "seconds": seconds,
        "rank_peak_rss_mb": rss.get("training rank"),
        "rss_mb": rss,
    }


def _watched(command: list[str], env: dict) -> tuple[float, dict[str, float]]:
    """Run ``command`` to its end; its wall seconds and the peak RSS (MB) of each kind of
    process under it."""
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    peaks: dict[int, tuple[str, float]] = {}
    watcher = threading.Thread(target=_watch_tree, args=(process, peaks), daemon=True)
    watcher.start()
    _, stderr = process.communicate()
    watcher.join()
    if process.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} exited {process.returncode}:\n{stderr[-4000:]}"
        )
    by_kind: dict[str, float] = defaultdict(float)
    for kind, mb in peaks.values():
        by_kind[kind] = round(max(by_kind[kind], mb), 1)
    return round(time.perf_counter() - started, 1), dict(by_kind)


def _watch_tree(process: subprocess.Popen, peaks: dict[int, tuple[str, float]]) -> None:
    """Until ``process`` ends: every process under it, by pid, with its kind and peak RSS (MB)."""
    while process.poll() is None:
        for pid in _tree(process.pid):
            status = _status(pid)
            if status is not None:
                peaks[pid] = (_kind(pid), max(status, peaks.get(pid, ("", 0.0))[1]))
        time.sleep(POLL_SECONDS)


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _status(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _kind(pid: int) -> str:
    """What a process is: the run itself, a Ray worker, or another Ray process (raylet,
    gcs_server...)."""
    try:
        command = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return "gone"
    if "pipeline-assets" in command and " run" in command:
        return "pipeline-assets run"
    if "torchrun" in command:
        return "torchrun agent"
    if "-m pipeline_assets.trainer" in command:
        return "training rank"
    if "default_worker.py" in command or command.startswith("ray::"):
        return "ray worker"
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if name in command:
            return f"ray {name.removesuffix('.py')}"
    return Path(command.split(" ", 1)[0]).name or "other"


def _stage_figures(dagster_home: Path) -> dict:
    """Per batch partition and for the unpartitioned assets: each stage's wall seconds, rows
    and rows/s."""
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    from dagster import AssetKey, DagsterInstance

    figures: dict = {"partitioned": defaultdict(dict), "unpartitioned": {}}
    with DagsterInstance.get() as instance:
        for key, stage in STAGES.items():
            records = instance.fetch_materializations(AssetKey(key.split("/")), limit=1000).records
            for record in sorted(records, key=lambda r: r.storage_id):
                event = record.asset_materialization
                metadata = {k: v.value for k, v in event.metadata.items()}
                seconds = metadata.get("wall_seconds")
                rows = metadata.get("dagster/row_count")
                entry = {
                    "seconds": seconds,
                    "rows": rows,
                    "rows_per_second": round(rows / seconds) if rows and seconds else None,
                }
                if stage == "silver":  # None: not counted (before the flow of issue 37)
                    entry["step_bytes_per_record"] = metadata.get("step_bytes_per_record")
                if event.partition:
                    figures["partitioned"][event.partition][stage] = entry
                else:
                    figures["unpartitioned"].setdefault(stage, []).append(entry)
    return figures


def _newest_metadata(dagster_home: Path, key: str) -> dict:
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    from dagster import AssetKey, DagsterInstance

    with DagsterInstance.get() as instance:
        records = instance.fetch_materializations(AssetKey(key.split("/")), limit=1).records
        if not records:
            return {}
        return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def _per_batch(stages: dict) -> list[dict]:
    return [stages["partitioned"][batch] for batch in sorted(stages["partitioned"])]


def _cli() -> str:
    return str(Path(sys.executable).with_name("pipeline-assets"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument(
        "--records", type=int, nargs="+", default=list(SIZES), help="corpus sizes, smallest first"
    )
    parser.add_argument("--batch-records", type=int, default=BATCH_RECORDS)
    parser.add_argument(
        "--silver-batches",
        type=int,
        nargs="+",
        help="instead: silver alone on one batch of each of these sizes (its memory by batch size)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    args = parser.parse_args(argv)
    from bench.run import machine

    measured = (
        silver_batches(tuple(args.silver_batches))
        if args.silver_batches
        else run(tuple(args.records), args.batch_records)
    )
    result = {
        "benchmark": "scale_silver_batches" if args.silver_batches else "scale",
        "at": datetime.now(timezone.utc).isoformat(),
        "machine": machine(),
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
