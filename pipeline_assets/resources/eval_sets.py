"""Benchmark items the data must not contain (reference/eval_sets)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import polars as pl
from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.silver.decontam import read_eval_sets


class EvalSetsResource(ConfigurableResource):
    """Benchmark items (JSONL files) the data must not contain: a local folder or an S3 prefix."""

    uri: str = Field(description="folder or s3://bucket/prefix holding <eval_set>.jsonl files")
    s3: S3Resource = Field(default_factory=S3Resource)

    def files(self) -> dict[str, bytes]:
        """File name -> bytes, for every *.jsonl under the uri (empty when there is none)."""
        if uris.is_s3(self.uri):
            bucket, prefix = uris.split_s3(self.uri)
            client = self.s3.get_client()
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix.rstrip("/") + "/"
            )
            keys = [
                o["Key"]
                for page in pages
                for o in page.get("Contents", [])
                if o["Key"].endswith(".jsonl")
            ]
            return {
                k.rsplit("/", 1)[-1]: client.get_object(Bucket=bucket, Key=k)["Body"].read()
                for k in sorted(keys)
            }
        root = Path(self.uri)
        return (
            {p.name: p.read_bytes() for p in sorted(root.glob("*.jsonl"))} if root.is_dir() else {}
        )

    def items(self, files: dict[str, bytes]) -> pl.DataFrame:
        """Every eval item (eval_set, item_id, prompt, response)."""
        with tempfile.TemporaryDirectory() as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            return read_eval_sets(Path(folder))

    def fingerprint(self, files: dict[str, bytes]) -> str:
        """The eval sets' data version: sha256 over each file's name and the sha256 of its bytes."""
        digest = hashlib.sha256()
        for name, data in sorted(files.items()):
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return digest.hexdigest()
