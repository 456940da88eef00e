"""Where rank 0's numbers go: the log, Dagster Pipes (when launched by Dagster) and MLflow.

Only rank 0 builds a ``Reporter``: SQLite takes one writer at a time, and one Pipes channel is
enough. Every other rank logs warnings and errors only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("pipeline_assets.trainer")


class Reporter:
    def __init__(self, mlflow_run_id: str, experiment: str):
        self._pipes = self._open_pipes()
        self._mlflow = self._start_mlflow(mlflow_run_id, experiment)

    # --- channels -------------------------------------------------------------------------------
    @staticmethod
    def _open_pipes():
        from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

        if not PipesEnvVarParamsLoader().is_dagster_pipes_process():
            return None  # run by hand
        return open_dagster_pipes()

    @staticmethod
    def _start_mlflow(run_id: str, experiment: str):
        if not (run_id or os.environ.get("MLFLOW_TRACKING_URI")):
            log.info("MLFLOW_TRACKING_URI is not set: metrics go to the log only")
            return None
        import mlflow

        if not run_id:
            mlflow.set_experiment(experiment)
        mlflow.start_run(run_id=run_id or None)
        return mlflow

    @property
    def mlflow_run_id(self) -> str | None:
        return self._mlflow.active_run().info.run_id if self._mlflow else None

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
        if self._mlflow:
            self._mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def tags(self, tags: dict) -> None:
        if self._mlflow:
            self._mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def metrics(self, step: int, values: dict) -> None:
        if self._mlflow:
            self._mlflow.log_metrics(values, step=step)

    def dataset(self, uri: str, version: int, name: str) -> None:
        if not self._mlflow:
            return
        from mlflow.data.delta_dataset_source import DeltaDatasetSource
        from mlflow.data.meta_dataset import MetaDataset

        source = DeltaDatasetSource(path=uri, delta_table_version=version)
        self._mlflow.log_input(
            MetaDataset(source, name=name, digest=f"v{version}"), context="training"
        )

    def artifact(self, path: Path) -> None:
        if self._mlflow:
            self._mlflow.log_artifact(str(path))

    def finish(self, metadata: dict, succeeded: bool, report: bool = True) -> None:
        """``report``: the launching asset's materialization is this metadata (False: the asset
        reports itself)."""
        if self._pipes:
            if succeeded and report:
                self._pipes.report_asset_materialization(metadata=metadata)
            self._pipes.close()
        if self._mlflow:
            self._mlflow.end_run(status="FINISHED" if succeeded else "KILLED")
