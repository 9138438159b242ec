"""Leases on storage: the newest of `{directory}/{epoch:020}.json`, each created put-if-not-exists.

An epoch file holds `{holder, expires_ms, released}`; only the newest epoch counts, and it is
*active* while neither released nor expired. Taking the lease creates the next epoch file, and
put-if-not-exists lets exactly one of several takers of an epoch win:

- **exclusion**: while an epoch is active, other holders wait (`acquire`) or back off (`try_acquire`);
- **expiry**: an expired epoch is taken over with the next one, so a crashed holder's lease frees
  itself after its TTL;
- **same holder**: a taker whose holder name equals the active epoch's takes it over at once (a
  retried task attempt replacing its predecessor, which learns it when its next `renew` loses);
- `renew` extends a lease by creating the next epoch under the same holder (None: another took it);
  `Renewal` does that from a thread while a long job runs;
- `release` marks the holder's epoch released and prunes older epochs; `remove` deletes a whole
  lease directory, `remove_stale` every lease directory under a root that nobody held recently.

Expiry reads the local clock, so a lease gives exclusion only among holders that renew in time:
users pair it with a fence (`memwal_df.format.entry_lease`) or use it to avoid needless conflicts that
region fencing resolves anyway (`memwal_df.spark.staging`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta

from memwal_df.errors import CorruptManifestError, MemWalError, NotFoundError
from memwal_df.format.storage import EXISTED, Storage

log = logging.getLogger(__name__)

_POLL_SECONDS = (0.01, 0.2)  # first and longest wait between looks at an active lease


@dataclass(frozen=True)
class Lease:
    """One epoch of a lease."""

    epoch: int
    holder: str
    expires_ms: int
    released: bool = False

    def active(self, now_ms: int) -> bool:
        return not self.released and now_ms < self.expires_ms

    def encode(self) -> bytes:
        body = {"holder": self.holder, "expires_ms": self.expires_ms, "released": self.released}
        return json.dumps(body, sort_keys=True).encode()


def now_ms() -> int:
    return int(time.time() * 1000)


def _path(directory: str, epoch: int) -> str:
    return f"{directory}/{epoch:020d}.json"


def _epochs(storage: Storage, directory: str) -> list[int]:
    """Every lease epoch in `directory`, ascending."""
    names = storage.list_dir(directory)
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def current(storage: Storage, directory: str) -> Lease | None:
    """The newest lease epoch in `directory`, or None when nobody ever took the lease there."""
    while True:
        epochs = _epochs(storage, directory)
        if not epochs:
            return None
        path = _path(directory, epochs[-1])
        try:
            raw = storage.get(path)
        except NotFoundError:
            continue  # a newer epoch was taken and released meanwhile, which pruned this one
        try:
            body = json.loads(raw)
            return Lease(epochs[-1], str(body["holder"]), int(body["expires_ms"]), bool(body["released"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptManifestError(f"lease cannot be decoded ({e})", path) from e


def wait_while_active(storage: Storage, directory: str, lease: Lease | None) -> Lease | None:
    """Poll until `lease` is no longer the active newest epoch; the newest lease then."""
    delay = _POLL_SECONDS[0]
    cur = lease
    while cur is not None and cur.active(now := now_ms()):
        time.sleep(min(delay, max(0.0, (cur.expires_ms - now) / 1000)))
        delay = min(2 * delay, _POLL_SECONDS[1])
        cur = current(storage, directory)
    return cur


def take(
    storage: Storage, directory: str, after: Lease | None, holder: str, ttl: timedelta, released: bool = False
) -> Lease | None:
    """Create the epoch after `after`; the new lease, or None if another taker created it first."""
    expires = now_ms() + int(ttl / timedelta(milliseconds=1))
    lease = Lease((after.epoch if after else 0) + 1, holder, expires, released)
    return None if storage.create(_path(directory, lease.epoch), lease.encode()) == EXISTED else lease


def try_acquire(storage: Storage, directory: str, holder: str, ttl: timedelta) -> Lease | None:
    """Take the lease for `ttl` unless another holder's epoch is active (then None, at once)."""
    while True:
        cur = current(storage, directory)
        if cur is not None and cur.holder != holder and cur.active(now_ms()):
            return None
        got = take(storage, directory, cur, holder, ttl)
        if got is not None:
            return got


def acquire(storage: Storage, directory: str, holder: str, ttl: timedelta) -> Lease:
    """Take the lease for `ttl`: wait while another holder's epoch is active, then create the next
    epoch (an active epoch of `holder` itself is taken over at once)."""
    while True:
        cur = current(storage, directory)
        if cur is None or cur.holder != holder:
            cur = wait_while_active(storage, directory, cur)
        got = take(storage, directory, cur, holder, ttl)
        if got is not None:
            return got


def renew(storage: Storage, directory: str, lease: Lease, ttl: timedelta) -> Lease | None:
    """Extend `lease` by `ttl` from now as the next epoch of the same holder; None if another taker
    created that epoch (the lease is lost: it expired and was taken over, or its holder took it over)."""
    got = take(storage, directory, lease, lease.holder, ttl)
    if got is not None:
        storage.delete(_path(directory, lease.epoch))
    return got


def release(storage: Storage, directory: str, lease: Lease) -> None:
    """Mark `lease` released and delete the epochs before it (only the newest epoch counts)."""
    storage.put(_path(directory, lease.epoch), replace(lease, released=True).encode())
    for epoch in _epochs(storage, directory):
        if epoch < lease.epoch:
            storage.delete(_path(directory, epoch))


def remove(storage: Storage, directory: str) -> int:
    """Delete every lease file under `directory` (nested lease directories too); how many."""
    return storage.delete_prefix(directory)


def remove_stale(storage: Storage, root: str, older_than: timedelta) -> list[str]:
    """Delete each child directory of `root` whose lease directories (its children) all hold no
    lease that expired less than `older_than` ago; the names of the deleted children."""
    limit = now_ms() - int(older_than / timedelta(milliseconds=1))
    removed = []
    for name in storage.list_dir(root):
        group = f"{root}/{name}"
        leases = [current(storage, f"{group}/{d}") for d in storage.list_dir(group)]
        if all(lease is None or lease.expires_ms <= limit for lease in leases):
            remove(storage, group)
            removed.append(name)
    return removed


class Renewal:
    """Renews a held lease from a daemon thread every third of `ttl`, until `stop()`.

    `lease` is the newest epoch held, or None once a renewal lost (another taker holds it now)."""

    def __init__(self, storage: Storage, directory: str, lease: Lease, ttl: timedelta) -> None:
        self.storage, self.directory, self.ttl = storage, directory, ttl
        self.lease: Lease | None = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"memwal-lease-{directory}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.ttl.total_seconds() / 3
        while not self._stop.wait(interval):
            held = self.lease
            if held is None:
                return
            try:
                self.lease = renew(self.storage, self.directory, held, self.ttl)
            except MemWalError as e:  # a storage error: the lease may still be ours, try again
                log.warning("renewing the lease in %s failed: %s", self.directory, e)

    def stop(self) -> Lease | None:
        """Stop renewing; the newest epoch held (None if lost)."""
        self._stop.set()
        self._thread.join()
        return self.lease
