"""In-memory copies of small generations' rows, for point lookups.

A flushed generation never changes, so its rows can be kept: a lookup then takes its row with an Arrow
slice instead of a Lance `FragmentSession.take` (a file read on local disk, a GET on an object
store).

Guarantees:

* Only a generation of one fragment without a deletion vector is copied (its `_pk_index` offsets are
  then row positions), and only when its data files and its Arrow copy each take at most
  `GENERATIONS.max_bytes // MAX_SHARE` bytes. The copy is checked once against the `_pk_index`: the
  key at every indexed offset must be the indexed key, else no copy is kept.
* A lookup never waits for a copy: the first lookup that reads a generation starts loading it on one
  background thread per process (`load` is the same, synchronous), and lookups read through Lance
  until the copy is ready.
* Copies live in `cache.GENERATIONS` under the generation's URI, declared at their Arrow size: they
  count against its byte bound (least recently used dropped first) and go with the generation's other
  entries when a read finds it garbage-collected.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait

import lance
import numpy as np
import pyarrow as pa

from memwal_df.errors import NotFoundError
from memwal_df.pools import shared_pool
from memwal_df.read.lsm.cache import GENERATIONS
from memwal_df.read.lsm.keys import encode_keys
from memwal_df.read.lsm.levels import GenerationLevel

__all__ = ["MAX_SHARE", "cached_rows", "load", "take", "wait_for_loads"]

MAX_SHARE = 8
"""A generation is copied only if it takes at most this fraction (1 / MAX_SHARE) of the cache bound."""

_NAME = "rows"
_NOT_KEPT = object()  # cached for generations that are not copied: they are not tried again
_loading: dict[str, Future[None]] = {}
_lock = threading.Lock()


def _limit() -> int:
    bound = GENERATIONS.max_bytes
    return 0 if bound is None else bound // MAX_SHARE


def cached_rows(
    level: GenerationLevel, ds: lance.LanceDataset, values: pa.Array, ids: np.ndarray, primary_key: list[str]
) -> pa.Table | None:
    """The generation's rows in memory (every column, in fragment-0 order), or None: not copied (yet).
    `values` / `ids` are its `_pk_index` (sorted keys, fragment-0 offsets). Without a copy and none
    being loaded, starts loading one in the background."""
    found = GENERATIONS.peek(level.uri, _NAME)
    if found is not None:
        return None if found is _NOT_KEPT else found
    with _lock:
        if level.uri in _loading or _limit() == 0:
            return None
        job = shared_pool("generation-rows", 1).submit(load, level, ds, values, ids, primary_key)
        _loading[level.uri] = job
    job.add_done_callback(lambda _: _finished(level.uri))
    return None


def _finished(uri: str) -> None:
    with _lock:
        _loading.pop(uri, None)


def load(
    level: GenerationLevel, ds: lance.LanceDataset, values: pa.Array, ids: np.ndarray, primary_key: list[str]
) -> None:
    """Copy the generation's rows into `GENERATIONS` if it qualifies (see the module docstring). After
    a store error (OSError) a later lookup tries again; a generation that is gone or cannot be one
    Arrow table is not tried again."""
    limit = _limit()
    try:
        fragments = ds.get_fragments()
        if (
            len(fragments) != 1
            or fragments[0].fragment_id != 0
            or fragments[0].metadata.deletion_file is not None
            or sum(f.file_size_bytes or 0 for f in fragments[0].data_files()) > limit
        ):
            GENERATIONS.put(level.uri, _NAME, _NOT_KEPT)
            return
        rows = ds.to_table().combine_chunks()
    except (OSError, NotFoundError):
        return  # a store error: a later lookup tries again
    except (ValueError, pa.ArrowException):  # collected (Lance: "Not found"), or not one Arrow table
        GENERATIONS.put(level.uri, _NAME, _NOT_KEPT)
        return
    if rows.nbytes > limit or not _matches_index(rows, values, ids, primary_key):
        GENERATIONS.put(level.uri, _NAME, _NOT_KEPT)
        return
    GENERATIONS.put(level.uri, _NAME, rows, rows.nbytes)


def _matches_index(rows: pa.Table, values: pa.Array, ids: np.ndarray, primary_key: list[str]) -> bool:
    """Whether the key at every `_pk_index` offset of `rows` is the key the index lists there."""
    if len(ids) != rows.num_rows or (len(ids) and int(ids.max()) >= rows.num_rows):
        return False
    at = encode_keys(rows.take(pa.array(ids.astype(np.int64))), primary_key)
    if at.type != values.type:
        try:
            at = at.cast(values.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return False
    return at.equals(values)


def take(rows: pa.Table, offsets: np.ndarray, columns: list[str]) -> pa.Table:
    """`columns` of the rows at `offsets` (strictly increasing) of an in-memory copy."""
    picked = rows.slice(int(offsets[0]), 1) if len(offsets) == 1 else rows.take(pa.array(offsets))
    return picked.select(columns)


def wait_for_loads() -> None:
    """Wait until every copy being loaded is kept or given up (for tests)."""
    with _lock:
        jobs = list(_loading.values())
    wait(jobs)
