"""The code location's Dagster wiring, one folder a layer.

Dagster warns on every load that some APIs this location uses are in preview or beta (partitioned
check specs, ``observable_source_asset``, Pipes' writer count). Those lines head every command's
output and read like errors, so these two classes, and only they, are ignored wherever the location
loads; every other warning still shows.
"""

import warnings

from dagster import BetaWarning, PreviewWarning

for _category in (PreviewWarning, BetaWarning):
    warnings.filterwarnings("ignore", category=_category)
