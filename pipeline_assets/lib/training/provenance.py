"""Which code produced a result: the git commit of the checkout, marked when it has local
changes."""

from __future__ import annotations

import subprocess
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[2]


def git_commit(folder: Path = _PACKAGE_DIR) -> str:
    """``<sha>``, ``<sha>+dirty`` with uncommitted changes, or ``unknown`` outside a git
    checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if status.stdout.strip() else "")
