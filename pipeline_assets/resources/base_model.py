"""The user's pretrained Hugging Face model (reference/base_model): a local folder or an S3 prefix.

An S3 model is copied once into a local cache (what the tokenizer, gold and torchrun read); a file
is fetched again only when its size or ETag changed. ``listing`` is cheap (names, sizes, modified
times or ETags): a sensor compares it every minute; the data version, the sha256 of every file,
is computed only when the listing changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.base_model import BaseModel, inspect_base_model
from pipeline_assets.resources import model_files
from pipeline_assets.resources.settings import setting_field

SETTING = "PIPELINE_BASE_MODEL"
_VERSIONS = "versions.json"  # listing fingerprint -> the sha256 of the files it describes


class BaseModelResource(ConfigurableResource):
    """``PIPELINE_BASE_MODEL``: the model to post-train; empty, the built-in preset from
    scratch."""

    uri: str = setting_field("base_model")
    cache_dir: str = Field(
        default="", description="where an s3:// model is copied (PIPELINE_HOME/cache/base_model)"
    )
    s3: S3Resource = Field(default_factory=S3Resource)

    @property
    def configured(self) -> bool:
        return bool(self.uri.strip())

    def listing(self) -> dict[str, list]:
        """File name -> [size, ETag or modified time]: what changes when any file changes."""
        return model_files.listing(self.uri, self.s3.get_client)

    def listing_fingerprint(self) -> str:
        return model_files.fingerprint(self.listing())

    def local_folder(self) -> Path:
        """The model as a local folder: the folder itself, or the S3 prefix's cached copy."""
        if not uris.is_s3(self.uri):
            return Path(self.uri)
        return model_files.fetched(self.uri, self.s3.get_client(), self.cache_dir)

    def inspect(self) -> BaseModel:
        """What the model is, or ``BaseModelError`` naming the problem. Its sha256 is read from
        the cache while the listing is the one it was computed for: every asset that asks (gold,
        training, the search, evaluation, the reference pass, DPO) would otherwise read every
        weight again."""
        folder, listing = self.local_folder(), self.listing_fingerprint()
        versions_file = Path(self.cache_dir) / _VERSIONS if self.cache_dir else None
        known = _read_json(versions_file)
        model = inspect_base_model(folder, version=known.get(listing))
        if versions_file is not None and known.get(listing) != model.version:
            versions_file.parent.mkdir(parents=True, exist_ok=True)
            versions_file.write_text(json.dumps({listing: model.version}))
        return model


def _read_json(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}
