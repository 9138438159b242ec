"""The lease of a region's writer: whether the region has a live writer, for the maintain loop.

Every region writer memwal_df opens holds the lease of its region (`_mem_wal/_writer_leases/{region}/`,
the epoch files of `memwal_df.format.lease`) while it runs:

- it **takes** the lease before it claims the region, whatever the newest epoch is: a new writer
  always wins a region (its claim fences the old writer), so it takes the lease over too;
- a daemon thread **renews** it every third of its TTL (`WriterConfig.lease_ttl_s`). When the newest
  epoch is another holder's, it waits while that one is active (a new writer, whose claim fences this
  one, or a recovery, which claims the region only if this writer committed nothing since the
  recovery looked, see `memwal_df.jobs.region_recovery`); once that lease is no longer active it
  takes the lease back if the region's manifest still carries this writer's epoch, and otherwise
  (fenced) stops renewing;
- `release()` marks its epoch released when the writer stops (close, abort, a failed open), if it is
  still the newest.

A lease that expired (the process died, or stopped renewing for longer than the TTL) or was released
tells the maintain loop that nobody writes the region: it replays the region's WAL into a generation.
A writer that comes back after its lease expired is fenced by the recovery's claim (epoch + 1), as by
any new writer. Expiry compares the writer's clock with the recovering process's: keep the TTL well
above the clock skew between machines. Lance's own writers keep no lease.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from memwal_df.errors import InvalidConfigError, MemWalError
from memwal_df.format import layout
from memwal_df.format import lease as _lease
from memwal_df.format.lease import Lease
from memwal_df.format.storage import Storage

log = logging.getLogger(__name__)

WRITER = "writer:"  # holder name prefixes
RECOVERY = "recovery:"


def current(storage: Storage, region_id: uuid.UUID) -> Lease | None:
    """The newest epoch of the region's writer lease; None when no writer ever took one."""
    return _lease.current(storage, layout.writer_lease_dir(region_id))


def take_over(storage: Storage, region_id: uuid.UUID, ttl: timedelta) -> Lease:
    """Create the next epoch of the region's writer lease under a fresh writer holder name, whatever
    the newest epoch is (a new writer takes a region over)."""
    directory, holder = layout.writer_lease_dir(region_id), f"{WRITER}{uuid.uuid4()}"
    while True:
        got = _lease.take(storage, directory, current(storage, region_id), holder, ttl)
        if got is not None:
            return got


def take_expired(storage: Storage, region_id: uuid.UUID, expired: Lease, ttl: timedelta) -> Lease | None:
    """For a recovery: the epoch after `expired` (an expired or released lease), under a recovery
    holder name; None when another holder created that epoch first (a writer came back or started)."""
    directory = layout.writer_lease_dir(region_id)
    return _lease.take(storage, directory, expired, f"{RECOVERY}{uuid.uuid4()}", ttl)


@dataclass(frozen=True)
class RecoveryClaim:
    """A recovery's claim of a region: only the manifest version after `expect_version` (the one it
    saw when it found the lease expired), holding `lease` (from `take_expired`)."""

    expect_version: int
    lease: Lease


class WriterLease:
    """Holds a region writer's lease (taken over, or `held` as given) and renews it from a daemon
    thread until `release()`. `still_ours()` tells whether the region's manifest still carries the
    writer's epoch (asked only before taking the lease back from another holder)."""

    def __init__(
        self,
        storage: Storage,
        region_id: uuid.UUID,
        ttl: timedelta,
        still_ours: Callable[[], bool],
        held: Lease | None = None,
    ) -> None:
        if ttl <= timedelta(0):
            raise InvalidConfigError(f"the writer lease TTL (lease_ttl_s) must be positive, got {ttl}")
        self.storage, self.region_id, self.ttl = storage, region_id, ttl
        self._directory = layout.writer_lease_dir(region_id)
        self._still_ours = still_ours
        self.lease: Lease | None = held if held is not None else take_over(storage, region_id, ttl)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"memwal-lease-{region_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl.total_seconds() / 3):
            try:
                if not self._renew():
                    return
            except MemWalError as e:  # a storage error: try again next time
                log.warning("renewing the writer lease of region %s failed: %s", self.region_id, e)

    def _renew(self) -> bool:
        """Renew (or take back) the lease; False once this writer is fenced (stop renewing)."""
        held = self.lease
        assert held is not None
        cur = _lease.current(self.storage, self._directory)
        if cur is not None and cur.holder != held.holder:
            if cur.active(_lease.now_ms()):
                return True  # a newer writer (fences us) or a recovery (gives up or fences us)
            if not self._still_ours():
                self.lease = None
                return False
        got = _lease.take(self.storage, self._directory, cur, held.holder, self.ttl)
        if got is not None:
            self.lease = got
            if cur is not None and cur.holder == held.holder:
                self.storage.delete(f"{self._directory}/{cur.epoch:020d}.json")
        return True

    def release(self) -> None:
        """Stop renewing and mark the lease released if its newest epoch is still this writer's."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        held, self.lease = self.lease, None
        if held is None:
            return
        try:
            cur = _lease.current(self.storage, self._directory)
            if cur is not None and cur.holder == held.holder:
                _lease.release(self.storage, self._directory, cur)
        except MemWalError as e:  # the lease expires by itself
            log.warning("releasing the writer lease of region %s failed: %s", self.region_id, e)
