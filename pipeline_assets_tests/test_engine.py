"""The local Ray's options: everything under PIPELINE_HOME, within Ray's socket-path limit."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from pipeline_assets.engine import local_ray_options

RAY_SESSION_CHARS = 70  # what Ray's session folder and socket names add to its temporary folder
SOCKET_PATH_LIMIT = 107


def test_a_long_home_and_a_long_system_temp_still_give_ray_a_short_folder_under_home(tmp_path, monkeypatch):
    home = tmp_path / ("a-long-pipeline-home-" * 4)
    long_temp = tmp_path / ("a-long-system-temp-" * 3)  # as macOS's /var/folders/... is
    long_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_temp))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.setenv(name, "")  # restored after the test: local_ray_options sets them

    options = local_ray_options(home)
    folder = Path(options["_temp_dir"])
    try:
        assert len(str(folder)) + RAY_SESSION_CHARS <= SOCKET_PATH_LIMIT
        assert folder.resolve() == (home / "ray" / "tmp").resolve(), "Ray's files land under PIPELINE_HOME"
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert token.parent == home / "ray" and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert options["include_dashboard"] is False and options["_node_ip_address"] == "127.0.0.1"
    finally:
        if folder.is_symlink():
            folder.unlink()
