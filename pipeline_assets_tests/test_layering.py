"""The import rule of DESIGN.md §5, as pyproject.toml's import-linter contracts: the package keeps
it, and a module that breaks a contract fails `make lint` and this test."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# A breach of each contract: its id, the module that breaks it and the import it gains.
BREACHES = {
    "package-layers": ("lib/silver/dedup.py", "from pipeline_assets.defs import keys"),
    "lib-no-dagster": ("lib/formats.py", "import dagster"),
    "trainer-no-dagster": ("trainer/data.py", "import dagster"),
    "lib-layers": ("lib/silver/dedup.py", "from pipeline_assets.lib.gold import sequences"),
    "defs-layers": ("defs/gold/assets.py", "from pipeline_assets.defs.silver import order"),
}


def _lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    selected = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", *selected],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_package_keeps_every_contract():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(BREACHES)} kept, 0 broken" in result.stdout


@pytest.mark.parametrize("contract", BREACHES)
def test_a_breach_fails_its_contract(tmp_path, contract):
    module, line = BREACHES[contract]
    shutil.copytree(REPO / "pipeline_assets", tmp_path / "pipeline_assets")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with (tmp_path / "pipeline_assets" / module).open("a") as source:
        source.write(f"\n{line}\n")
    result = _lint_imports(tmp_path, contract)
    assert result.returncode != 0 and "0 kept, 1 broken" in result.stdout, result.stdout
