"""``pipeline-assets``: the headless face of the code location."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pipeline_assets.lib.formats import FORMATS
from pipeline_assets.lib.uris import redact
from pipeline_assets.resources.settings import Settings
from pipeline_assets.sample_data.corpus import (
    ADDED_SECTIONS,
    MARKOV_FILE_RECORDS,
    SAMPLE_RECORDS,
)

# What a Hugging Face model folder needs to load in transformers and vLLM.
SERVABLE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeline-assets", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="turn new landing files into batches and materialize everything stale"
    )
    run.add_argument(
        "--select", help='Dagster asset selection, e.g. "key:bronze/*" (default: everything stale)'
    )

    commands.add_parser(
        "backfill-decontamination",
        help="after the eval sets changed: redo silver's decontamination of every batch, "
        "oldest first, then cut the next snapshot",
    )

    sample = commands.add_parser("sample-data", help="write the deterministic sample corpus")
    sample.add_argument("--records", type=int, default=SAMPLE_RECORDS)
    sample.add_argument(
        "--out", type=Path, help="landing zone to write into (default: PIPELINE_LANDING_URI)"
    )
    sample.add_argument(
        "--eval-sets-out",
        type=Path,
        help="where the eval sets go (default: PIPELINE_EVAL_SETS_URI)",
    )
    sample.add_argument("--seed", type=int, default=20261121)
    sample.add_argument(
        "--text",
        choices=("docstrings", "markov"),
        default="docstrings",
        help="docstrings: real docstring prose, up to about 23,000 records; markov: text generated "
        "by a Markov chain trained on that prose, any number of records, streamed to disk",
    )
    sample.add_argument(
        "--file-records",
        type=int,
        help=f"markov text only: most lines per landing file (default {MARKOV_FILE_RECORDS:,}); "
        "file k of every source makes shard k",
    )
    sample.add_argument(
        "--preference-pairs",
        type=int,
        default=0,
        metavar="N",
        help="docstring text only: also write N preference pairs as source `prefs` (record format "
        "`preference`), with their own injected defects (default 0: none)",
    )
    sample.add_argument(
        "--conversations",
        type=int,
        default=0,
        metavar="N",
        help="docstring text only: also write N conversations of 2 to 4 exchanges as source "
        "`chats` (record format `conversation`, some lines in the ShareGPT shape), with the sft "
        "records' injected defects and the malformed turns bronze quarantines (default 0: none)",
    )

    commands.add_parser(
        "snapshot",
        help="cut a new data snapshot now, whatever its cadence says (recorded as by hand)",
    )

    commands.add_parser("summary", help="rows per layer and quarantine by reason, from the lake")

    lineage = commands.add_parser(
        "lineage", help="JSON: a registered model back to the landing files that fed it"
    )
    lineage.add_argument(
        "model", help="MODEL@ALIAS (sft-model@champion) or MODEL/VERSION (sft-model/3)"
    )

    export = commands.add_parser(
        "export",
        help="a registered model version as a Hugging Face model folder (transformers, vLLM)",
    )
    export.add_argument(
        "model", help="MODEL@ALIAS (sft-model@champion) or MODEL/VERSION (sft-model/3)"
    )
    export.add_argument(
        "--out", required=True, type=Path, help="the folder to write (new or empty)"
    )
    export.add_argument(
        "--generate",
        metavar="PROMPT",
        help="then load the folder with transformers and print its answer to PROMPT (a check that "
        "it serves)",
    )

    promote = commands.add_parser(
        "promote", help="move the champion alias to a version by hand (recorded)"
    )
    promote.add_argument("model", help="MODEL/VERSION, e.g. sft-model/3")
    promote.add_argument("--reason", default="promoted by hand")

    rollback = commands.add_parser(
        "rollback",
        help="move the champion alias back to the champion before it (recorded); again goes "
        "further back",
    )
    rollback.add_argument("model_name", help="e.g. sft-model")
    rollback.add_argument("--reason", default="rolled back by hand")

    sizer = commands.add_parser(
        "sizer",
        help="predict each stage's time, the bottleneck, the wall-clock and the cost for a corpus "
        "size",
        description="Calibrated on the stages' past materializations in this instance (run the "
        "pipeline first). Data stages run on processes like the measured ones; training scales "
        "over GPUs.",
    )
    sizer.add_argument("--records", type=int, required=True, help="landed records")
    sizer.add_argument(
        "--avg-chars",
        type=float,
        help="characters of prompt+response+system per record (default: as measured)",
    )
    sizer.add_argument(
        "--cpu-workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="CPU cores (default: this machine's)",
    )
    sizer.add_argument(
        "--gpus", type=int, default=0, help="GPUs for training (0: train on CPU ranks, as measured)"
    )
    sizer.add_argument(
        "--batch-records", type=int, default=1_000_000, help="records per ingest batch"
    )
    sizer.add_argument("--epochs", type=float, default=1.0, help="passes over the training split")
    sizer.add_argument("--train-tokens", type=float, help="tokens to train on, instead of --epochs")
    sizer.add_argument(
        "--first-model",
        action="store_true",
        help="no champion yet: evaluation scores one model, not two",
    )
    sizer.add_argument(
        "--gpu-tokens-per-second",
        type=float,
        help="training tokens/s of one GPU (default: measured, or assumed from --mfu and "
        "--gpu-peak-tflops)",
    )
    sizer.add_argument(
        "--mfu",
        type=float,
        default=0.40,
        help="assumed model FLOPs utilisation on GPU (default 0.40)",
    )
    sizer.add_argument(
        "--gpu-peak-tflops",
        type=float,
        default=989.0,
        help="bf16 dense peak (default 989: H100 SXM)",
    )
    sizer.add_argument(
        "--preset",
        help="model preset trained (default: the base model PIPELINE_BASE_MODEL names, else "
        "PIPELINE_TRAIN_PRESET)",
    )
    sizer.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sizer.add_argument(
        "--picture",
        type=Path,
        help="where the PNG goes (default: $PIPELINE_HOME/reports/sizer-<time>.png)",
    )

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    logging.getLogger("pipeline_assets").setLevel(logging.INFO)
    signal.signal(signal.SIGTERM, _interrupt)  # a stop request takes Ctrl-C's path
    try:
        settings = Settings.from_env()
        handlers = {
            "run": _run,
            "snapshot": _snapshot,
            "backfill-decontamination": _backfill_decontamination,
            "sample-data": _sample_data,
            "summary": _summary,
            "lineage": _lineage,
            "export": _export,
            "promote": _promote,
            "rollback": _rollback,
            "sizer": _sizer,
        }
        return handlers[args.command](args, settings)
    except KeyboardInterrupt as exc:
        print(
            f"pipeline-assets {args.command}: stopped by a signal{f': {exc}' if str(exc) else ''}. "
            "Run the same command again to go on (training resumes from its newest checkpoint).",
            file=sys.stderr,
        )
        return 130
    except (ValueError, OSError) as exc:  # bad settings or paths: a message, not a traceback
        print(f"pipeline-assets {args.command}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:
        if (
            type(exc).__name__ != "MlflowException"
        ):  # imported lazily: most commands never load mlflow
            raise
        print(f"pipeline-assets {args.command}: MLflow: {redact(exc.message)}", file=sys.stderr)
        return 2


def _run(args, settings: Settings) -> int:
    from pipeline_assets.cli.headless import (
        headless_instance,
        one_headless_run,
        register_batches,
        run_stale,
    )
    from pipeline_assets.definitions import defs

    with one_headless_run(settings.dagster_home, say=_say):
        instance = headless_instance(settings.dagster_home, say=_say)
        added = register_batches(defs.resources, instance)
        print(f"new ingest batches: {', '.join(added) or 'none'}")
        outcome = run_stale(defs, instance, args.select)
    return _report(outcome, settings)


def _say(message: str) -> None:
    print(message, flush=True)


def _interrupt(signum, frame) -> None:
    """SIGTERM as SIGINT: Dagster turns it into a run interruption (the training job gets SIGINT and
    saves a checkpoint), outside a run it is a KeyboardInterrupt."""
    signal.raise_signal(signal.SIGINT)


def _snapshot(args, settings: Settings) -> int:
    from pipeline_assets.cli.headless import (
        RunOutcome,
        cut_snapshot_if_due,
        headless_instance,
        one_headless_run,
    )
    from pipeline_assets.definitions import defs

    with one_headless_run(settings.dagster_home, say=_say):
        instance = headless_instance(settings.dagster_home, say=_say)
        outcome = RunOutcome()
        cut_snapshot_if_due(
            defs,
            instance,
            defs.resolve_implicit_global_asset_job_def(),
            outcome,
            by_hand="requested by hand (pipeline-assets snapshot)",
        )
    print("`pipeline-assets run` trains it, once its blocking checks passed")
    return _report(outcome, settings)


def _report(outcome, settings: Settings) -> int:
    print(
        f"runs: {len(outcome.runs)} (in the instance at {settings.dagster_home}; `make dev` shows "
        "them)"
    )
    print(
        f"checks: {outcome.checks_passed} passed, {len(outcome.warnings)} warning(s), "
        f"{len(outcome.failed_blocking_checks)} blocking failure(s)"
    )
    for warning in outcome.warnings:
        print(f"WARNING: {warning}")
    for waiting in outcome.waiting:
        print(f"WAITING: {waiting}")
    for problem in outcome.failed_runs + outcome.failed_blocking_checks:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _backfill_decontamination(args, settings: Settings) -> int:
    from pipeline_assets.cli.backfill import backfill_decontamination
    from pipeline_assets.cli.headless import headless_instance, one_headless_run
    from pipeline_assets.definitions import defs

    with one_headless_run(settings.dagster_home, say=_say):
        outcome = backfill_decontamination(defs, headless_instance(settings.dagster_home, say=_say))
    print(
        f"runs: {len(outcome.runs)} (the eval sets' observation, silver per batch oldest first, "
        "the next snapshot)"
    )
    for problem in outcome.failed_runs + outcome.failed_blocking_checks:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _sample_data(args, settings: Settings) -> int:
    out = args.out or _local(settings.landing_uri, "PIPELINE_LANDING_URI")
    eval_out = args.eval_sets_out or _local(settings.eval_sets_uri, "PIPELINE_EVAL_SETS_URI")
    _check_added_sources(args)
    if args.text == "markov":
        from pipeline_assets.sample_data.markov_corpus import write_markov_corpus

        file_records = MARKOV_FILE_RECORDS if args.file_records is None else args.file_records
        manifest = write_markov_corpus(
            out,
            records=args.records,
            eval_sets_dir=eval_out,
            seed=args.seed,
            file_records=file_records,
        )
    else:
        from pipeline_assets.sample_data.corpus import write_sample_corpus

        if args.file_records is not None:
            raise ValueError("--file-records applies to --text markov only")
        manifest = write_sample_corpus(
            out, records=args.records, eval_sets_dir=eval_out, seed=args.seed
        )
        manifest = _add_sources(args, out, eval_out) or manifest
    added = {name: manifest[name] for name in ADDED_SECTIONS if name in manifest}
    summary = {"landing": str(out), "eval_sets": str(eval_out), **manifest["expected"]}
    print(json.dumps({**summary, **{n: s["expected"] for n, s in added.items()}}, indent=2))
    if added:
        from pipeline_assets.sample_data.corpus import added_sources_setting

        holds = " and ".join(f"{s['source']}/ {_HOLDS[s['format']]}" for s in added.values())
        print(
            f"{holds}; bronze reads them as such with "
            f"{added_sources_setting(manifest, settings.source_formats)}",
            file=sys.stderr,
        )  # stdout stays one JSON document
    return 0


# What an added source's lines are, by record format.
_HOLDS = {"preference": "holds preference pairs", "conversation": "holds conversations"}


def _check_added_sources(args) -> None:
    """Fails before anything is written when an added source's count is wrong or cannot be had."""
    if args.preference_pairs:
        from pipeline_assets.sample_data.preferences import check_pair_count

        check_pair_count(args.preference_pairs)
    if args.conversations:
        from pipeline_assets.sample_data.conversations import check_conversation_count

        check_conversation_count(args.conversations)
    for flag, value in (
        ("--preference-pairs", args.preference_pairs),
        ("--conversations", args.conversations),
    ):
        if value and args.text == "markov":
            raise ValueError(f"{flag} applies to --text docstrings only")


