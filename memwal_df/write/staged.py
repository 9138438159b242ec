"""Staged writes: rows of any region checked up front, then written one region at a time, each under
the job's lease on it; and the records of committed streaming micro-batches.

**Checking** (`staged_rows`, `tombstones`): rows are checked and conformed as the table writer's
`put`, `put(partial=True)` and `delete` do it, so a bad row fails a job before any of it is written.

**Region leases** (`RegionLeases`): a job writes region `r` holding its lease
`_mem_wal/_write_leases/{job}/{r}` (`memwal_df.format.lease`; holder names are the caller's). `write`
tries the free regions first and waits only when every region left is busy; it holds no lease while
it waits and at most one while it writes, so holders never deadlock. The lease is renewed while the
region is written and released after it; a holder of the same name (a retried attempt) takes a lease
over at once, and a dead holder's leases expire after the TTL.

The lease only keeps holders of a job from fencing each other back and forth; correctness comes from
region fencing. A holder whose region write is fenced looks at the region's lease: if the job's
leases are gone (the job committed or aborted) or a newer holder of its name holds it, `write` raises
the fence; otherwise (another holder took the lease over after it expired, or a writer outside the
job claimed the region) it takes the lease again and writes the region again — a claim replays what
was written durably, and upserts and deletes are idempotent.

**Micro-batch commits** (`StreamCommits`): the batches a streaming query committed to the table
(`memwal_df.format.stream_commits`), so a replayed batch that the table holds already is skipped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import pyarrow as pa

from memwal_df.errors import WriterFencedError
from memwal_df.format import layout, lease, stream_commits
from memwal_df.format.schema import TableSchema, key_rows, tombstone_rows, upsert_rows
from memwal_df.format.storage import Storage
from memwal_df.write.partial import partial_rows

MAX_CLAIMS = 5  # claims of one region by one holder (each after a fence) before `write` gives up
_POLL_SECONDS = (0.02, 0.5)  # first and longest wait when every region left is busy


def staged_rows(
    ts: TableSchema, data: pa.Table | pa.RecordBatch, operation: str, partial: bool = False
) -> pa.Table:
    """`data` checked and conformed as the table writer's `delete` does (operation "delete": the key
    columns), else as `put(partial=True)` (`partial`: the key and some columns) or `put` (every column)."""
    if operation == "delete":
        return key_rows(ts, data)
    table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
    return partial_rows(ts, table) if partial else upsert_rows(ts, table)


def tombstones(ts: TableSchema, keys: pa.Table) -> pa.Table:
    """Delete rows of `keys` (checked as `delete` checks them): every column, NULL but the key."""
    return tombstone_rows(ts, key_rows(ts, keys))


def lease_dir(job: str, region: uuid.UUID | None = None) -> str:
    """The directory of write job `job`'s lease on `region` (without a region: of all its leases)."""
    return layout.write_lease_dir(job, region)


def remove_leases(storage: Storage, job: str) -> None:
    """Delete every lease of write job `job` (it committed or aborted)."""
    lease.remove(storage, lease_dir(job))


@dataclass(frozen=True)
class RegionLeases:
    """The leases of write job `job` on the regions it writes (see the module docstring)."""

    storage: Storage
    job: str
    ttl: timedelta

    def write(
        self,
        regions: Sequence[uuid.UUID],
        holder: str,
        write_region: Callable[[uuid.UUID], int],
        check_live: Callable[[], None],
    ) -> dict[uuid.UUID, int]:
        """Write each of `regions` with `write_region` (claim, write, flush and close; the epoch it
        wrote with) holding the job's lease on it as `holder`, free regions first; region id -> that
        epoch. `check_live` runs before each claim and raises `WriterFencedError` to stop the job."""
        pending = list(regions)
        epochs: dict[uuid.UUID, int] = {}
        delay = _POLL_SECONDS[0]
        while pending:
            busy = []
            for region in pending:
                held = lease.try_acquire(self.storage, lease_dir(self.job, region), holder, self.ttl)
                if held is None:
                    busy.append(region)
                else:
                    epochs[region] = self._write_leased(region, held, write_region, check_live)
            if busy and len(busy) == len(pending):
                time.sleep(delay)
                delay = min(2 * delay, _POLL_SECONDS[1])
            else:
                delay = _POLL_SECONDS[0]
            pending = busy
        return epochs

    def _write_leased(
        self,
        region: uuid.UUID,
        held: lease.Lease,
        write_region: Callable[[uuid.UUID], int],
        check_live: Callable[[], None],
    ) -> int:
        """Write `region` holding (and renewing) `held`, then release it; after a fence, claim and
        write the region again if `_lease_after_fence` allows it (see the module docstring)."""
        storage, directory = self.storage, lease_dir(self.job, region)
        renewal = lease.Renewal(storage, directory, held, self.ttl)
        owned = True
        try:
            for _ in range(MAX_CLAIMS):
                check_live()
                try:
                    return write_region(region)
                except WriterFencedError:
                    mine = _lease_after_fence(storage, directory, renewal.stop(), held.holder, self.ttl)
                    if mine is None:
                        owned = False
                        raise
                    renewal = lease.Renewal(storage, directory, mine, self.ttl)
            raise WriterFencedError(
                f"region {region} was claimed away {MAX_CLAIMS} times while this task wrote it"
            )
        finally:
            last = renewal.stop()
            if owned and last is not None:
                lease.release(storage, directory, last)


def _lease_after_fence(
    storage: Storage, directory: str, mine: lease.Lease | None, holder: str, ttl: timedelta
) -> lease.Lease | None:
    """After `holder`'s write of a region was fenced: the lease to write the region again with
    (ours, or taken again after the holder that took it over released it), or None to give up because
    the job's leases are gone (it committed or aborted) or a newer holder of the same name holds it."""
    cur = lease.current(storage, directory)
    if cur is None or (cur.holder == holder and (mine is None or cur.epoch > mine.epoch)):
        return None
    if mine is not None and cur.epoch == mine.epoch:
        return mine  # still ours: a writer outside the job claimed the region
    return lease.acquire(storage, directory, holder, ttl)  # another holder took it over after expiry


def stream_query_id(value: object) -> str:
    """`value` as a streaming query id (a UUID in its canonical text), else `InvalidArgumentError`."""
    return stream_commits.query_id(value)


@dataclass(frozen=True)
class StreamCommits:
    """The committed micro-batches of streaming query `query` (an id of `stream_query_id`)."""

    storage: Storage
    query: str

    def committed(self, batch: int) -> bool:
        """Whether micro-batch `batch` was committed (it, or a later batch, is recorded)."""
        return stream_commits.committed(self.storage, self.query, batch)

    def record(self, batch: int, rows: int, regions: int, keep: int) -> None:
        """Record micro-batch `batch` (`rows` written to `regions` regions) as committed, durably
        (a replayed commit finds it recorded), then delete all but the newest `keep` records."""
        stream_commits.record(self.storage, self.query, batch, rows, regions)
        stream_commits.prune(self.storage, self.query, keep)
