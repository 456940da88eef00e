"""The one place that imports Dagster's private modules: names that Dagster 1.13's public APIs
hand out or raise but that the ``dagster`` package does not export. Replace each with its public
name once Dagster exports it."""

# Raised by PipesSubprocessClient.run when the launched process fails.
from dagster._core.errors import DagsterPipesExecutionError  # noqa: F401

# The status in what event_log_storage.get_asset_check_partition_info returns.
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus  # noqa: F401