def _add_sources(args, out: Path, eval_out: Path) -> dict | None:
    """The manifest once the preference and conversation sources asked for are added, or None."""
    manifest = None
    if args.preference_pairs:
        from pipeline_assets.sample_data.preferences import add_preference_source

        manifest = add_preference_source(out, args.preference_pairs, eval_sets_dir=eval_out)
    if args.conversations:
        from pipeline_assets.sample_data.conversations import add_conversation_source

        manifest = add_conversation_source(out, args.conversations, eval_sets_dir=eval_out)
    return manifest


def _summary(args, settings: Settings) -> int:
    import polars as pl

    from pipeline_assets.defs.resources import build_resources

    lake = build_resources(settings)["lake"]
    report: dict = {"lake": settings.lake_uri, "tables": {}}
    formats = FORMATS.values()
    tables = [
        ("landing", "manifest"),
        *(("bronze", fmt.bronze_table) for fmt in formats),
        ("bronze", "quarantine"),
        *(("silver", fmt.silver_table) for fmt in formats),
        ("silver", "rejects"),
        ("silver", "minhash_index"),
        ("silver", "minhash_bands"),
        ("gold", "tokenizer"),
        ("gold", "sequences"),
        ("gold", "snapshots"),
        ("gold", "preference_sequences"),
        ("gold", "preference_snapshots"),
        ("gold", "reference_logps"),
        ("evaluation", "report"),
        ("ops", "pipeline_report"),
    ]
    for layer, name in tables:
        scan = lake.scan(layer, name)
        report["tables"][f"{layer}/{name}"] = (
            None
            if scan is None
            else {
                "delta_version": lake.version(layer, name),
                "rows": scan.select(pl.len()).collect().item(),
            }
        )
    for key, (layer, name, column) in {
        "quarantined_by_reason": ("bronze", "quarantine", "reason"),
        "rejected_by_stage": ("silver", "rejects", "stage"),
    }.items():
        scan = lake.scan(layer, name)
        if scan is not None:
            report[key] = dict(
                scan.group_by(column).len().sort("len", descending=True).collect().iter_rows()
            )
    newest = lake.version("gold", "snapshots")
    if newest is not None:
        report["data_snapshot"] = _snapshot_summary(lake, newest)
    report["pipeline"] = _latest_pipeline_report(lake)
    report["model"] = _champion_summary(settings)
    report["dpo"] = _dpo_summary(settings)
    report["look_next"] = {
        "dagster": "make dev, then http://127.0.0.1:3000/asset-groups (the graph) and /runs",
        "mlflow": f"{settings.mlflow_ui_url}/#/models/{settings.model_name} (the registry; make "
        "dev serves it)",
        "lineage": f"pipeline-assets lineage {settings.model_name}@champion",
    }
    print(json.dumps(report, indent=2))
    return 0


