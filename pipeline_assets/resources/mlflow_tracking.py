"""MLflow: experiment tracking and the model registry, with every URI password redacted."""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import ConfigurableResource, EnvVar
from pydantic import Field

from pipeline_assets.lib import uris
from pipeline_assets.lib.training.promotion import rollback_target
from pipeline_assets.trainer.report import OUTBOX_VARIABLE, replay


def _resolved(value: str) -> str:
    """A config value as the resource sees it: Dagster resolves an ``EnvVar`` when it runs the
    resource; a resource used outside a run (the CLI) reads the variable itself."""
    return (value.get_value() or "").strip() if isinstance(value, EnvVar) else value


CHAMPION_HISTORY_TAG = "champion_history"
_HISTORY_KEPT = 50


@contextmanager
def redacted_errors():
    """Re-raise an error with every URI password in its message redacted (MLflow's errors show the
    tracking URI as configured); the original, which holds it, is not chained."""
    try:
        yield
    except Exception as exc:
        if uris.redact(str(exc)) == str(exc):
            raise
        raise _redacted_copy(exc) from None


def _redacted_copy(exc: Exception) -> Exception:
    """The same error (type, MLflow's error code) with its message redacted, or a RuntimeError
    saying it."""
    redacted = copy.copy(exc)
    redacted.args = tuple(uris.redact(arg) if isinstance(arg, str) else arg for arg in exc.args)
    if isinstance(getattr(exc, "message", None), str):
        redacted.message = uris.redact(exc.message)
    if uris.redact(str(redacted)) != str(redacted):
        return RuntimeError(f"{type(exc).__name__}: {uris.redact(str(exc))}")
    return redacted.with_traceback(None)


