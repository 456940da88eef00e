"""The whole graph on object storage: landing zone, lake, eval sets and checkpoints on s3:// (moto
on loopback), from landing files to a registered champion, with the same row counts in every data
layer as a local run of the same files (the split hashes content, not ingest-time record ids)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3

from pipeline_assets.sample_data.corpus import write_sample_corpus
from pipeline_assets_tests.conftest import BUCKET, cli_environment

RECORDS = 800  # enough for gold's packing check on one batch


DATA_LAYERS = "group:bronze or group:silver or group:gold or group:reference"


def _pipeline(home: Path, *run_args: str, **settings: str) -> dict:
    env = cli_environment(home, **settings)
    for command in (["run", *run_args], ["summary"]):
        done = subprocess.run(
            [sys.executable, "-m", "pipeline_assets.cli.main", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_whole_graph_runs_on_s3_from_landing_files_to_a_champion(tmp_path, s3_endpoint):
    corpus = tmp_path / "corpus"
    manifest = write_sample_corpus(
        corpus / "landing", records=RECORDS, eval_sets_dir=corpus / "eval_sets"
    )
    client = boto3.client("s3")
    for path in corpus.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), BUCKET, str(path.relative_to(corpus)))

    remote = _pipeline(
        tmp_path / "remote",
        PIPELINE_LANDING_URI=f"s3://{BUCKET}/landing",
        PIPELINE_EVAL_SETS_URI=f"s3://{BUCKET}/eval_sets",
        PIPELINE_LAKE_URI=f"s3://{BUCKET}/lake",
        PIPELINE_CHECKPOINT_URI=f"s3://{BUCKET}/checkpoints",
    )

    assert remote["lake"] == f"s3://{BUCKET}/lake"
    rows = {table: counts["rows"] for table, counts in remote["tables"].items() if counts}
    assert rows["bronze/records"] == manifest["expected"]["bronze_rows"]
    assert rows["bronze/quarantine"] == manifest["expected"]["quarantined"]
    assert rows["silver/records"] + rows["silver/rejects"] == rows["bronze/records"]
    assert rows["silver/minhash_index"] == rows["silver/records"]
    assert (
        rows["silver/minhash_bands"] == 17 * rows["silver/records"]
    )  # read by band from S3 by the later batches
    assert (
        rows["gold/sequences"] > 0
        and rows["evaluation/report"] > 0
        and rows["ops/pipeline_report"] == 6
    )
    assert remote["model"]["champion_version"] == "1" and remote["model"]["partition"] == "gold-v0"
    keys = {
        item["Key"]
        for item in client.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/gold-v0/final/")[
            "Contents"
        ]
    }
    assert {
        "checkpoints/gold-v0/final/model.safetensors",
        "checkpoints/gold-v0/final/COMPLETE.json",
    } <= keys
    assert not (tmp_path / "remote" / "lake").exists(), "nothing of the lake lands on local disk"

    local = _pipeline(
        tmp_path / "local",
        "--select",
        DATA_LAYERS,
        PIPELINE_LANDING_URI=str(corpus / "landing"),
        PIPELINE_EVAL_SETS_URI=str(corpus / "eval_sets"),
    )
    local_rows = {table: counts["rows"] for table, counts in local["tables"].items() if counts}
    for table in (
        "bronze/records",
        "bronze/quarantine",
        "silver/records",
        "silver/rejects",
        "silver/minhash_index",
        "silver/minhash_bands",
        "gold/tokenizer",
        "gold/sequences",
    ):
        assert rows[table] == local_rows[table], (
            f"{table}: {rows[table]} rows on S3, {local_rows[table]} locally"
        )
    assert (
        remote["data_snapshot"]["sequences_by_split"]
        == local["data_snapshot"]["sequences_by_split"]
    )
    assert remote["data_snapshot"]["real_tokens"] == local["data_snapshot"]["real_tokens"]