def _snapshot_summary(lake, number: int) -> dict:
    """The newest data snapshot: its shards, sequences per split and packing, from small columns
    only."""
    import polars as pl

    from pipeline_assets.lib.gold.manifest import read_manifest, sequences_scan

    manifest = read_manifest(lake.uri, number)
    real_tokens = (
        sequences_scan(lake.uri, manifest).select(pl.col("real_tokens").sum()).collect().item()
    )
    rows = sum(manifest.sequences_by_split().values())
    return {
        "partition": manifest.key,
        "batches": len(manifest.batches),
        "sequences_by_split": manifest.sequences_by_split(),
        "real_tokens": int(real_tokens),
        "packing_efficiency": round(real_tokens / (rows * manifest.seq_len), 4) if rows else 0.0,
    }


def _sizer(args, settings: Settings) -> int:
    from datetime import datetime, timezone

    from pipeline_assets.cli.headless import persistent_instance
    from pipeline_assets.defs.ops.sizing import calibrate
    from pipeline_assets.lib.ops.charts import time_breakdown_png
    from pipeline_assets.lib.ops.sizing import Target, predict

    if args.records <= 0 or args.cpu_workers <= 0 or args.gpus < 0 or args.batch_records <= 0:
        raise ValueError(
            "--records, --cpu-workers and --batch-records must be positive, --gpus at least 0"
        )
    measure_lookup, measure_decision = _silver_rates(settings)
    calibration = calibrate(
        persistent_instance(settings.dagster_home),
        settings.validation_fraction,
        settings.tokenizer_sample_chars,
        settings.eval_max_tokens,
        measure_lookup=measure_lookup
        if args.records > args.batch_records  # one batch looks nothing up
        else None,
        measure_decision=measure_decision,
    )
    model, parameters, flops = _trained_model(args, settings)
    per_gpu, assumed = args.gpu_tokens_per_second, None
    if args.gpus and per_gpu is None and not calibration.train_gpus:
        per_gpu, assumed = _assumed_gpu_speed(args, flops, model)
    target = Target(
        records=args.records,
        cpu_cores=args.cpu_workers,
        gpus=args.gpus,
        avg_chars=args.avg_chars,
        batch_records=args.batch_records,
        epochs=args.epochs,
        train_tokens=args.train_tokens,
        models_scored=1 if args.first_model else 2,
        gpu_tokens_per_second=per_gpu,
        parameters=parameters,
        ray_min_rows=0
        if os.environ.get("RAY_ADDRESS") or settings.kuberay_config
        else settings.ray_min_rows,
    )
    table, totals = predict(calibration, target, settings.prices())
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    picture = time_breakdown_png(
        table["stage"].to_list(),
        table["wall_seconds"].to_list(),
        table["cost_usd"].to_list(),
        args.picture or Path(settings.home) / "reports" / f"sizer-{stamp}.png",
        f"{args.records:,} records, {args.cpu_workers} cores, {args.gpus} GPUs: "
        f"{_duration(totals['wall_seconds'])}, bottleneck {totals['bottleneck']}",
    )
    apart = {
        "silver/workers": calibration.silver_blocks,  # prepare and write tasks
        "silver/index lookup": calibration.silver_lookup,
        "silver/decision": calibration.silver_decision,
    }
    fits = {**calibration.fits, **{stage: fit for stage, fit in apart.items() if fit is not None}}
    totals.update(
        model=model,
        parameters=parameters,
        picture=str(picture),
        gpu_speed_assumed=assumed,
        fits={stage: vars(fit) for stage, fit in fits.items()},
    )
    if args.json:
        print(json.dumps({"stages": table.to_dicts(), "totals": totals}, indent=2))
        return 0
    _print_sizing(table, totals)
    return 0


