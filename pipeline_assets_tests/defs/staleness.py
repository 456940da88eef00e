"""What the UI shows for an asset (partition): its stale status and root causes, from the resolver
the UI uses."""

from __future__ import annotations

from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver
from dagster._time import get_current_datetime


def stale_status(defs, instance, key, partition: str | None = None):
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(
        temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
        instance=instance,
        asset_graph=graph,
    )
    resolver = CachingStaleStatusResolver(instance, graph, loading_context=view)
    return resolver.get_status(key, partition), resolver.get_stale_root_causes(key, partition)
