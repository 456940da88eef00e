"""Every benchmark module imports: `make bench` is not in `make test`, so a renamed name it uses
would otherwise go unseen until someone runs it."""

import importlib
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize(
    "module", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
)
def test_the_benchmark_module_imports(module):
    importlib.import_module(f"bench.{module}")


def test_make_bench_installs_the_bench_extra():
    """`make bench` as make expands it (a dry run): the extra that holds TRL, whole."""
    recipe = subprocess.run(
        ["make", "-n", "bench"], cwd=BENCH.parent, capture_output=True, text=True, check=True
    ).stdout
    assert 'install -q --python .venv/bin/python -e ".[dev,bench]"' in recipe
