"""The models silver scores records with: the language-ID model every record is labelled by, and
the user's scorers (``PIPELINE_QUALITY_MODELS``), each a Hugging Face sequence-classification
folder or a fastText file.

Their identity (each model's URI and the sha256 of its files, with the scorer's settings) is what
silver records in its metadata and lineage: a changed scorer is a new fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, replace
from pathlib import Path

from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.base_model import folder_sha256
from pipeline_assets.lib.silver.language import MODEL_FILE, MODEL_PACKAGE, language_model_path
from pipeline_assets.lib.silver.scorers import ScorerSpec, check_scorer, parse_scorers
from pipeline_assets.resources import model_files
from pipeline_assets.resources.settings import setting_field

SETTING = "PIPELINE_QUALITY_MODELS"
LANGUAGE_MODEL = f"{MODEL_PACKAGE}/{MODEL_FILE}"


class QualityModelsResource(ConfigurableResource):
    """``PIPELINE_QUALITY_MODELS``: the user's scorers, as a JSON list."""

    models: str = setting_field("quality_models")
    cache_dir: str = Field(
        default="",
        description="where s3:// scorers are copied and their sha256 kept "
        "(PIPELINE_HOME/cache/quality_models)",
    )
    s3: S3Resource = Field(default_factory=S3Resource)

    def specs(self) -> list[ScorerSpec]:
        return parse_scorers(self.models, SETTING)

    def local_specs(self) -> list[ScorerSpec]:
        """The scorers with their models as local paths, what the stages load (an s3:// model
        is copied into the cache once, and again only where a file changed)."""
        return [replace(spec, model=str(self._local(spec.model))) for spec in self.specs()]

    def checked_specs(self) -> list[ScorerSpec]:
        """``local_specs``, each refused (``ScorerError``) if it cannot run; the settings reader
        checks local models, and s3:// ones only here, once copied."""
        specs = self.local_specs()
        for spec in specs:
            check_scorer(spec)
        return specs

    def listing(self) -> dict:
        """The setting and every scorer's file names, sizes and times or ETags: cheap, and
        changed whenever a scorer or one of its files is."""
        client_of = self.s3.get_client
        return {
            "setting": [asdict(spec) for spec in self.specs()],
            "files": {
                spec.model: model_files.listing(spec.model, client_of) for spec in self.specs()
            },
        }

    def listing_fingerprint(self) -> str:
        return model_files.fingerprint(self.listing())

    def identities(self) -> list[dict]:
        """The language-ID model's and every scorer's URI (as the setting names it), settings and
        files' sha256."""
        language = {
            "name": "language",
            "model": LANGUAGE_MODEL,
            "sha256": self._sha256(str(language_model_path())),
        }
        return [language, *({**asdict(s), "sha256": self._sha256(s.model)} for s in self.specs())]

    def fingerprint(self) -> str:
        return models_fingerprint(self.identities())

    def _sha256(self, model: str) -> str:
        """The model's files' sha256, computed again only when their listing changed."""
        files = model_files.listing(model, self.s3.get_client)
        key = model_files.fingerprint({"model": model, "files": files})
        return model_files.cached_sha256(self.cache_dir, key, lambda: _sha256(self._local(model)))

    def _local(self, model: str) -> Path:
        if not uris.is_s3(model):
            return Path(model)
        return model_files.fetched(model, self.s3.get_client(), self.cache_dir)


def models_fingerprint(identities: list[dict]) -> str:
    """reference/quality_models' data version: what silver records it scored with."""
    return model_files.fingerprint(identities)


def _sha256(path: Path) -> str:
    if path.is_dir():
        return folder_sha256(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