def _silver_rates(settings: Settings):
    """Silver's lookup and decision, each measured on synthetic data once for this code and machine
    and kept under ``reports/`` (``lookup_rate``, ``decision_rate``): a calibration's batches are
    too small to show their rates. The two measures ``calibrate`` calls."""
    from pipeline_assets.defs.policies import SilverPolicy
    from pipeline_assets.defs.silver.decision_rate import decision_rate
    from pipeline_assets.defs.silver.lookup_rate import lookup_rate
    from pipeline_assets.resources.settings import policy_from

    config = policy_from(SilverPolicy, settings).silver_config()
    reports = Path(settings.home) / "reports"

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    def lookup():
        rate = lookup_rate(reports / "lookup-rate.json", config.minhash, log)
        return rate.points, rate.bands

    def decision(removals):
        return decision_rate(reports / "decision-rate.json", config, removals, log).points

    return lookup, decision


def _trained_model(args, settings: Settings) -> tuple[str, int, float]:
    """What the sizer trains: its name, parameters and training FLOPs per token. The base model
    (``PIPELINE_BASE_MODEL``, counted from its safetensors headers) unless ``--preset`` names a
    preset; else the training preset (built on the meta device: no memory, no time)."""
    import dataclasses
    import json as json_module

    import torch

    from pipeline_assets.lib.ops.sizing import transformer_flops_per_token
    from pipeline_assets.trainer.config import PRESETS
    from pipeline_assets.trainer.model import Transformer, count_parameters, flops_per_token

    if settings.base_model and not args.preset:
        from pipeline_assets.defs.resources import build_resources

        model = build_resources(settings)["base_model"].inspect()
        shape = json_module.loads((Path(model.path) / "config.json").read_text())
        flops = transformer_flops_per_token(
            model.parameters, shape["num_hidden_layers"], shape["hidden_size"], settings.seq_len
        )
        return f"base model {settings.base_model} ({model.architecture})", model.parameters, flops
    preset = args.preset or settings.train_preset
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    config = dataclasses.replace(
        PRESETS[preset], vocab_size=settings.vocab_size, max_seq_len=settings.seq_len
    )
    with torch.device("meta"):
        parameters = count_parameters(Transformer(config))
    return f"preset {preset}", parameters, flops_per_token(config, settings.seq_len)


