"""The resources assets ask for, one module a job: ``settings`` (every environment variable, its
default and meaning), ``lake`` (Delta tables), ``landing`` (the landing zone), ``eval_sets``
(benchmark items), ``launcher`` (torchrun) and ``mlflow_tracking`` (runs and the registry). Each
layer's policy lives beside the layer (``defs/<layer>/policy.py``); ``defs/resources.py`` builds
them all from the settings."""
