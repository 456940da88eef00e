"""Where rank 0's numbers go: the log, Dagster Pipes (when launched by Dagster) and MLflow.

Only rank 0 builds a ``Reporter``: SQLite takes one writer at a time, and one Pipes channel is
enough. Every other rank logs warnings and errors only.

MLflow: a job launched by an asset writes its MLflow calls to an outbox file (``OUTBOX_VARIABLE``)
and the asset's process, which has MLflow loaded and its run open, logs them as they come
(``replay``). Rank 0 then never imports MLflow (3 s of a start on CPU), needs no tracking
credentials, and a slow tracking server cannot stall a training step. A job run by hand, without
the outbox, logs to MLflow itself when MLFLOW_TRACKING_URI (or a run id) is given.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("pipeline_assets.trainer")

OUTBOX_VARIABLE = "TRAINER_MLFLOW_OUTBOX"  # set by the launching process only, with a run id


class Reporter:
    def __init__(self, mlflow_run_id: str, experiment: str):
        self._pipes = self._open_pipes()
        self._tracking = self._open_tracking(mlflow_run_id, experiment)

    # --- channels -------------------------------------------------------------------------------
    @staticmethod
    def _open_pipes():
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        if not PipesEnvVarParamsLoader().is_dagster_pipes_process():
            return None  # run by hand
        return open_dagster_pipes()

    @staticmethod
    def _open_tracking(run_id: str, experiment: str) -> _Outbox | _Mlflow | None:
        outbox = os.environ.get(OUTBOX_VARIABLE)
        if outbox and run_id:
            return _Outbox(Path(outbox), run_id)
        if not (run_id or os.environ.get("MLFLOW_TRACKING_URI")):
            log.info("MLFLOW_TRACKING_URI is not set: metrics go to the log only")
            return None
        return _Mlflow(run_id, experiment)

    @property
    def mlflow_run_id(self) -> str | None:
        return self._tracking.run_id if self._tracking else None

    # --- what the trainer reports ---------------------------------------------------------------
    def info(self, message: str) -> None:
        log.info(message)
        if self._pipes:
            self._pipes.log.info(message)

    def warning(self, message: str) -> None:
        log.warning(message)
        if self._pipes:
            self._pipes.log.warning(message)

    def params(self, params: dict) -> None:
        if self._tracking:
            self._tracking.call("params", values={k: str(v)[:500] for k, v in params.items()})

    def tags(self, tags: dict) -> None:
        if self._tracking:
            self._tracking.call("tags", values={k: str(v) for k, v in tags.items()})

    def metrics(self, step: int, values: dict) -> None:
        if self._tracking:
            self._tracking.call(
                "metrics",
                values={k: float(v) for k, v in values.items()},
                step=step,
                timestamp=int(time.time() * 1000),
            )

    def dataset(self, uri: str, version: int, name: str) -> None:
        if self._tracking:
            self._tracking.call("dataset", uri=uri, version=version, name=name)

    def artifact(self, path: Path) -> None:
        if self._tracking:
            self._tracking.call("artifact", path=str(path))

    def finish(self, metadata: dict, succeeded: bool, report: bool = True) -> None:
        """``report``: the launching asset's materialization is this metadata (False: the asset
        reports itself)."""
        if self._pipes:
            if succeeded and report:
                self._pipes.report_asset_materialization(metadata=metadata)
            self._pipes.close()
        if self._tracking:
            self._tracking.call("end", status="FINISHED" if succeeded else "KILLED")


class _Outbox:
    """Rank 0's MLflow calls as JSON lines, each flushed as written, for the launching process to
    log (``replay``)."""

    def __init__(self, path: Path, run_id: str):
        self.run_id = run_id
        self._file = path.open("a", encoding="utf-8")

    def call(self, op: str, **fields) -> None:
        self._file.write(json.dumps({"op": op, **fields}) + "\n")
        self._file.flush()
        if op == "end":
            self._file.close()


class _Mlflow:
    """MLflow in this process: a job run by hand."""

    def __init__(self, run_id: str, experiment: str):
        import mlflow

        if not run_id:
            mlflow.set_experiment(experiment)
        self.run_id = mlflow.start_run(run_id=run_id or None).info.run_id
        self._end_run, self._client = mlflow.end_run, mlflow.MlflowClient()

    def call(self, op: str, **fields) -> None:
        if op == "end":  # the active run's own end: MLflow would otherwise end it again at exit
            self._end_run(status=fields["status"])
        else:
            replay(self._client, self.run_id, {"op": op, **fields})


def replay(client, run_id: str, call: dict) -> None:
    """One of rank 0's MLflow calls (an outbox line, parsed), logged to ``run_id`` by ``client``
    (an ``mlflow.MlflowClient``)."""
    from mlflow.entities import Metric, Param, RunTag

    op = call["op"]
    if op == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in call["values"].items()])
    elif op == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in call["values"].items()])
    elif op == "metrics":
        client.log_batch(
            run_id,
            metrics=[
                Metric(k, v, call["timestamp"], call["step"]) for k, v in call["values"].items()
            ],
        )
    elif op == "dataset":
        client.log_inputs(run_id, datasets=[_delta_dataset_input(call)])
    elif op == "artifact":
        client.log_artifact(run_id, call["path"])
    elif op == "end":
        client.set_terminated(run_id, status=call["status"])
    else:
        raise ValueError(f"unknown MLflow call {op!r} in a trainer's outbox")


def _delta_dataset_input(call: dict):
    """A training input: a Delta table at its pinned version."""
    from mlflow.data.delta_dataset_source import DeltaDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    source = DeltaDatasetSource(path=call["uri"], delta_table_version=call["version"])
    dataset = MetaDataset(source, name=call["name"], digest=f"v{call['version']}")
    return DatasetInput(
        dataset=dataset._to_mlflow_entity(),
        tags=[InputTag(key=MLFLOW_DATASET_CONTEXT, value="training")],
    )
