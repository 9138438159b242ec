"""Commits of the MemWAL index entry that never lower merge progress: a fenced lease.

Lance 14 rebases a `CreateIndex` of `__lance_mem_wal` over a merge commit (`merge_insert` with
`mark_sstables_as_compacted`) that lands between the entry writer's read version `L` and its commit
`C`, without a conflict; the rebased entry replaces the merge's one whole, so version `C` shows the
merge progress of `L`. Merge progress read from the newest version would go backwards and Lance's
"Stale SSTable compaction" check (made against the newest entry) would let a generation merge again.

Entry writers (`memwal_index.replace_details`: index builder, catch-up record) therefore run inside
`exclusive()`, and mergers call `admit()` between pinning their read version and committing:

- the **lease** is the newest of `_mem_wal/_entry_lease/{epoch:020}.json` (created with
  put-if-not-exists; `{holder, expires_ms, released}`; `memwal_df.format.lease`); it is *active* while
  neither released nor expired;
- `exclusive()` takes the lease (waits while another one is active, takes an expired one over with
  the next epoch), commits a **fence** — a no-op `Merge` of the latest fragments and schema — and only
  then lets the caller read the latest details and commit. Lance conflicts every `Update` (merge or
  delete pass) and every MemWAL `CreateIndex` read before the fence and committed after it;
- `admit()` returns True when no lease is active. It waits for an active one; for an expired one it
  commits a fence first and then marks the lease released under the next epoch.

Why no merge commit `M` lands between an entry writer's read `L` (after its fence `F`) and its commit
`C`: mergers commit with Lance's conflict retries off, from a version `R` pinned before `admit()`.
If `R < F`, `M` conflicts with `F`. If `R >= F`, `M`'s `admit()` ran after the lease was taken, so it
waited for the release (after `C`), or found the lease expired and committed its own fence `F'`
first: then `C` either landed before `F'` (so before `M`) or conflicts with `F'`. No clock is needed
for this; expiry only decides when a crashed writer's lease is taken over.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta

import lance
import lance.commit
from lance.dataset import LanceOperation

from memwal_df.errors import CommitConflictError
from memwal_df.format import layout
from memwal_df.format import lease as _lease
from memwal_df.format.lease import Lease
from memwal_df.format.storage import Storage

LEASE_DIR = layout.ENTRY_LEASE_DIR
DEFAULT_TTL = timedelta(seconds=60)
FENCE_MESSAGE = "memwal_df: MemWAL index entry fence"
_FENCE_ATTEMPTS = 20


def current(storage: Storage) -> Lease | None:
    """The newest lease epoch, or None when no entry writer ever took the lease."""
    return _lease.current(storage, LEASE_DIR)


def fence(storage: Storage, uri: str, storage_options: dict[str, str] | None) -> int:
    """Commit a no-op `Merge` (same fragments, same schema) on the latest version; returns its version,
    durable (`storage` is the table's).

    Lance conflicts it with any commit that lands between its read and its commit, so it is retried
    on a fresh read; `CommitConflictError` after `_FENCE_ATTEMPTS` lost races."""
    for _ in range(_FENCE_ATTEMPTS):
        ds = lance.dataset(uri, storage_options=storage_options)
        op = LanceOperation.Merge([f.metadata for f in ds.get_fragments()], ds.lance_schema)
        try:
            with storage.synced_changes(skip=layout.NOT_BASE):
                done = lance.LanceDataset.commit(
                    uri,
                    op,
                    read_version=ds.version,
                    storage_options=storage_options,
                    max_retries=0,
                    commit_message=FENCE_MESSAGE,
                )
        except lance.commit.CommitConflictError:
            continue
        except OSError as e:
            if "Too many concurrent writers" in str(e):
                continue
            raise
        return int(done.version)
    raise CommitConflictError(f"the MemWAL entry fence lost {_FENCE_ATTEMPTS} commit races in a row")


def _wait_while_active(storage: Storage, lease: Lease | None) -> Lease | None:
    """Poll until `lease` is no longer the active newest epoch; the newest lease then."""
    return _lease.wait_while_active(storage, LEASE_DIR, lease)


def acquire(storage: Storage, ttl: timedelta | None = None) -> Lease:
    """Take the lease for `ttl` (default `DEFAULT_TTL`) under a fresh holder name: wait while
    another is active, then create the next epoch."""
    return _lease.acquire(storage, LEASE_DIR, str(uuid.uuid4()), DEFAULT_TTL if ttl is None else ttl)


def release(storage: Storage, lease: Lease) -> None:
    """Mark `lease` released and delete the epochs before it (only the newest epoch counts)."""
    _lease.release(storage, LEASE_DIR, lease)


@contextlib.contextmanager
def exclusive(
    storage: Storage, uri: str, storage_options: dict[str, str] | None, ttl: timedelta | None = None
) -> Iterator[int]:
    """Hold the lease and fence out merges read before it; yields the fence's version. Read the
    details to commit only inside (at or after that version), and commit before leaving."""
    lease = acquire(storage, ttl)
    try:
        yield fence(storage, uri, storage_options)
    finally:
        release(storage, lease)


def admit(storage: Storage, uri: str, storage_options: dict[str, str] | None) -> bool:
    """For a merger holding a pinned read version: True if it may commit from it now; False after
    waiting for (or fencing out) an entry writer, in which case it must pin a new version first."""
    cur = current(storage)
    if cur is None or cur.released:
        return True
    cur = _wait_while_active(storage, cur)
    if cur is not None and not cur.released:  # expired: its holder may still commit, fence it out
        fence(storage, uri, storage_options)
        _lease.take(storage, LEASE_DIR, cur, "takeover", timedelta(0), released=True)
    return False
