"""Locks that a crash releases: one process at a time in a critical section, on a local disk or S3.

Local: ``flock`` on a lock file, released by the kernel when its holder dies. S3: a lease object
created with a conditional put (``If-None-Match: *``), renewed while held, deleted on release; a
lease its holder stopped renewing (it died) expires and is taken over with ``If-Match`` on its ETag,
so of two waiters only one gets it. A put whose answer was lost is known by the token it wrote.
Both wait at most ``timeout`` seconds (None: as long as it takes), then fail naming the lock and
its holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from pipeline_assets.lib import uris


class LockTimeout(TimeoutError):
    """The lock stayed held by another process for longer than the caller would wait."""


class LockLost(RuntimeError):
    """An S3 lease expired while held (its holder stalled for longer than the lease) and was taken
    over."""


def this_process() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _since() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Lock:
    """acquire / release / confirm, and ``with lock:``."""

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def confirm(self) -> None:
        """Raise ``LockLost`` unless this process still holds the lock (call it just before
        committing)."""


class FileLock(Lock):
    """``flock`` on ``path``; the file keeps the holder's pid, for the messages of those who
    wait."""

    def __init__(
        self,
        path: str | Path,
        *,
        timeout: float | None,
        on_wait: Callable[[str], None] | None = None,
        poll_seconds: float = 0.05,
    ):
        self.path = Path(path)
        self.timeout = timeout
        self.on_wait = on_wait
        self.poll_seconds = poll_seconds
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    raise LockTimeout(
                        f"lock {self.path} is still held by {holder} after {self.timeout:g} s"
                    ) from None
                if not waiting and self.on_wait is not None:
                    self.on_wait(holder)
                waiting = True
                time.sleep(self.poll_seconds)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{this_process()} since {_since()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


_LOST_RACE = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "409", "412"}


def _lost_race(exc: Exception) -> bool:
    """A conditional write or read that another process's write got ahead of."""
    return getattr(exc, "response", {}).get("Error", {}).get("Code") in _LOST_RACE


class S3Lease(Lock):
    """A lease object at ``uri`` (``s3://bucket/key``) that expires ``ttl_seconds`` after its last
    renewal.

    Expiry is judged on the waiters' clocks against the holder's: hosts sharing a lake need clocks
    that agree to well within ``ttl_seconds`` (NTP does).
    """

    def __init__(
        self,
        client,
        uri: str,
        *,
        timeout: float | None,
        ttl_seconds: float,
        on_wait: Callable[[str], None] | None = None,
        poll_seconds: float = 0.2,
    ):
        self.client = client
        self.uri = uri
        self.bucket, self.key = uris.split_s3(uri)
        self.timeout = timeout
        self.ttl_seconds = ttl_seconds
        self.on_wait = on_wait
        self.poll_seconds = poll_seconds
        self._token = uuid.uuid4().hex
        self._etag: str | None = None
        self._lost = False
        self._guard = threading.Lock()  # the renewal thread and confirm() both renew
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        waiting = False
        while not self._put(IfNoneMatch="*"):
            current = self._read()
            if current is None:
                continue  # released between our put and our read
            etag, lease = current
            if lease["token"] == self._token:  # our put landed; its answer was lost
                self._etag = etag
                break
            if lease["expires_at"] <= time.time():
                if self._put(IfMatch=etag):
                    break  # its holder stopped renewing: it died
                continue
            holder = f"{lease['holder']} (lease until {_iso(lease['expires_at'])})"
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(
                    f"lock {self.uri} is still held by {holder} after {self.timeout:g} s"
                )
            if not waiting and self.on_wait is not None:
                self.on_wait(holder)
            waiting = True
            time.sleep(self.poll_seconds)
        self._stop.clear()
        self._renewer = threading.Thread(
            target=self._keep_renewing, name=f"lease {self.uri}", daemon=True
        )
        self._renewer.start()

    def confirm(self) -> None:
        """Renew now: the caller's commit then has a whole ``ttl_seconds`` before anyone may take
        over."""
        with self._guard:
            if self._lost or not self._renew():
                self._lost = True
                raise LockLost(
                    f"lock {self.uri} expired while held by {this_process()} and was taken over"
                )

    def release(self) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        with self._guard:
            if not self._lost:
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self._etag)
                except Exception as exc:
                    if not _lost_race(
                        exc
                    ):  # taken over after expiry: theirs now, not ours to delete
                        raise
            self._etag = None

    def _keep_renewing(self) -> None:
        while not self._stop.wait(self.ttl_seconds / 3):
            with self._guard:
                if self._lost or not self._renew():
                    self._lost = True
                    return

    def _put(self, **condition) -> bool:
        body = {
            "holder": f"{this_process()} since {_since()}",
            "token": self._token,
            "expires_at": time.time() + self.ttl_seconds,
        }
        try:
            response = self.client.put_object(
                Bucket=self.bucket,
                Key=self.key,
                Body=json.dumps(body).encode(),
                ContentType="application/json",
                **condition,
            )
        except Exception as exc:
            if _lost_race(exc):
                return False
            raise
        self._etag = response["ETag"]
        return True

    def _renew(self) -> bool:
        if self._put(IfMatch=self._etag):
            return True
        current = self._read()  # a renewal whose answer was lost, then retried against itself?
        if current is None or current[1]["token"] != self._token:
            return False
        self._etag = current[0]
        return True

    def _read(self) -> tuple[str, dict] | None:
        try:
            found = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if _lost_race(exc):
                return None
            raise
        return found["ETag"], json.loads(found["Body"].read())


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
