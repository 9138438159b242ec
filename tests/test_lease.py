"""The storage lease (`memwal_df.format.lease`) on its own: exclusion between threads and between processes,
takeover after expiry, same-holder takeover, renewal, release, removal of stale lease directories.
(`tests/test_entry_lease.py` covers the MemWAL index-entry lease built on it.)"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from support.optional import not_none

from memwal_df.errors import CorruptManifestError
from memwal_df.format import lease
from memwal_df.format.open_storage import open_storage
from memwal_df.format.storage import Storage

DIR = "_mem_wal/_write_leases/job/region"
LONG = timedelta(minutes=10)  # never expires during a test


@pytest.fixture
def storage(table_uri, table_storage_options) -> Storage:
    return open_storage(table_uri, table_storage_options)


def _critical_sections(
    storage_uri: str, options: dict[str, str] | None, holder: str, rounds: int, inside: str
) -> str | None:
    """Take the lease `rounds` times; inside, create the file `inside` exclusively (it must not
    exist: nobody else is inside), pause, delete it. An overlap, as text, or None."""
    storage = open_storage(storage_uri, options)
    for _ in range(rounds):
        held = lease.acquire(storage, DIR, holder, LONG)
        try:
            fd = os.open(inside, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return f"{holder} entered while another holder was inside"
        os.close(fd)
        time.sleep(0.005)
        os.unlink(inside)
        lease.release(storage, DIR, held)
    return None


def test_threads_exclude_each_other(storage, tmp_path):
    results: list[str | None] = []
    args = (storage.uri, storage.storage_options or None)
    threads = [
        threading.Thread(
            target=lambda h=h: results.append(_critical_sections(*args, h, 8, str(tmp_path / "inside")))
        )
        for h in ("a", "b", "c", "d")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [None] * 4
    last = lease.current(storage, DIR)
    assert last is not None and last.released and last.epoch == 32
    assert storage.list_dir(DIR) == [f"{32:020d}.json"]  # released epochs prune the older ones


def _process(uri: str, holder: str, inside: str, queue: Any) -> None:
    queue.put(_critical_sections(uri, None, holder, 5, inside))


def test_processes_exclude_each_other(tmp_path):
    uri = str(tmp_path / "t")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(uri, h, str(tmp_path / "inside"), queue)) for h in "abc"]
    for p in procs:
        p.start()
    outcomes = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == [None] * 3
    assert not_none(lease.current(open_storage(uri), DIR)).epoch == 15


def test_an_expired_lease_is_taken_over_and_its_holder_loses_the_renewal(storage):
    a = lease.acquire(storage, DIR, "a", timedelta(0))  # expired at once
    b = lease.try_acquire(storage, DIR, "b", LONG)
    assert b is not None and b.epoch == a.epoch + 1 and b.holder == "b"
    assert lease.renew(storage, DIR, a, LONG) is None  # "a" learns it lost the lease
    assert lease.try_acquire(storage, DIR, "a", LONG) is None  # "b" is active
    assert lease.current(storage, DIR) == b
    renewal = lease.Renewal(storage, DIR, a, timedelta(milliseconds=30))
    deadline = time.monotonic() + 60
    while renewal.lease is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert renewal.stop() is None  # the renewal thread found the lease lost
    assert lease.current(storage, DIR) == b


def test_the_same_holder_takes_its_active_lease_over_at_once(storage):
    first = lease.acquire(storage, DIR, "job:3", LONG)
    assert lease.try_acquire(storage, DIR, "job:4", LONG) is None
    again = lease.acquire(storage, DIR, "job:3", LONG)  # a retried attempt: no wait
    assert again.epoch == first.epoch + 1
    assert not_none(lease.try_acquire(storage, DIR, "job:3", LONG)).epoch == again.epoch + 1
    assert lease.renew(storage, DIR, first, LONG) is None  # the old attempt lost it


def test_release_frees_the_lease_and_a_waiter_gets_it(storage):
    held = lease.acquire(storage, DIR, "a", LONG)
    got: list[lease.Lease] = []
    waiter = threading.Thread(target=lambda: got.append(lease.acquire(storage, DIR, "b", LONG)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting for "a"
    lease.release(storage, DIR, held)
    waiter.join(timeout=60)
    assert got and got[0].epoch == held.epoch + 1 and got[0].holder == "b"
    assert lease.current(storage, DIR) == got[0]


def test_renewal_extends_the_lease_with_new_epochs(storage):
    held = lease.acquire(storage, DIR, "a", timedelta(milliseconds=300))
    renewal = lease.Renewal(storage, DIR, held, timedelta(milliseconds=300))
    deadline = time.monotonic() + 60
    while (renewal.lease is None or renewal.lease.epoch < held.epoch + 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    last = renewal.stop()
    assert last is not None and last.epoch >= held.epoch + 2 and last.holder == "a"
    assert lease.current(storage, DIR) == last
    assert storage.list_dir(DIR) == [f"{last.epoch:020d}.json"]  # a renewal deletes the epoch it replaced
    lease.release(storage, DIR, last)
    assert lease.try_acquire(storage, DIR, "b", LONG) is not None


def test_remove_stale_keeps_groups_with_a_recent_lease(storage):
    root = "_mem_wal/_write_leases"
    lease.acquire(storage, f"{root}/old/r1", "x", timedelta(0))
    lease.release(storage, f"{root}/old/r2", lease.acquire(storage, f"{root}/old/r2", "x", timedelta(0)))
    lease.acquire(storage, f"{root}/running/r1", "y", timedelta(0))
    lease.acquire(storage, f"{root}/running/r2", "y", LONG)
    assert lease.remove_stale(storage, root, timedelta(0)) == ["old"]
    assert storage.list_dir(root) == ["running"]
    assert lease.remove_stale(storage, root, timedelta(hours=1)) == []
    assert lease.remove(storage, f"{root}/running") == 2
    assert storage.list_dir(root) == []


def test_a_corrupt_lease_is_a_typed_error(storage):
    storage.put(f"{DIR}/{1:020d}.json", b"{not json")
    with pytest.raises(CorruptManifestError):
        lease.current(storage, DIR)
