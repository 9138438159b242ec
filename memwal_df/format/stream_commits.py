"""Committed micro-batches of streaming queries: `_mem_wal/_streams/{query}/{batch:020}.json`.

A streaming sink records each micro-batch it committed to the table as one small file, created
put-if-not-exists (atomic and durable when `record` returns), under the query's id (the id Spark keeps
across restarts from the same checkpoint). A query commits its batches in increasing order and
starts a batch only after the previous one committed, so "batch `b` is committed" is "the newest
recorded batch is `>= b`": `prune` may therefore delete all but the newest records of a query without
changing any answer, which keeps a query's directory at a few files.

Body: `{"batch", "committed_ms", "rows", "regions"}` (rows written, regions touched). Whether a
batch is committed is read from the file names only; `committed_ms` of a query's newest record
tells garbage collection when the query last committed.

**Retention** (`remove_stopped`, run by `memwal_df.jobs.garbage.gc`): a query whose newest record
was committed more than the retention ago (`DEFAULT_RETENTION`, 7 days) counts as stopped, and all
its records are deleted, as Kafka drops a consumer group's offsets after its retention. Exactly-once
then holds only for queries restarted within the retention: a query restarted from its checkpoint
after it lost its records no longer skips the one batch its driver may have committed to the table
but not to the checkpoint (it died in between) — that batch is applied again when Spark replays it
(idempotent upserts and deletes, but it can overwrite what other writers wrote to those keys since).
A query that restarts while GC removes its records is in the same position.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta

from memwal_df.errors import InvalidArgumentError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.storage import CREATED, Storage

log = logging.getLogger(__name__)

_SUFFIX = ".json"
DEFAULT_RETENTION = timedelta(days=7)


def query_id(value: object) -> str:
    """`value` as a streaming query id (a UUID, in its canonical text), else `InvalidArgumentError`."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise InvalidArgumentError(f"a streaming query id must be a UUID, got {value!r}") from None


def _path(query: str, batch: int) -> str:
    if batch < 0:
        raise InvalidArgumentError(f"a micro-batch id must be >= 0, got {batch}")
    return f"{layout.stream_dir(query)}/{batch:020d}{_SUFFIX}"


def batches(storage: Storage, query: str) -> list[int]:
    """The recorded micro-batches of `query`, ascending (after `prune`: only the newest)."""
    names = storage.list_dir(layout.stream_dir(query))
    stems = [n.removesuffix(_SUFFIX) for n in names if n.endswith(_SUFFIX)]
    return sorted(int(s) for s in stems if s.isdigit())


def last_committed(storage: Storage, query: str) -> int | None:
    """The newest committed micro-batch of `query`, or None if it committed none."""
    found = batches(storage, query)
    return found[-1] if found else None


def committed(storage: Storage, query: str, batch: int) -> bool:
    """Whether micro-batch `batch` of `query` was committed (it, or a later batch, is recorded)."""
    last = last_committed(storage, query)
    return last is not None and batch <= last


def record(storage: Storage, query: str, batch: int, rows: int, regions: int) -> bool:
    """Record micro-batch `batch` of `query` as committed; True if this call created the record,
    False if it existed (a replayed commit)."""
    body = {"batch": batch, "committed_ms": int(time.time() * 1000), "rows": rows, "regions": regions}
    return storage.create(_path(query, batch), json.dumps(body, sort_keys=True).encode()) == CREATED


def prune(storage: Storage, query: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` (>= 1) records of `query`; the batches deleted."""
    if keep < 1:
        raise InvalidArgumentError(f"keep must be >= 1, got {keep}")
    old = batches(storage, query)[:-keep]
    for batch in old:
        storage.delete(_path(query, batch))
    return old


def queries(storage: Storage) -> list[str]:
    """The streaming queries that have records, by id (directory names that are not query ids are
    left out)."""
    found = []
    for name in storage.list_dir(layout.STREAMS_DIR):
        try:
            found.append(query_id(name))
        except InvalidArgumentError:
            continue
    return found


def last_committed_at(storage: Storage, query: str) -> float | None:
    """When (unix seconds) the newest recorded batch of `query` was committed: its `committed_ms`.
    None if `query` has no record or its newest record cannot be decoded (it is then kept)."""
    while True:
        found = batches(storage, query)
        if not found:
            return None
        path = _path(query, found[-1])
        try:
            body = json.loads(storage.get(path))
            return int(body["committed_ms"]) / 1000
        except NotFoundError:
            continue  # pruned by the running query meanwhile: it committed a newer batch
        except (ValueError, KeyError, TypeError) as e:
            log.warning("stream commit record %s ignored: %s", path, e)
            return None


def remove_stopped(storage: Storage, retention: timedelta, now: float) -> list[str]:
    """Delete every record of each query whose newest batch was committed more than `retention`
    before `now` (unix seconds); the ids of those queries. See "Retention" in the module docstring."""
    if retention < timedelta(0):
        raise InvalidArgumentError(f"the stream commit retention must not be negative, got {retention}")
    removed = []
    for query in queries(storage):
        last = last_committed_at(storage, query)
        if last is not None and last < now - retention.total_seconds():
            storage.delete_prefix(layout.stream_dir(query))
            removed.append(query)
    return removed
