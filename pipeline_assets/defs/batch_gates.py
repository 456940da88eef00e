"""Which ingest batches are blocked: the latest run of a blocking check on one of their bronze or
silver tables failed. A blocked batch feeds neither silver's dedup nor gold. Silver and gold both
ask, through this resource; ``defs/resources.py`` lists the checks from bronze's and silver's, so
neither layer imports the other's."""

from collections.abc import Iterable

from dagster import (
    AssetCheckKey,
    AssetChecksDefinition,
    AssetKey,
    ConfigurableResource,
    DagsterInstance,
)
from pydantic import Field

from pipeline_assets.defs.check_helpers import partitions_failing_checks


class BatchGates(ConfigurableResource):
    """The blocking checks on bronze and silver tables that keep a failed batch out of dedup and
    gold."""

    checks: list[str] = Field(description="each gate as '<asset key>:<check name>'")

    @classmethod
    def of(cls, checks: Iterable[AssetChecksDefinition]) -> "BatchGates":
        specs = (spec for definition in checks for spec in definition.check_specs)
        return cls(
            checks=sorted(f"{s.asset_key.to_user_string()}:{s.name}" for s in specs if s.blocking)
        )

    def blocked_by_layer(self, instance: DagsterInstance) -> dict[str, set[str]]:
        """Per layer (bronze, silver), the batches its failed gates block: one query."""
        blocked: dict[str, set[str]] = {}
        for batch, asset_key in partitions_failing_checks(instance, self.check_keys()):
            blocked.setdefault(asset_key.path[0], set()).add(batch)
        return blocked

    def blocked(self, instance: DagsterInstance) -> set[str]:
        return set().union(*self.blocked_by_layer(instance).values())

    def check_keys(self) -> list[AssetCheckKey]:
        keys = (gate.rsplit(":", 1) for gate in self.checks)
        return [AssetCheckKey(AssetKey.from_user_string(asset), name) for asset, name in keys]
