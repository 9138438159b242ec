"""The state one region writer's parts share, owned here and guarded by one condition variable.

`RegionState` holds everything the caller threads, the WAL thread and the flush thread of a region
writer read or change: the MemTables (active and sealed), the next WAL position, the non-durable WAL
buffer, the manifest last committed, the fatal error and the closed flag. Fields change under `cond`
(a re-entrant lock), except the next WAL position and the WAL statistics, which only the single
appender changes (the leader of a durable write group, or the WAL thread), and the put and delete
counters; whoever needs a consistent view holds `cond`. Every change a waiter may be waiting for is
followed by `cond.notify_all()`.

It also holds the two transitions that touch both the MemTables and the WAL buffer and must happen in
one critical section: `seal` (the active MemTable becomes the oldest unflushed one) and `fence` (this
writer lost the region: every later call raises, carrying the rows it accepted but never made durable).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Sequence

import pyarrow as pa

from memwal_df.errors import MemWalError, WriterClosedError, WriterFencedError
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.schema import TableSchema
from memwal_df.write.key_directory import KEY_BYTES, KeyDirectory
from memwal_df.write.memtable import MemTable

KEPT_FLUSHED_BYTES = 64 * 1024 * 1024
"""The bytes a region writer keeps of generations in memory for its own lookups: their rows, the
one-chunk copies of their newest rows and their keys' entries in the key directory."""


class RegionState:
    """The shared, lock-guarded state of one region writer, as it stands after claiming `manifest`."""

    def __init__(
        self,
        region_id: uuid.UUID,
        schema: TableSchema,
        indexes: tuple[MaintainedIndex, ...],
        manifest: pb.ShardManifest,
    ) -> None:
        self.region_id = region_id
        self._schema = schema
        self._indexes = indexes
        self.cond = threading.Condition(threading.RLock())
        self.epoch = manifest.writer_epoch
        self.manifest = manifest  # the version this writer committed (or found) last
        self.active = self.new_memtable(manifest.current_generation)
        self.sealed: deque[MemTable] = deque()  # oldest first, each until its generation is committed
        # Once the writer made a partial or conditional write (`keep_flushed`): the MemTables it
        # committed as generations (sealed, so unchanging), newest `KEPT_FLUSHED_BYTES` of rows of
        # them, oldest first, for its lookups.
        self.keep_flushed = False
        self.flushed: deque[MemTable] = deque()
        # Where the newest row of each key is among the MemTables above, for the same lookups (built
        # by the first one).
        self.key_directory = KeyDirectory()
        self.next_position = manifest.replay_after_wal_entry_position + 1
        # Non-durable mode: accepted batches collect in `pending` until a threshold makes them one
        # WAL entry in `ready` (sealing the MemTable makes them its `unlogged_tail` instead, made
        # durable by its generation alone), with the MemTable holding its rows; the WAL thread alone
        # appends ready entries, in order, outside the lock: puts never wait for storage.
        self.pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0
        self.pending_since = 0.0
        self.ready: deque[tuple[list[pa.RecordBatch], MemTable]] = deque()
        self.appending = False  # durable mode: a group's WAL append is in flight
        self.error: MemWalError | None = None  # a fatal error (fencing): every later call raises it
        self.flush_error: BaseException | None = None  # last failed background write (retried)
        self.closed = False
        self.stats = {"puts": 0, "deletes": 0, "rows": 0, "wal_entries": 0, "wal_bytes": 0, "generations": 0}

    def new_memtable(self, generation: int) -> MemTable:
        """An empty MemTable of this region's table for `generation`."""
        return MemTable(generation, self._schema.wal, self._schema.primary_key, self._indexes)

    def check_usable(self) -> None:
        """Raise the fatal error once fenced, `WriterClosedError` once closed."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise WriterClosedError(f"the writer of region {self.region_id} is closed")

    def unflushed_bytes(self) -> int:
        """Bytes of the MemTables not yet committed as generations (caller holds the lock)."""
        return self.active.nbytes + sum(m.nbytes for m in self.sealed)

    def seal(self) -> None:
        """Close the active MemTable and queue it for flushing (caller holds the lock). Its buffered
        (non-durable) writes get no WAL entry: its generation makes them durable, and newer WAL
        entries wait for that commit (`WalCommitter`), so a crash still loses only the newest writes.
        Waits for a durable append in flight, whose rows belong to the active MemTable."""
        while self.appending:
            self.cond.wait()
        if self.active.num_rows == 0:
            return
        self.active.unlogged_tail, self.pending, self.pending_bytes = self.pending, [], 0
        self.active.seal()
        self.sealed.append(self.active)
        self.active = self.new_memtable(self.active.generation + 1)
        self.active.last_wal_position = self.next_position - 1
        self.cond.notify_all()

    def committed(self, memtable: MemTable) -> None:
        """`memtable` (the oldest sealed one) is committed as a generation (caller holds the lock): it
        leaves `sealed`, and its rows are kept in `flushed` if `keep_flushed`, dropping the oldest
        kept ones beyond `KEPT_FLUSHED_BYTES`."""
        assert self.sealed[0] is memtable
        self.sealed.popleft()
        if not self.keep_flushed:
            return
        self.flushed.append(memtable)  # (sealed: its rows no longer change)
        kept = sum(map(_kept_bytes, self.flushed))
        while kept > KEPT_FLUSHED_BYTES:
            kept -= _kept_bytes(self.flushed.popleft())

    def keep_loaded(self, memtables: Sequence[MemTable]) -> None:
        """Keep `memtables` (generations read back from storage, newest first, each older than every
        MemTable held) in `flushed`, as many as `KEPT_FLUSHED_BYTES` leaves room for (caller holds
        the lock)."""
        kept = sum(map(_kept_bytes, self.flushed))
        for memtable in memtables:
            kept += _kept_bytes(memtable)
            if kept > KEPT_FLUSHED_BYTES:
                return
            self.flushed.appendleft(memtable)

    def fence(self, reason: str) -> WriterFencedError:
        """Record that a newer epoch owns the region: drop the WAL buffer and return the error every
        later call raises (the first one recorded), carrying the rows no WAL entry or committed
        generation holds, in write order."""
        with self.cond:
            lost: list[pa.RecordBatch] = []
            committed = {s.generation for s in self.manifest.sstables}
            for m in [*self.sealed, self.active]:
                lost += [b for batches, owner in self.ready if owner is m for b in batches]
                if m.generation not in committed:
                    lost += m.unlogged_tail
            lost += self.pending
            self.ready, self.pending = deque(), []
            not_durable = pa.Table.from_batches(lost, schema=self._schema.wal) if lost else None
            err = WriterFencedError(
                f"writer of region {self.region_id} (epoch {self.epoch}) is fenced: {reason}", not_durable
            )
            if self.error is None:
                self.error = err
            self.cond.notify_all()
            return err


def _kept_bytes(memtable: MemTable) -> int:
    """What keeping a flushed MemTable costs: its rows, its one-chunk newest rows once made, and its
    keys' entries in the key directory."""
    return memtable.held_bytes + KEY_BYTES * memtable.num_keys