def _assumed_gpu_speed(args, flops: float, model: str) -> tuple[float, str]:
    from pipeline_assets.lib.ops.sizing import gpu_tokens_per_second

    speed = gpu_tokens_per_second(flops, args.gpu_peak_tflops * 1e12, args.mfu)
    return speed, (
        f"not measured (the calibration trained on CPU): {model} at {args.mfu:.0%} MFU of "
        f"{args.gpu_peak_tflops:g} TFLOPS = {speed:,.0f} tokens/s per GPU"
    )


def _print_sizing(table, totals: dict) -> None:
    print(
        f"{totals['records']:,} records ({totals['characters']:,.0f} characters, "
        f"{totals['batches']} batch(es)) -> {totals['dataset_tokens']:,.0f} dataset tokens, "
        f"{totals['train_tokens']:,.0f} trained, on {totals['cpu_cores']} cores and "
        f"{totals['gpus']} GPUs"
    )
    print(f"{'stage':<16}{'work':>18}  {'runs on':<16}{'wall':>10}{'share':>8}{'cost $':>12}")
    for row in table.iter_rows(named=True):
        print(
            f"{row['stage']:<16}{_count(row['work']):>7} {row['unit']:<10}  {row['runs_on']:<16}"
            f"{_duration(row['wall_seconds']):>10}{row['share_of_wall']:>8.1%}{row['cost_usd']:>12,.2f}"
        )
    print(
        f"wall-clock {_duration(totals['wall_seconds'])}, cost ${totals['cost_usd']:,.2f} "
        f"(${totals['usd_per_million_tokens']:.4f} per million dataset tokens); bottleneck: "
        f"{totals['bottleneck']}"
    )
    if totals["gpu_speed_assumed"]:
        print(f"GPU speed {totals['gpu_speed_assumed']}")
    print(f"picture: {totals['picture']}")


