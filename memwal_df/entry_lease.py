"""Commits of the MemWAL index entry that never lower merge progress: a fenced lease.

Lance 14 rebases a `CreateIndex` of `__lance_mem_wal` over a merge commit (`merge_insert` with
`mark_sstables_as_compacted`) that lands between the entry writer's read version `L` and its commit
`C`, without a conflict; the rebased entry replaces the merge's one whole, so version `C` shows the
merge progress of `L`. Merge progress read from the newest version would go backwards and Lance's
"Stale SSTable compaction" check (made against the newest entry) would let a generation merge again.

Entry writers (`memwal_index.replace_details`: index builder, catch-up record) therefore run inside
`exclusive()`, and mergers call `admit()` between pinning their read version and committing:

- the **lease** is the newest of `_mem_wal/_entry_lease/{epoch:020}.json` (created with
  put-if-not-exists; `{holder, expires_ms, released}`); it is *active* while neither released nor
  expired;
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
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta

import lance
import lance.commit
from lance.dataset import LanceOperation

from memwal_df import layout
from memwal_df.errors import CommitConflictError, CorruptManifestError, NotFoundError
from memwal_df.storage import EXISTED, Storage

LEASE_DIR = layout.ENTRY_LEASE_DIR
DEFAULT_TTL = timedelta(seconds=60)
FENCE_MESSAGE = "memwal_df: MemWAL index entry fence"
_FENCE_ATTEMPTS = 20
_POLL_SECONDS = (0.01, 0.2)  # first and longest wait between looks at an active lease


@dataclass(frozen=True)
class Lease:
    """One epoch of the entry-writer lease."""

    epoch: int
    holder: str
    expires_ms: int
    released: bool = False

    def active(self, now_ms: int) -> bool:
        return not self.released and now_ms < self.expires_ms

    def encode(self) -> bytes:
        body = {"holder": self.holder, "expires_ms": self.expires_ms, "released": self.released}
        return json.dumps(body, sort_keys=True).encode()


def _path(epoch: int) -> str:
    return f"{LEASE_DIR}/{epoch:020d}.json"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _epochs(storage: Storage) -> list[int]:
    """Every lease epoch on storage, ascending."""
    names = storage.list_dir(LEASE_DIR)
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def current(storage: Storage) -> Lease | None:
    """The newest lease epoch, or None when no entry writer ever took the lease."""
    while True:
        epochs = _epochs(storage)
        if not epochs:
            return None
        try:
            raw = storage.get(_path(epochs[-1]))
        except NotFoundError:
            continue  # a newer epoch was taken and released meanwhile, which pruned this one
        try:
            body = json.loads(raw)
            return Lease(epochs[-1], str(body["holder"]), int(body["expires_ms"]), bool(body["released"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptManifestError(f"entry lease cannot be decoded ({e})", _path(epochs[-1])) from e


def fence(uri: str, storage_options: dict[str, str] | None) -> int:
    """Commit a no-op `Merge` (same fragments, same schema) on the latest version; returns its version.

    Lance conflicts it with any commit that lands between its read and its commit, so it is retried
    on a fresh read; `CommitConflictError` after `_FENCE_ATTEMPTS` lost races."""
    for _ in range(_FENCE_ATTEMPTS):
        ds = lance.dataset(uri, storage_options=storage_options)
        op = LanceOperation.Merge([f.metadata for f in ds.get_fragments()], ds.lance_schema)
        try:
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


def _wait_while_active(storage: Storage, lease: Lease) -> Lease | None:
    """Poll until `lease` is no longer the active newest epoch; the newest lease then."""
    delay = _POLL_SECONDS[0]
    cur: Lease | None = lease
    while cur is not None and cur.active(now := _now_ms()):
        time.sleep(min(delay, max(0.0, (cur.expires_ms - now) / 1000)))
        delay = min(2 * delay, _POLL_SECONDS[1])
        cur = current(storage)
    return cur


def _take(storage: Storage, after: Lease | None, holder: str, ttl: timedelta, released: bool) -> Lease | None:
    """Create the epoch after `after`; the new lease, or None if another process created it first."""
    expires = _now_ms() + int(ttl / timedelta(milliseconds=1))
    lease = Lease((after.epoch if after else 0) + 1, holder, expires, released)
    return None if storage.create(_path(lease.epoch), lease.encode()) == EXISTED else lease


def acquire(storage: Storage, ttl: timedelta | None = None) -> Lease:
    """Take the lease for `ttl` (default `DEFAULT_TTL`): wait while another is active, then create
    the next epoch."""
    holder, ttl = str(uuid.uuid4()), DEFAULT_TTL if ttl is None else ttl
    while True:
        cur = _wait_while_active(storage, current(storage))
        got = _take(storage, cur, holder, ttl, released=False)
        if got is not None:
            return got


def release(storage: Storage, lease: Lease) -> None:
    """Mark `lease` released and delete the epochs before it (only the newest epoch counts)."""
    storage.put(_path(lease.epoch), replace(lease, released=True).encode())
    for epoch in _epochs(storage):
        if epoch < lease.epoch:
            storage.delete(_path(epoch))


@contextlib.contextmanager
def exclusive(
    storage: Storage, uri: str, storage_options: dict[str, str] | None, ttl: timedelta | None = None
) -> Iterator[int]:
    """Hold the lease and fence out merges read before it; yields the fence's version. Read the
    details to commit only inside (at or after that version), and commit before leaving."""
    lease = acquire(storage, ttl)
    try:
        yield fence(uri, storage_options)
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
        fence(uri, storage_options)
        _take(storage, cur, "takeover", timedelta(0), released=True)
    return False
