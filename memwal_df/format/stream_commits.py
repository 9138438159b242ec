"""Committed micro-batches of streaming queries: `_mem_wal/_streams/{query}/{batch:020}.json`.

A streaming sink records each micro-batch it committed to the table as one small file, created
put-if-not-exists (atomic and durable when `record` returns), under the query's id (the id Spark keeps
across restarts from the same checkpoint). A query commits its batches in increasing order and
starts a batch only after the previous one committed, so "batch `b` is committed" is "the newest
recorded batch is `>= b`": `prune` may therefore delete all but the newest records of a query without
changing any answer, which keeps a query's directory at a few files.

Body: `{"batch", "committed_ms", "rows", "regions"}` (rows written, regions touched), for people
looking at the table; only the file names are read back.
"""

from __future__ import annotations

import json
import time
import uuid

from memwal_df.errors import InvalidArgumentError
from memwal_df.format import layout
from memwal_df.format.storage import CREATED, Storage

_SUFFIX = ".json"


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
