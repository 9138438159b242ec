"""The flush pipeline of one region writer: sealed MemTables written as generations and committed.

Up to `_FLUSH_DEPTH` of the oldest sealed MemTables of a region are written as generations at once, on
the process-wide flush pool (which bounds the generation writes of all regions together).

Guarantees: manifest commits follow strictly in generation order, each only once its generation is
written and every WAL entry holding its rows is stored, and only while the manifest still carries
this writer's epoch (`claim.commit`). A failed generation write is retried in a new directory, so a
failure never corrupts the manifest (the abandoned directory is an orphan for garbage collection); a
failed commit is retried with the generation already written. Failures are reported to `flush()`
callers through `RegionState.flush_error`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait

from memwal_df.errors import WriterFencedError
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.pools import shared_pool
from memwal_df.write.claim import commit
from memwal_df.write.generation import write_generation
from memwal_df.write.memtable import MemTable
from memwal_df.write.region_state import RegionState

log = logging.getLogger(__name__)

_FLUSH_DEPTH = 2  # sealed MemTables of one region written as generations at the same time
_FLUSH_THREADS = 8


def _flush_pool() -> ThreadPoolExecutor:
    return shared_pool("flush", _FLUSH_THREADS)


class FlushPipeline:
    """Writes a region writer's sealed MemTables as generations and commits them, on its flush thread."""

    def __init__(
        self,
        state: RegionState,
        store: RegionManifestStore,
        storage: Storage,
        data_storage_version: str,
        indexes: tuple[MaintainedIndex, ...],
        max_retries: int,
    ) -> None:
        self._state = state
        self._store = store
        self._storage = storage
        self._data_storage_version = data_storage_version
        self._indexes = indexes
        self._max_retries = max_retries
        self._writes: dict[int, Future[pb.SsTable]] = {}  # generation -> its write (flush thread only)

    def run_flush_thread(self) -> None:
        """Flush sealed MemTables until the writer is closed or fenced: up to `_FLUSH_DEPTH` of the
        oldest are written at once, their commits follow in generation order. A failed write is
        retried in a new directory (after a backoff) while newer generations already written wait
        for it; a failed commit is retried with the generation already written."""
        state = self._state
        backoff = 0.05
        while True:
            with state.cond:
                while not state.sealed and not state.closed:
                    state.cond.wait()
                if state.closed or state.error is not None:
                    return
                queue = list(state.sealed)[:_FLUSH_DEPTH]
            for memtable in queue:
                if memtable.generation not in self._writes:
                    self._writes[memtable.generation] = _flush_pool().submit(self._write_generation, memtable)
            memtable = queue[0]
            write = self._writes[memtable.generation]
            try:
                sstable = write.result()
            except Exception as e:
                del self._writes[memtable.generation]
                backoff = self._flush_failed(memtable, e, backoff)
                continue
            try:
                self._commit_generation(memtable, sstable)
            except WriterFencedError:
                return
            except Exception as e:
                backoff = self._flush_failed(memtable, e, backoff)
                continue
            del self._writes[memtable.generation]
            backoff = 0.05

    def wait_for_writes(self) -> None:
        """Wait for the generation writes started (call after the flush thread stopped): a stopped
        writer leaves no write running (the directories of uncommitted ones stay as orphans)."""
        wait(list(self._writes.values()))

    def _flush_failed(self, memtable: MemTable, error: Exception, backoff: float) -> float:
        """Report a failed flush step to `flush()` callers and wait `backoff`; the next backoff."""
        state = self._state
        log.warning(
            "flush of generation %d of region %s failed: %s", memtable.generation, state.region_id, error
        )
        with state.cond:
            state.flush_error = error
            state.cond.notify_all()
            state.cond.wait(backoff)
        return min(backoff * 2, 5.0)

    def _write_generation(self, memtable: MemTable) -> pb.SsTable:
        """Write `memtable` as a generation, retrying in a new directory up to `max_retries` times."""
        last_error: BaseException | None = None
        for _ in range(self._max_retries):
            try:
                return write_generation(
                    self._storage, self._state.region_id, memtable, self._data_storage_version, self._indexes
                )
            except (OSError, ValueError, RuntimeError) as e:  # each retry writes a new directory
                last_error = e
        assert last_error is not None
        raise last_error

    def _commit_generation(self, memtable: MemTable, sstable: pb.SsTable) -> None:
        """Commit the manifest version listing `memtable`'s generation (the oldest sealed one), once
        every WAL entry holding its rows is stored."""
        state = self._state
        with state.cond:  # the manifest may list it only once its rows are durable in the WAL
            while memtable.unlogged_entries and state.error is None and not state.closed:
                state.cond.wait()
            if memtable.unlogged_entries:
                return  # stopped or fenced first: the directory is an orphan for garbage collection
        commit(state, self._store, lambda m: _add_generation(m, sstable, memtable.last_wal_position))
        with state.cond:
            state.committed(memtable)
            state.stats["generations"] += 1
            state.cond.notify_all()


def _add_generation(m: pb.ShardManifest, sstable: pb.SsTable, last_position: int) -> bool:
    if any(s.generation == sstable.generation for s in m.sstables):
        # Generations at or above the claimed current_generation are added only by this epoch's
        # writer, in order: an earlier attempt whose commit raised although it landed listed it.
        return False
    m.replay_after_wal_entry_position = max(m.replay_after_wal_entry_position, last_position)
    m.wal_entry_position_last_seen = max(m.wal_entry_position_last_seen, last_position)
    m.current_generation = sstable.generation + 1
    m.sstables.append(sstable)
    return True
