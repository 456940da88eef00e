"""Locks a crash releases: flock on a local disk, a lease object on S3 (moto's server on
loopback)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import boto3
import pytest
from botocore.exceptions import ClientError

from pipeline_assets.lib.locks import FileLock, LockLost, LockTimeout, S3Lease
from pipeline_assets_tests.conftest import BUCKET
from pipeline_assets_tests.faulty_s3 import FaultyS3

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


def test_of_clients_racing_for_a_free_lease_exactly_one_holds_it(s3_endpoint):
    """S3 applies a conditional put atomically. Four clients put the same free lease at the same
    moment, round after round, with the interpreter switching threads every 10 µs so that the
    server's requests interleave: one put wins each round."""
    clients = [boto3.client("s3") for _ in range(4)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        holders = [_race_for(clients, f"s3://{BUCKET}/race/{round_}.lock") for round_ in range(100)]
    finally:
        sys.setswitchinterval(switch_interval)
    assert holders == [1] * len(holders)


def _race_for(clients: list, uri: str) -> int:
    """How many of ``clients`` believe they took the free lease at ``uri``."""
    leases = [S3Lease(client, uri, timeout=0, ttl_seconds=60) for client in clients]
    start, won = threading.Barrier(len(leases)), []

    def take(lease: S3Lease) -> None:
        start.wait()
        try:
            lease.acquire()
        except LockTimeout:
            return
        won.append(lease)

    racers = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    for lease in won:
        lease.release()
    return len(won)


def test_a_lease_put_that_landed_but_lost_its_answer_is_still_held(s3_endpoint):
    """The first put of the lease and of its first renewal reach S3; their answers are lost, and
    the client's retries then find the condition broken by their own write. The lease sees its own
    token and holds on, rather than waiting out its own lease or reporting it lost."""
    key = LEASE.removeprefix(f"s3://{BUCKET}/")
    with FaultyS3(
        s3_endpoint, key, fails=lambda n: n in (1, 3), method="PUT", lose_answer=True
    ) as store:
        client = boto3.client("s3", endpoint_url=store.endpoint)
        lease = S3Lease(client, LEASE, timeout=2, ttl_seconds=60)
        with lease:
            lease.confirm()
            lease.confirm()
    assert store.requests == 5, "two lost answers, their two retries, one clean renewal"
    assert boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=key)["KeyCount"] == 0
