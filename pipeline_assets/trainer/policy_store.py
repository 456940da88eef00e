"""Policy versions of an RL run in the checkpoint store:
``<checkpoint_uri>/<partition>/policy-v<N>``.

The learner publishes version N+1 after each update (the exported weights, and its optimizer state
so a stopped run resumes); rollout workers load the newest complete version before each batch of
rollouts. A folder counts once its manifest is written (``CheckpointStore.publish``), and every file
is checked against it when fetched, so a worker never loads a half-written version.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_assets.trainer.storage import MANIFEST, CheckpointStore, describe_files

# torch is imported where a version is saved or loaded: defs/rl imports this module, and so every
# process that loads the code location would import torch (1.4 to 2 s) for nothing.
if TYPE_CHECKING:
    import torch

    from pipeline_assets.trainer.language_model import LanguageModel

OPTIMIZER_STATE = "optimizer.pt"
DONE = "rl_done.json"  # written by the learner when the run is over: the workers stop
METRICS_FILE = "rl_metrics.jsonl"  # the learner's metrics, a line an update
_VERSION_DIR = re.compile(r"^policy-v(\d+)$")


class VersionPruned(RuntimeError):
    """The version asked for is no longer published: the learner pruned it."""


def version_folder(version: int) -> str:
    return f"policy-v{version}"


class PolicyStore:
    def __init__(self, checkpoint_uri: str, partition: str, scratch_dir: str = ""):
        self.store = CheckpointStore(checkpoint_uri, partition, scratch_dir)

    def versions(self) -> list[int]:
        """Published versions, newest first."""
        found = (_VERSION_DIR.match(name) for name in self.store.folders())
        published = [
            int(match.group(1))
            for match in found
            if match and self.store.exists(f"{match.group(0)}/{MANIFEST}")
        ]
        return sorted(published, reverse=True)

    def newest(self) -> int | None:
        versions = self.versions()
        return versions[0] if versions else None

    def publish(
        self,
        version: int,
        model: LanguageModel,
        optimizer: torch.optim.Optimizer | None,
        about: dict,
    ) -> None:
        """Version ``version`` of the policy, as its backend exports it (``LanguageModel.save``:
        the built-in model as LlamaForCausalLM, a Hugging Face model as its own family), so that
        ``load`` (``export.load_exported``) builds the same backend again."""
        import torch

        name = version_folder(version)
        folder = self.store.prepare(name)
        files = model.save(folder, {"policy_version": version, **about})
        if optimizer is not None:
            torch.save(optimizer.state_dict(), folder / OPTIMIZER_STATE)
            files.append(OPTIMIZER_STATE)
        self.store.upload(name, files)
        self.store.publish(
            name, {"files": describe_files(folder, files), "policy_version": version, **about}
        )

    def load(self, version: int, reader: str) -> tuple[LanguageModel, dict, Path]:
        """The model of ``version`` (its files verified), its config, and the local folder holding
        it. Raises ``VersionPruned`` when the learner deleted the version before or while it was
        read."""
        from pipeline_assets.trainer.export import load_exported

        try:
            folder, problem = self.store.fetch_verified(version_folder(version), reader=reader)
            if folder is None:
                raise RuntimeError(f"policy version {version} cannot be loaded: {problem}")
            model, config = load_exported(folder)
        except Exception as error:  # whatever a half-deleted folder raises, the prune is why
            if version not in self.versions():
                raise VersionPruned(f"policy version {version} was pruned") from error
            raise
        return model, config, folder

    def optimizer_state(self, folder: Path) -> dict | None:
        import torch

        path = folder / OPTIMIZER_STATE
        return (
            torch.load(path, weights_only=True) if path.exists() else None
        )  # our own file, still never pickled code

    def prune(self, newest: int, max_staleness: int) -> None:
        """Delete the versions a worker within the staleness limit no longer uses: older than
        ``newest - max_staleness``, less two for a worker that read the newest version just before
        the last publishes."""
        for version in self.versions():
            if version < newest - max_staleness - 2:
                self.store.delete(version_folder(version))

    def mark_done(self, summary: dict) -> None:
        self.store.write_json(DONE, {"finished_at": time.time(), **summary})

    def done(self) -> bool:
        return self.store.exists(DONE)

    def clear_done(self) -> None:
        """A new run's start: the workers must not read the last run's end."""
        if not self.store.is_s3:
            (Path(self.store.uri) / DONE).unlink(missing_ok=True)
            return
        from pipeline_assets.lib import uris

        bucket, key = uris.split_s3(uris.join(self.store.uri, DONE))
        self.store.client.delete_object(Bucket=bucket, Key=key)
