"""A model's files, local or on S3: their cheap listing, a local copy of an S3 model, and the
sha256 of the files cached by listing (what ``reference/base_model`` and
``reference/quality_models`` share).

An S3 URI is a folder prefix, or one object (a fastText file) when an object has exactly its key.
Its copy lives under ``cache_dir``; a file is fetched again only when its size or ETag changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from pipeline_assets.lib import uris

_CACHE_LISTING = ".pipeline-listing.json"  # the S3 listing a cached copy was fetched at
_VERSIONS = "versions.json"  # listing fingerprint -> the sha256 of the files it describes


def listing(uri: str, client_of: Callable[[], object]) -> dict[str, list]:
    """File name -> [size, ETag or modified time]: what changes when any file changes (a file:
    one entry, its own name)."""
    if uris.is_s3(uri):
        return {name: [size, etag] for name, (size, etag) in s3_objects(uri, client_of()).items()}
    root = Path(uri)
    if root.is_file():
        return {root.name: [root.stat().st_size, root.stat().st_mtime_ns]}
    if not root.is_dir():
        return {}
    return {
        file.relative_to(root).as_posix(): [file.stat().st_size, file.stat().st_mtime_ns]
        for file in sorted(root.rglob("*"))
        if file.is_file()
    }


def fingerprint(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def s3_objects(uri: str, client) -> dict[str, tuple[int, str]]:
    """The objects of an S3 model: name under the prefix -> (size, ETag); one object, named by
    its file name, when the URI is an object's own key."""
    return _s3_objects(uri, client)[0]


def _s3_objects(uri: str, client) -> tuple[dict[str, tuple[int, str]], bool]:
    bucket, key = uris.split_s3(uri)
    key = key.rstrip("/")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
    items = [item for page in pages for item in page.get("Contents", [])]
    exact = [item for item in items if item["Key"] == key]
    if exact:
        return {key.rsplit("/", 1)[-1]: (exact[0]["Size"], exact[0]["ETag"].strip('"'))}, True
    prefix = key + "/"
    objects = {
        item["Key"][len(prefix) :]: (item["Size"], item["ETag"].strip('"'))
        for item in items
        if item["Key"].startswith(prefix) and not item["Key"].endswith("/")
    }
    return objects, False


def fetched(uri: str, client, cache_dir: str) -> Path:
    """The S3 model's local copy under ``cache_dir`` (its folder, or its file), fetching only the
    files whose size or ETag changed since the last fetch."""
    if not cache_dir:
        raise ValueError(f"{uri}: no cache folder to copy an s3:// model into")
    objects, is_object = _s3_objects(uri, client)
    folder = Path(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    listing_file = folder / _CACHE_LISTING
    cached = json.loads(listing_file.read_text()) if listing_file.is_file() else {}
    bucket, key = uris.split_s3(uri)
    key = key.rstrip("/")
    for name, (size, etag) in objects.items():
        target = folder / name
        if cached.get(name) == [size, etag] and target.is_file():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        client.download_file(bucket, key if is_object else f"{key}/{name}", str(partial))
        os.replace(partial, target)
    for stale in set(cached) - set(objects):
        (folder / stale).unlink(missing_ok=True)
    listing_file.write_text(json.dumps({k: list(v) for k, v in objects.items()}))
    return folder / next(iter(objects)) if is_object else folder


def cached_sha256(cache_dir: str, listing_fingerprint: str, compute: Callable[[], str]) -> str:
    """``compute()`` (a sha256 of files), read instead from ``cache_dir`` while the files' listing
    is the one it was computed for: a large model is not read again on every call."""
    versions_file = Path(cache_dir) / _VERSIONS if cache_dir else None
    known = {}
    if versions_file is not None and versions_file.is_file():
        known = json.loads(versions_file.read_text())
    if listing_fingerprint in known:
        return known[listing_fingerprint]
    value = compute()
    if versions_file is not None:
        versions_file.parent.mkdir(parents=True, exist_ok=True)
        versions_file.write_text(json.dumps({**known, listing_fingerprint: value}))
    return value
