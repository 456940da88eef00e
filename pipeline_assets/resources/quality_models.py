"""The models silver scores records with: the language-ID model every record is labelled by, and
the user's scorers (``PIPELINE_QUALITY_MODELS``), each a Hugging Face sequence-classification
folder or a fastText file.

Their identity (each model's URI and the sha256 of its files, with the scorer's settings) is what
silver records in its metadata and lineage: a changed scorer is a new fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from dagster import ConfigurableResource

from pipeline_assets.lib import uris
from pipeline_assets.lib.gold.base_model import folder_sha256
from pipeline_assets.lib.silver.language import MODEL_FILE, MODEL_PACKAGE, language_model_path
from pipeline_assets.lib.silver.scorers import ScorerSpec, parse_scorers
from pipeline_assets.resources.settings import setting_field

SETTING = "PIPELINE_QUALITY_MODELS"


class QualityModelsResource(ConfigurableResource):
    """``PIPELINE_QUALITY_MODELS``: the user's scorers, as a JSON list."""

    models: str = setting_field("quality_models")

    def specs(self) -> list[ScorerSpec]:
        return parse_scorers(self.models, SETTING)

    def local_specs(self) -> list[ScorerSpec]:
        """The scorers with their models as local paths, what the stages load."""
        specs = self.specs()
        remote = [spec.name for spec in specs if uris.is_s3(spec.model)]
        if remote:
            raise ValueError(f"{SETTING}: scorer(s) {remote} on s3:// are not fetched yet")
        return specs

    def identities(self) -> list[dict]:
        """The language-ID model's and every scorer's URI, settings and files' sha256."""
        language = {
            "name": "language",
            "model": f"{MODEL_PACKAGE}/{MODEL_FILE}",
            "sha256": _sha256(language_model_path()),
        }
        return [language, *({**asdict(s), "sha256": _sha256(Path(s.model))} for s in self.specs())]

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.identities(), sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    if path.is_dir():
        return folder_sha256(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