def _count(value: float) -> str:
    for suffix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"


def _lineage(args, settings: Settings) -> int:
    from dagster import DagsterInstance

    from pipeline_assets.cli.lineage import model_lineage
    from pipeline_assets.defs.resources import build_resources

    resources = build_resources(settings)
    # read only: without an instance yet, the lineage has no record of silver's quality models
    home = Path(settings.dagster_home)
    instance = DagsterInstance.from_config(str(home)) if (home / "dagster.yaml").is_file() else None
    lineage = model_lineage(args.model, resources["mlflow_tracking"], resources["lake"], instance)
    print(json.dumps(lineage, indent=2))
    return 0


def _export(args, settings: Settings) -> int:
    import shutil
    import tempfile

    from pipeline_assets.cli.lineage import resolve_version
    from pipeline_assets.defs.resources import build_resources

    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"--out {args.out} is not empty: export writes a new folder")
    mlflow_tracking = build_resources(settings)["mlflow_tracking"]
    version = resolve_version(mlflow_tracking, args.model)
    with tempfile.TemporaryDirectory() as staging:
        folder = mlflow_tracking.download_model(version.name, str(version.version), Path(staging))
        missing = [name for name in SERVABLE_FILES if not (folder / name).is_file()]
        if not any((folder / name).is_file() for name in WEIGHT_FILES):
            missing.append(" or ".join(WEIGHT_FILES))
        if missing:
            raise ValueError(
                f"{version.name}/{version.version} holds no {', '.join(missing)}: it was "
                "registered before versions held a Hugging Face folder; train it again"
            )
        shutil.copytree(folder, args.out, dirs_exist_ok=True)
    exported = {
        "model": version.name,
        "version": str(version.version),
        "out": str(args.out),
        "files": sorted(p.name for p in args.out.iterdir()),
    }
    if args.generate:
        from pipeline_assets.trainer.export import generate_answer

        exported["prompt"] = args.generate
        exported["generation"] = generate_answer(args.out, args.generate)
    print(json.dumps(exported))
    return 0


def _promote(args, settings: Settings) -> int:
    from pipeline_assets.cli.lineage import parse_model_spec
    from pipeline_assets.defs.resources import build_resources

    name, alias, number = parse_model_spec(args.model)
    if alias:
        raise ValueError(f"{args.model!r}: promote takes MODEL/VERSION, e.g. {name}/3")
    resources = build_resources(settings)
    mlflow_tracking = resources["mlflow_tracking"]
    with resources["lake"].lock(
        "registry", name
    ):  # the gate's lock: no move between its read and its write
        version = mlflow_tracking.existing_version(name, number)
        mlflow_tracking.move_champion(
            name, str(version.version), by="pipeline-assets promote", reason=args.reason
        )
    print(json.dumps({"model": name, "champion": str(version.version), "reason": args.reason}))
    return 0


