"""Rates the sizer measures on synthetic data, once for a code and machine, and keeps in a file
under ``$PIPELINE_HOME/reports``: silver's work that a calibration's small batches cannot show (the
index lookup, ``lookup_rate``; the decision, ``decision_rate``)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import TypeVar

Rate = TypeVar("Rate")
REPEATS = 5  # measurements of each size, taken in turns: the fastest counts


def fastest_in_turns(measures: list[Callable[[], float]], repeats: int = REPEATS) -> list[float]:
    """The fastest of ``repeats`` seconds of each of ``measures``, run in turns: this machine's
    speed drifts within minutes, and taken in turns every measure sees the same drift."""
    seconds = [[measure() for measure in measures] for _ in range(repeats)]
    return [min(run[i] for run in seconds) for i in range(len(measures))]


def kept_or_measured(
    cache: Path, kind: type[Rate], measured_on: str, measure: Callable[[], Rate]
) -> Rate:
    """The ``kind`` kept in ``cache`` when it was measured on ``measured_on``, else ``measure()``
    kept there (a file that cannot be read is measured again and written over)."""
    try:
        kept = kind(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        kept = None
    if kept is not None and kept.measured_on == measured_on:
        return kept
    rate = measure()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(rate), indent=2))
    return rate


def fingerprint(modules: tuple[ModuleType, ...], settings: object) -> str:
    """What a measurement ran on: a hash of the measured code (``modules``' sources), polars' and
    deltalake's versions, Python's, the machine's cores, and ``settings``."""
    sources = b"".join(Path(module.__file__).read_bytes() for module in modules)
    libraries = " ".join(f"{name} {version(name)}" for name in ("polars", "deltalake"))
    return (
        f"{hashlib.sha256(sources).hexdigest()[:16]}; {libraries}; python "
        f"{sys.version.split()[0]}; {os.cpu_count()} cores; {settings}"
    )
