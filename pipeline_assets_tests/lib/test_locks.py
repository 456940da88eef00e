"""Locks a crash releases: flock on a local disk, a lease object on S3 (moto's server on
loopback)."""

from __future__ import annotations

import signal
import subprocess
import sys

import boto3
import pytest
from botocore.exceptions import ClientError

from pipeline_assets.lib.locks import FileLock, LockLost, LockTimeout, S3Lease
from pipeline_assets_tests.conftest import BUCKET

LEASE = f"s3://{BUCKET}/lake/landing/_manifest.lock"

_HOLD = """
import sys, time
import boto3
from pipeline_assets.lib.locks import FileLock, S3Lease
where = sys.argv[1]
lock = (S3Lease(boto3.client("s3"), where, timeout=30, ttl_seconds=1) if where.startswith("s3://")
        else FileLock(where, timeout=30))
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(where: str) -> subprocess.Popen:
    """Another process that takes the lock, says so, and keeps it until it is killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, where], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_file_lock_is_exclusive_and_released_when_its_holder_is_killed(tmp_path):
    path = tmp_path / "lake" / "landing" / "_manifest.lock"
    holder = _holder(str(path))
    try:
        with pytest.raises(
            LockTimeout, match=rf"lock .*_manifest.lock is still held by pid {holder.pid} on "
        ):
            FileLock(path, timeout=0.3).acquire()
    finally:
        _kill(holder)
    with FileLock(path, timeout=30):  # the kernel let go of the dead holder's lock
        with pytest.raises(LockTimeout):
            FileLock(path, timeout=0.1).acquire()
    with FileLock(path, timeout=0.1):
        pass


def test_moto_honours_conditional_puts(s3_endpoint):
    client = boto3.client("s3")
    first = client.put_object(Bucket=BUCKET, Key="lease", Body=b"one", IfNoneMatch="*")
    with pytest.raises(ClientError) as exists:
        client.put_object(Bucket=BUCKET, Key="lease", Body=b"two", IfNoneMatch="*")
    assert exists.value.response["Error"]["Code"] == "PreconditionFailed"
    second = client.put_object(Bucket=BUCKET, Key="lease", Body=b"two", IfMatch=first["ETag"])
    with pytest.raises(ClientError) as stale:
        client.put_object(Bucket=BUCKET, Key="lease", Body=b"three", IfMatch=first["ETag"])
    assert stale.value.response["Error"]["Code"] == "PreconditionFailed"
    with pytest.raises(ClientError):
        client.delete_object(Bucket=BUCKET, Key="lease", IfMatch=first["ETag"])
    client.delete_object(Bucket=BUCKET, Key="lease", IfMatch=second["ETag"])
    assert client.list_objects_v2(Bucket=BUCKET, Prefix="lease")["KeyCount"] == 0


def test_an_s3_lease_is_exclusive_and_renewed_while_held(s3_endpoint):
    client = boto3.client("s3")
    with S3Lease(client, LEASE, timeout=5, ttl_seconds=1):
        # Waiting three times the lease's life: a holder that renews keeps it.
        with pytest.raises(
            LockTimeout,
            match=r"lock s3://.*_manifest.lock is still held by pid \d+ on .*lease until",
        ):
            S3Lease(client, LEASE, timeout=3, ttl_seconds=1).acquire()
    with S3Lease(client, LEASE, timeout=0.5, ttl_seconds=1):  # released: free at once
        pass
    assert client.list_objects_v2(Bucket=BUCKET, Prefix="lake/landing/")["KeyCount"] == 0


def test_the_expired_lease_of_a_killed_holder_is_taken_over(s3_endpoint):
    client = boto3.client("s3")
    holder = _holder(LEASE)
    try:
        with pytest.raises(LockTimeout, match=rf"held by pid {holder.pid} on "):
            S3Lease(client, LEASE, timeout=0.2, ttl_seconds=60).acquire()
    finally:
        _kill(holder)
    with S3Lease(
        client, LEASE, timeout=30, ttl_seconds=60
    ):  # the dead holder's lease expires within 1 s
        with pytest.raises(LockTimeout):
            S3Lease(client, LEASE, timeout=0.2, ttl_seconds=60).acquire()


def test_a_lease_taken_away_is_reported_before_the_commit(s3_endpoint):
    client = boto3.client("s3")
    lease = S3Lease(client, LEASE, timeout=5, ttl_seconds=60)
    with lease:
        lease.confirm()
        client.delete_object(Bucket=BUCKET, Key="lake/landing/_manifest.lock")  # broken by hand
        with pytest.raises(LockLost, match="taken over"):
            lease.confirm()
