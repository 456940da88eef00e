"""The landing zone: where raw files arrive, local or on S3."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import ClientError
from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.formats import PREFERENCE, SFT, RecordFormat, format_named
from pipeline_assets.lib.rl.replay import ROLLOUT_SOURCE


class LandingFileGone(FileNotFoundError):
    """A registered landing file no longer exists: retrying will not bring it back."""


@dataclass(frozen=True)
class LandingFile:
    """A file in the landing zone: ``<landing>/<source>/<name>``."""

    uri: str
    source: str
    size: int
    modified: str  # mtime in ns for local files, the ETag for S3 objects


class LandingResource(ConfigurableResource):
    """The landing zone: one folder (or S3 prefix) per source, files of the four landing formats.

    Names that start with ``_`` or ``.`` (markers, manifests, temporary uploads) are not data.
    """

    uri: str = Field(description="landing zone root: a local path or s3://bucket/prefix")
    field_mappings: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='per source, their field -> ours, e.g. {"logs": {"completion": "response"}}',
    )
    source_formats: dict[str, str] = Field(
        default_factory=dict,
        description='per source, its record format, e.g. {"prefs": "preference"}; sft unless named',
    )
    s3: S3Resource = Field(default_factory=S3Resource)

    def relative_name(self, uri: str) -> str:
        """``<source>/<file>``: how provenance columns and messages name a landing file."""
        root = self.uri.rstrip("/") + "/"
        return uri[len(root) :] if uri.startswith(root) else uri

    def mapping_for(self, source: str) -> dict[str, str]:
        return self.field_mappings.get(source, {})

    @property
    def formats_by_source(self) -> dict[str, str]:
        """Each named source's record format: the RL overlay's rollout pairs' source, then the
        setting's."""
        return {ROLLOUT_SOURCE: PREFERENCE.name, **self.source_formats}

    def format_for(self, source: str) -> RecordFormat:
        return format_named(self.formats_by_source.get(source, SFT.name))

    def list_files(self) -> list[LandingFile]:
        files = self._list_s3() if uris.is_s3(self.uri) else self._list_local()
        return sorted(files, key=lambda f: f.uri)

    def read_bytes(self, uri: str) -> bytes:
        """The file's bytes; ``LandingFileGone`` when it no longer exists. Any other error (I/O,
        timeout, a 5xx or a throttle from the store) is raised as it is: it may pass on a retry."""
        if not uris.is_s3(uri):
            try:
                return Path(uri).read_bytes()
            except FileNotFoundError as exc:
                raise LandingFileGone(uri) from exc
        bucket, key = uris.split_s3(uri)
        try:
            return self.s3.get_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise LandingFileGone(uri) from exc
            raise

    def _list_local(self) -> list[LandingFile]:
        root = Path(self.uri)
        if not root.is_dir():
            return []
        found = []
        for path in root.rglob("*"):
            relative = path.relative_to(root).parts
            if len(relative) < 2 or _is_hidden(relative) or not path.is_file():
                continue
            stat = path.stat()
            found.append(LandingFile(str(path), relative[0], stat.st_size, str(stat.st_mtime_ns)))
        return found

    def _list_s3(self) -> list[LandingFile]:
        bucket, prefix = uris.split_s3(self.uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        found = []
        pages = (
            self.s3.get_client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                relative = tuple(obj["Key"][len(prefix) :].split("/"))
                if len(relative) < 2 or _is_hidden(relative) or obj["Key"].endswith("/"):
                    continue
                uri = f"s3://{bucket}/{obj['Key']}"
                found.append(LandingFile(uri, relative[0], obj["Size"], obj["ETag"].strip('"')))
        return found


def _is_hidden(parts: tuple[str, ...]) -> bool:
    return any(part.startswith(("_", ".")) for part in parts)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
