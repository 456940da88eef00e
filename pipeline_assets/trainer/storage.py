"""Checkpoint folders on a local path or ``s3://``, published by writing a manifest last.

``<root>/<partition>/step-<N>/`` holds the files of ``torch.distributed.checkpoint`` and, once
every file is in place, ``COMPLETE.json`` (each file's size and SHA-256). A folder without it is a
partial write and is never loaded; a file whose checksum disagrees marks the checkpoint corrupt.
On S3, files are written to a local scratch folder and uploaded; the manifest goes up last.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from pipeline_assets.lib import uris

MANIFEST = "COMPLETE.json"
BEST = "best.json"
OWNER = "owner.json"  # which materialization (Dagster root run) the checkpoints belong to
_STEP_DIR = re.compile(r"^step-(\d+)$")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_files(folder: Path, names: list[str]) -> dict[str, dict]:
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
        for name in names
    }


def local_scratch(configured: str = "") -> str:
    """Local working space (staged checkpoints for S3, fetched exports, pictures): the configured
    folder, else one under the system's temp folder shared by the trainer and the assets."""
    return configured or str(Path(tempfile.gettempdir()) / "pipeline-assets")


class CheckpointStore:
    """The checkpoints of one partition: ``<root_uri>/<partition>``."""

    def __init__(self, root_uri: str, partition: str, scratch_dir: str = ""):
        self.uri = uris.join(root_uri, partition)
        self.is_s3 = uris.is_s3(root_uri)
        self.scratch = Path(local_scratch(scratch_dir)) / partition
        self._client = None

    # --- names ----------------------------------------------------------------------------------
    def folder_uri(self, name: str) -> str:
        return uris.join(self.uri, name)

    def local_folder(self, name: str) -> Path:
        """Where the files of folder ``name`` are written (and, on S3, staged before upload)."""
        return self.staging_folder(name) if self.is_s3 else Path(self.uri) / name

    def staging_folder(self, name: str) -> Path:
        """S3 only: the local folder where ``name`` is staged before upload."""
        return self.scratch / "staging" / name

    # --- writing --------------------------------------------------------------------------------
    def prepare(self, name: str) -> Path:
        """An empty local folder for ``name`` (a partial write left by a crash is cleared)."""
        folder = self.local_folder(name)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def upload(self, name: str, files: list[str]) -> None:
        """S3 only: copy staged files up (a no-op for local folders, written in place)."""
        if not self.is_s3:
            return
        bucket, key = uris.split_s3(self.folder_uri(name))
        for file in files:
            self.client.upload_file(str(self.local_folder(name) / file), bucket, f"{key}/{file}")

    def publish(self, name: str, manifest: dict) -> None:
        """Write the manifest last: from now on the folder counts as complete."""
        self.write_json(f"{name}/{MANIFEST}", manifest)

    # --- reading --------------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps with a published checkpoint, newest first."""
        steps = []
        for name in self._folders():
            match = _STEP_DIR.match(name)
            if match and self.exists(f"{name}/{MANIFEST}"):
                steps.append(int(match.group(1)))
        return sorted(steps, reverse=True)

    def partial_folders(self) -> list[str]:
        return [
            name
            for name in self._folders()
            if _STEP_DIR.match(name) and not self.exists(f"{name}/{MANIFEST}")
        ]

    def fetch_verified(self, name: str, reader: str = "main") -> tuple[Path | None, str]:
        """A local folder holding ``name`` with every file matching the manifest, or (None, why
        not). On S3 each ``reader`` (a rank) downloads into a folder of its own: ranks on one node
        must not clear each other's downloads."""
        manifest = self.read_json(f"{name}/{MANIFEST}")
        if manifest is None:
            return None, "no manifest"
        folder = Path(self.uri) / name
        if self.is_s3:
            folder = self.scratch / "fetched" / reader / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            bucket, key = uris.split_s3(self.folder_uri(name))
            for file in manifest["files"]:
                try:
                    self.client.download_file(bucket, f"{key}/{file}", str(folder / file))
                except Exception as exc:  # botocore raises several types for a missing object
                    return None, f"{file}: cannot download ({exc})"
        for file, expected in manifest["files"].items():
            path = folder / file
            if not path.exists():
                return None, f"{file} is missing"
            if path.stat().st_size != expected["bytes"] or sha256_file(path) != expected["sha256"]:
                return (
                    None,
                    f"{file} does not match its checksum in {MANIFEST}: refused, nothing of it is "
                    "loaded",
                )
        return folder, ""

    def clear(self) -> None:
        """Remove every checkpoint, export and marker of this partition."""
        for name in self._folders():
            self.delete(name)
        for relative in (BEST, OWNER):
            if self.exists(relative):
                self._delete_file(relative)

    def _delete_file(self, relative: str) -> None:
        if self.is_s3:
            bucket, key = uris.split_s3(uris.join(self.uri, relative))
            self.client.delete_object(Bucket=bucket, Key=key)
        else:
            (Path(self.uri) / relative).unlink(missing_ok=True)

    def delete(self, name: str) -> None:
        """Delete folder ``name`` (the whole partition when empty), its manifest first: a folder
        being deleted stops counting as complete before any of its files goes."""
        if name:
            self._delete_file(f"{name}/{MANIFEST}")
        if not self.is_s3:
            shutil.rmtree(Path(self.uri) / name, ignore_errors=True)
            return
        bucket, key = uris.split_s3(self.folder_uri(name))
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{key}/"
        ):
            for item in page.get("Contents", []):
                self.client.delete_object(Bucket=bucket, Key=item["Key"])

    def usage(self, name: str = "") -> tuple[int, int, float]:
        """Files, bytes and the newest modification (epoch seconds) under folder ``name`` (the whole
        partition when empty); (0, 0, 0.0) when there is nothing."""
        objects = list(self._objects(name))
        return (
            len(objects),
            sum(size for size, _ in objects),
            max((mtime for _, mtime in objects), default=0.0),
        )

    def remove(self, name: str = "") -> tuple[int, int]:
        """Delete folder ``name`` (the whole partition when empty); the files and bytes it held."""
        files, size, _ = self.usage(name)
        self.delete(name)
        return files, size

    def _objects(self, name: str):
        """(bytes, modified epoch seconds) of every file under folder ``name``."""
        if not self.is_s3:
            root = Path(self.uri) / name if name else Path(self.uri)
            for path in root.rglob("*") if root.is_dir() else []:
                if path.is_file():
                    stat = path.stat()
                    yield stat.st_size, stat.st_mtime
            return
        bucket, key = uris.split_s3(uris.join(self.uri, name))
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{key}/"
        ):
            for item in page.get("Contents", []):
                yield item["Size"], item["LastModified"].timestamp()

    def folders(self) -> list[str]:
        """Names of the folders directly under this store (``step-N``, ``final``, ``search``)."""
        return self._folders()

    # --- small JSON files -----------------------------------------------------------------------
    def write_json(self, relative: str, value: dict) -> None:
        data = json.dumps(value, indent=2, sort_keys=True).encode()
        if self.is_s3:
            bucket, key = uris.split_s3(uris.join(self.uri, relative))
            self.client.put_object(Bucket=bucket, Key=key, Body=data)
            return
        path = Path(self.uri) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)  # atomic: a reader sees the old file or the new one

    def read_json(self, relative: str) -> dict | None:
        if not self.exists(relative):
            return None
        if self.is_s3:
            bucket, key = uris.split_s3(uris.join(self.uri, relative))
            return json.loads(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        return json.loads((Path(self.uri) / relative).read_text())

    def exists(self, relative: str) -> bool:
        if not self.is_s3:
            return (Path(self.uri) / relative).exists()
        bucket, key = uris.split_s3(uris.join(self.uri, relative))
        return (
            self.client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("KeyCount", 0) > 0
        )

    # --- internals ------------------------------------------------------------------------------
    def _folders(self) -> list[str]:
        if not self.is_s3:
            root = Path(self.uri)
            return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []
        bucket, key = uris.split_s3(self.uri)
        names = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{key}/", Delimiter="/"
        ):
            names.update(
                prefix["Prefix"][len(key) + 1 :].rstrip("/")
                for prefix in page.get("CommonPrefixes", [])
            )
        return sorted(names)

    @property
    def client(self):
        if self._client is None:
            import boto3  # only S3 stores need it

            self._client = boto3.client(
                "s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None
            )
        return self._client
