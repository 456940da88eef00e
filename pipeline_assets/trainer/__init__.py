"""What ``torchrun -m pipeline_assets.trainer`` runs: model, data, FSDP2, checkpoints, metrics.

Imports no Dagster; rank 0 alone may open ``dagster_pipes`` to report back to a Dagster run. Run it
by hand with the same arguments the ``training/checkpoint`` asset passes (see ``--help``).
"""