def _rollback(args, settings: Settings) -> int:
    from pipeline_assets.defs.resources import build_resources

    resources = build_resources(settings)
    mlflow_tracking = resources["mlflow_tracking"]
    mlflow_tracking.require_model(args.model_name)
    with resources["lake"].lock("registry", args.model_name):
        previous = mlflow_tracking.rollback_target(args.model_name)
        if previous is None:
            raise ValueError(
                f"{args.model_name} has no earlier champion to roll back to (see its "
                "champion_history tag)"
            )
        mlflow_tracking.move_champion(
            args.model_name,
            previous,
            by="pipeline-assets rollback",
            reason=args.reason,
            kind="rollback",
        )
    print(json.dumps({"model": args.model_name, "champion": previous, "reason": args.reason}))
    return 0


def _latest_pipeline_report(lake) -> dict | None:
    """The newest ops/pipeline_report: the bottleneck, and per stage its wall time, throughput and
    cost."""
    import polars as pl

    from pipeline_assets.lib.ops.cost import bottleneck

    history = lake.read("ops", "pipeline_report")
    if history is None:
        return None
    latest = history.filter(pl.col("report_id") == history["report_id"].max())
    return {
        "bottleneck": bottleneck(latest),
        "usd_per_million_tokens": round(float(latest["usd_per_million_tokens"].sum()), 6),
        "stages": {
            row["stage"]: {
                "wall_seconds": round(row["wall_seconds"], 2),
                "throughput": round(row["throughput"], 1),
                "unit": row["unit"],
                "cost_usd": round(row["cost_usd"], 6),
            }
            for row in latest.iter_rows(named=True)
        },
    }


def _champion_summary(settings: Settings) -> dict | None:
    """The champion's version, metrics and where it came from; None before the first
    registration."""
    from pipeline_assets.defs.resources import build_resources

    mlflow_tracking = build_resources(settings)["mlflow_tracking"]
    champion = mlflow_tracking.version_by_alias(settings.model_name, "champion")
    if champion is None:
        return None
    return {
        "name": settings.model_name,
        "champion_version": str(champion.version),
        "partition": champion.tags.get("partition"),
        "losses": {
            k.removeprefix("loss."): float(v)
            for k, v in sorted(champion.tags.items())
            if k.startswith("loss.")
        },
        "mlflow_run": mlflow_tracking.run_url(champion.run_id),
    }


def _dpo_summary(settings: Settings) -> dict | None:
    """The newest DPO run: its preference snapshot, where it started and how its held-out pairs were
    judged."""
    from pipeline_assets.cli.headless import persistent_instance
    from pipeline_assets.defs.keys import TRAINING_DPO_CHECKPOINT

    event = persistent_instance(settings.dagster_home).get_latest_materialization_event(
        TRAINING_DPO_CHECKPOINT
    )
    if event is None:
        return None
    metadata = {name: value.value for name, value in event.asset_materialization.metadata.items()}
    return {
        "partition": event.asset_materialization.partition,
        "reference_model": metadata.get("reference_model"),
        **{
            name: metadata.get(name)
            for name in (
                "first_loss",
                "final_loss",
                "best_validation_loss",
                "eval/preference_accuracy",
                "eval/reward_margin",
            )
        },
        "mlflow_run": metadata.get("mlflow_run"),
        "champion": _dpo_champion(settings),
    }


def _dpo_champion(settings: Settings) -> dict | None:
    from pipeline_assets.defs.resources import build_resources

    champion = build_resources(settings)["mlflow_tracking"].version_by_alias(
        settings.dpo_model_name, "champion"
    )
    if champion is None:
        return None
    return {
        "name": settings.dpo_model_name,
        "version": str(champion.version),
        "partition": champion.tags.get("partition"),
        "preference_accuracy": champion.tags.get("preference_accuracy.overall"),
    }


def _local(uri: str, setting: str) -> Path:
    if uri.startswith("s3://"):
        raise ValueError(f"{setting} is {uri}: pass a local --out, then upload the files")
    return Path(uri)


if __name__ == "__main__":
    sys.exit(main())
