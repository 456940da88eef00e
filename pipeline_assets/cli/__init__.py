"""``pipeline-assets``: the command line (``main``) and what its commands run outside Dagster's own
processes: headless runs in the persistent instance (``headless``), recovery of runs whose process
died (``recovery``), the decontamination backfill (``backfill``) and model lineage (``lineage``)."""