class _RedactedClient:
    """An ``MlflowClient`` whose errors never show the tracking URI's password."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        found = getattr(self._client, name)
        if not callable(found):
            return found

        @functools.wraps(found)
        def call(*args, **kwargs):
            with redacted_errors():
                return found(*args, **kwargs)

        return call


class MlflowResource(ConfigurableResource):
    """Experiment tracking and the model registry (SQLite by default)."""

    tracking_uri: str = Field(
        description="MLFLOW_TRACKING_URI; given as an EnvVar, so a password in it is never shown"
    )
    artifact_root: str = Field(
        description="where run artifacts go: a local path or s3://bucket/prefix"
    )
    experiment: str = "pipeline_assets"
    ui_url: str = Field(
        default="http://127.0.0.1:5000", description="where `make dev` serves the MLflow UI"
    )

    def resolved_tracking_uri(self) -> str:
        """The URI to connect with (it may hold a password: pass it on, never show it)."""
        return _resolved(self.tracking_uri)

    def shown_tracking_uri(self) -> str:
        return uris.redact(self.resolved_tracking_uri())

    def client(self):
        from mlflow import MlflowClient

        return _RedactedClient(MlflowClient(tracking_uri=self.resolved_tracking_uri()))

    def experiment_id(self) -> str:
        client = self.client()
        found = client.get_experiment_by_name(self.experiment)
        if found:
            return found.experiment_id
        # An explicit location: MLflow's default is ./mlruns under whatever folder the process
        # runs in.
        return client.create_experiment(
            self.experiment, artifact_location=uris.join(self.artifact_root, self.experiment)
        )

    def open_run(self, name: str, tags: dict[str, str], reuse_key: dict[str, str]) -> str:
        """A run for one materialization: the unfinished run a retry of it left (same ``reuse_key``
        tags), else a new one. Returns the run id."""
        client, experiment_id = self.client(), self.experiment_id()
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in reuse_key.items())
        for run in client.search_runs([experiment_id], filter_string=query, max_results=5):
            if run.info.status != "FINISHED":
                client.set_tag(
                    run.info.run_id,
                    "pipeline.attempts",
                    int(run.data.tags.get("pipeline.attempts", "1")) + 1,
                )
                return run.info.run_id
        return client.create_run(
            experiment_id, run_name=name, tags={**tags, **reuse_key}
        ).info.run_id

    @contextmanager
    def relay(self, run_id: str, folder: str) -> Iterator[dict[str, str]]:
        """The environment of a trainer job whose rank 0 logs to ``run_id`` through this process:
        it writes its MLflow calls to an outbox file in ``folder`` (``trainer.report``) and a
        thread here logs each as it comes, the rest once the job ends. An MLflow error is raised
        here, after the job; a job that ended without saying how (killed) leaves its run KILLED,
        not RUNNING."""
        outbox = Path(folder) / f"mlflow-{run_id}.jsonl"
        outbox.parent.mkdir(parents=True, exist_ok=True)
        outbox.write_text("")
        client = self.client()
        client.update_run(run_id, status="RUNNING")  # a retried job's run, KILLED before
        stop, ended, failed = threading.Event(), threading.Event(), []
        relaying = threading.Thread(
            target=_relay, args=(outbox, client, run_id, stop, ended, failed), daemon=True
        )
        relaying.start()
        try:
            yield {OUTBOX_VARIABLE: str(outbox)}
        finally:
            stop.set()
            relaying.join()
            outbox.unlink(missing_ok=True)
            if not failed and not ended.is_set():
                client.set_terminated(run_id, status="KILLED")
        if failed:
            raise failed[0]

    def run_url(self, run_id: str) -> str:
        return uris.redact(
            f"{self.ui_url.rstrip('/')}/#/experiments/{self.experiment_id()}/runs/{run_id}"
        )

    # --- the model registry: aliases only (stages are deprecated) ---------------------------------
    def registered_version(
        self, model_name: str, run_id: str, artifact_path: str, tags: dict[str, str]
    ) -> str:
        """The version of ``model_name`` holding the run's model: the one registered before (a
        re-materialization registers nothing twice), else a new one. Returns its number."""
        client = self.client()
        if not client.search_registered_models(filter_string=f"name = '{model_name}'"):
            client.create_registered_model(
                model_name, description="Models trained by pipeline_assets"
            )
        for existing in client.search_model_versions(
            f"name = '{model_name}' and run_id = '{run_id}'"
        ):
            return str(existing.version)
        version = client.create_model_version(
            model_name,
            source=f"runs:/{run_id}/{artifact_path}",
            run_id=run_id,
            tags={k: str(v) for k, v in tags.items()},
        )
        return str(version.version)

    def all_registered_versions(self) -> list:
        """Every version of every registered model on this tracking server."""
        client, found, token = self.client(), [], None
        while True:
            page = client.search_model_versions(page_token=token)
            found += list(page)
            token = page.token
            if not token:
                return found

    def version_by_alias(self, model_name: str, alias: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client().get_model_version_by_alias(model_name, alias)
        except MlflowException:
            return None

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.client().set_registered_model_alias(model_name, alias, version)

    def champion_history(self, model_name: str) -> list[dict]:
        tags = self.client().get_registered_model(model_name).tags
        return json.loads(tags.get(CHAMPION_HISTORY_TAG, "[]"))

    def move_champion(
        self, model_name: str, version: str, *, by: str, reason: str, kind: str = "promote"
    ) -> None:
        """Point ``champion`` at ``version`` and record who moved it, why and how (``promote`` or
        ``rollback``), newest last."""
        client = self.client()
        previous = self.version_by_alias(model_name, "champion")
        client.set_registered_model_alias(model_name, "champion", version)
        entry = {
            "version": str(version),
            "previous": str(previous.version) if previous else None,
            "kind": kind,
            "by": by,
            "reason": reason,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        history = (self.champion_history(model_name) + [entry])[-_HISTORY_KEPT:]
        client.set_registered_model_tag(model_name, CHAMPION_HISTORY_TAG, json.dumps(history))
        client.set_model_version_tag(model_name, version, "champion_since", entry["at"])

    def rollback_target(self, model_name: str) -> str | None:
        """The champion before the current one in the recorded history, skipping those rollbacks
        left."""
        current = self.version_by_alias(model_name, "champion")
        return rollback_target(
            self.champion_history(model_name), current=str(current.version) if current else None
        )

    def existing_version(self, model_name: str, version: str):
        """The registered version, or ``ValueError`` naming what the registry holds."""
        from mlflow.exceptions import MlflowException

        client = self.client()
        try:
            return client.get_model_version(model_name, version)
        except MlflowException:
            pass
        held = sorted(
            int(v.version) for v in client.search_model_versions(f"name = '{model_name}'")
        )
        if not held:
            raise ValueError(
                f"no registered model {model_name!r} in the registry at {self.shown_tracking_uri()}"
            )
        raise ValueError(
            f"{model_name} has no version {version} (registered versions: "
            f"{', '.join(map(str, held))})"
        )

    def require_model(self, model_name: str) -> None:
        """``ValueError`` unless ``model_name`` is registered."""
        if not self.client().search_registered_models(filter_string=f"name = '{model_name}'"):
            raise ValueError(
                f"no registered model {model_name!r} in the registry at {self.shown_tracking_uri()}"
            )

    def download_model(self, model_name: str, version: str, destination: Path) -> Path:
        import mlflow.artifacts

        found = self.client().get_model_version(model_name, version)
        with redacted_errors():
            return Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=found.source,
                    dst_path=str(destination),
                    tracking_uri=self.resolved_tracking_uri(),
                )
            )


def _relay(
    outbox: Path,
    client,
    run_id: str,
    stop: threading.Event,
    ended: threading.Event,
    failed: list,
) -> None:
    """Log the outbox's complete lines as they come, once a second, until ``stop`` (then what is
    left), ``ended`` set once the job's end is logged; on an error, log nothing more and keep it
    in ``failed``."""
    pending = ""
    with outbox.open(encoding="utf-8") as lines:
        while True:
            ending = stop.is_set()
            pending += lines.read()
            *complete, pending = pending.split("\n")
            try:
                for line in complete:
                    call = json.loads(line)
                    replay(client, run_id, call)
                    if call["op"] == "end":
                        ended.set()
            except Exception as exc:  # noqa: BLE001 (raised by relay's caller)
                failed.append(exc)
                return
            if ending:
                return
            stop.wait(1.0)
