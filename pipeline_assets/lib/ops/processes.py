"""Whether the process that ran something is still there: its pid, host, boot and start time.

A pid alone is not enough: after a reboot or a long while the number is reused, so the process's
start time (Linux: ``/proc/<pid>/stat``) and the machine's boot id are recorded beside it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    host: str
    boot_id: str  # empty where the system does not say
    # the kernel's start time of the process, in clock ticks since boot; empty where unknown
    started: str

    @classmethod
    def current(cls) -> "ProcessIdentity":
        pid = os.getpid()
        return cls(pid=pid, host=socket.gethostname(), boot_id=boot_id(), started=start_ticks(pid))

    def is_gone(self) -> bool | None:
        """True when this process has surely exited; None when it ran on another host (cannot
        tell)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id and self.boot_id != boot_id():
            return True  # the machine rebooted since
        now = start_ticks(self.pid)
        if self.started and now:
            return now != self.started  # gone, or the pid now belongs to another process
        return not _pid_exists(self.pid)


def boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat``; empty when the process or ``/proc`` does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # the command name may hold spaces and parentheses


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
