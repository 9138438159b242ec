"""Accepted writes into the WAL and the active MemTable: group commit, the WAL buffer and its thread.

Durable mode (`durable_write`): a write joins the group of writes waiting for the next WAL entry; one
of them appends the group as one entry, outside the lock, and the group's rows reach the MemTable only
once that entry is stored. Every write returns (or raises the append's error) after that.
Non-durable mode: a write goes into the MemTable at once and into the WAL buffer, which becomes one
WAL entry by size, count or age; the WAL thread appends those entries in order.

Guarantees: one appender at a time, so WAL positions follow write order and the MemTable holds rows
in WAL order; a durable write that returned is stored; a WAL entry of a newer MemTable is never stored
before an older sealed MemTable holding unlogged writes is committed as a generation (a crash loses
only the newest writes); a WAL position taken by another epoch fences the writer; an entry of ours
found at the position (an append that raised but landed) is adopted, never written twice; a
read-modify-write (`exclusive`) reads after every earlier accepted write reached the MemTable and
writes before any later one is accepted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pyarrow as pa

from memwal_df.errors import BackpressureTimeoutError, MemWalError, WriterFencedError
from memwal_df.format.wal import Wal, WalEntry, encode_entry
from memwal_df.write.claim import conform_replayed
from memwal_df.write.memtable import MemTable
from memwal_df.write.memtable_index import BackgroundIndexer
from memwal_df.write.region_state import RegionState
from memwal_df.write.writer_config import WriterConfig

log = logging.getLogger(__name__)


class WalCommitter:
    """Takes a region writer's accepted batches into its WAL and its active MemTable."""

    def __init__(
        self, state: RegionState, wal: Wal, config: WriterConfig, indexer: BackgroundIndexer | None
    ) -> None:
        self._state = state
        self._wal = wal
        self._config = config
        self._indexer = indexer  # None: index on the write path (`indexed_write`)
        self._joining: _Group | None = None  # durable mode: the writes waiting for the next entry

    def write(self, batch: pa.RecordBatch) -> None:
        """Accept one validated batch (WAL schema); in durable mode, return once it is stored."""
        if self._config.durable_write:
            with self._state.cond:
                group, generation = self._join(batch)
            self._complete(group, generation)
            return
        with self._state.cond:
            self._buffer(batch)

    def exclusive(self, incoming: int) -> ExclusiveSection:
        """Enter the region's exclusive section for a read-modify-write in steps: it returns once every
        earlier accepted write is in the active MemTable (and `incoming` bytes fit), and no other write
        is accepted until `accept` or `leave`, which the caller must make in this thread. A caller
        holding several regions' sections enters them in one order (region id), as every caller does."""
        state = self._state
        state.cond.acquire()
        try:
            state.check_usable()
            while True:
                self._wait_for_room(incoming)
                if not self._config.durable_write or (not state.appending and self._joining is None):
                    break
                state.cond.wait()  # a durable group in flight: its rows are not in the MemTable yet
                state.check_usable()
        except BaseException:
            state.cond.release()
            raise
        return ExclusiveSection(state.cond, self._accept)

    def _accept(self, batch: pa.RecordBatch | None) -> Callable[[], None]:
        """Take the batch of a read-modify-write (caller holds the lock, in the exclusive section);
        the call that finishes it."""
        if batch is None or batch.num_rows == 0:
            return _done
        if not self._config.durable_write:
            self._buffer(batch, room_checked=True)
            return _done
        group, generation = self._join(batch, room_checked=True)  # leads: nothing is in flight
        return lambda: self._complete(group, generation)

    def _buffer(self, batch: pa.RecordBatch, room_checked: bool = False) -> None:
        """Non-durable mode: take the batch into the WAL buffer and the MemTable (caller holds the lock)."""
        state = self._state
        state.check_usable()
        if not room_checked:
            self._wait_for_room(batch.nbytes)
        if not state.pending:
            state.pending_since = time.monotonic()
        state.pending.append(batch)
        state.pending_bytes += batch.nbytes
        if self._wal_buffer_full():
            self._close_entry()
        if len(state.pending) <= 1:
            state.cond.notify_all()  # the WAL loop starts its timer, or appends
        self._add([batch])

    def _join(self, batch: pa.RecordBatch, room_checked: bool = False) -> tuple[_Group, int | None]:
        """Durable mode, group commit (caller holds the lock): the batch joins the group of writes
        waiting for the next WAL entry; the first of them to find no append in flight leads it.
        Returns the group and, for its leader, the generation of the MemTable the entry belongs to
        (None: another write led the group, which is done)."""
        state = self._state
        state.check_usable()
        if not room_checked:
            self._wait_for_room(batch.nbytes)
        group = self._joining
        if group is None:
            group = self._joining = _Group()
        group.batches.append(batch)
        while state.appending and not group.done:
            state.cond.wait()
        if group.done:
            return group, None
        self._joining = None
        try:
            state.check_usable()
        except MemWalError as e:
            group.finish(e)
            state.cond.notify_all()
            raise
        state.appending = True
        return group, state.active.generation

    def _complete(self, group: _Group, generation: int | None) -> None:
        """Durable mode, without the lock: the leader appends the group as one WAL entry and adds it
        to the MemTable; every write of the group returns (or raises the append's error) once that
        entry is stored. A writer used from one thread writes one entry per write."""
        if generation is not None:
            state = self._state
            error: BaseException | None = None
            try:
                self._append_wal(group.batches, generation)
            except BaseException as e:
                error = e
            with state.cond:
                state.appending = False
                if error is None:
                    self._add(group.batches)
                group.finish(error)
                state.cond.notify_all()
        group.result()

    def _add(self, batches: list[pa.RecordBatch]) -> None:
        """Add accepted (durable mode: stored) batches to the active MemTable (caller holds the lock)."""
        state = self._state
        for batch in batches:
            state.active.append(batch)
            state.stats["rows"] += batch.num_rows
        self._index(state.active)
        if self._config.durable_write:
            state.active.last_wal_position = state.next_position - 1
        if self._memtable_full():
            state.seal()

    def _index(self, memtable: MemTable) -> None:
        """Index the MemTable's new rows now (`indexed_write`) or on the background indexer."""
        if not memtable.indexes:
            return
        if self._indexer is None:
            memtable.indexes.catch_up(memtable.batches, len(memtable.batches))
        else:
            self._indexer.submit(memtable.indexes, memtable.batches)

    def _append_wal(self, batches: list[pa.RecordBatch], generation: int) -> None:
        """Publish one WAL entry of the MemTable `generation` at the next position, without the lock.
        The caller is the only appender: the leader of a durable write group, or the WAL thread
        (non-durable mode: `batches` is the oldest ready entry, trimmed of what an adopted entry
        already holds)."""
        state = self._state
        while True:
            data = encode_entry(batches, state.epoch, generation)
            position = state.next_position
            if self._wal.append(position, data):
                break
            other = self._wal.read(position)
            if other is None or other.is_sentinel or other.writer_epoch != state.epoch:
                epoch = other.writer_epoch if other is not None else "?"
                raise state.fence(f"WAL position {position} was taken by a writer with epoch {epoch}")
            # Our own earlier append, which raised (a failed fsync, a lost answer) but landed: it is
            # durable and every replay includes it, so this writer's MemTable includes it too.
            self._adopt(other)
            if not self._config.durable_write:  # the adopted entry holds the first batches of this one
                del batches[: len(other.batches)]
                if not batches:
                    return
        state.next_position = position + 1
        state.stats["wal_entries"] += 1
        state.stats["wal_bytes"] += len(data)

    def _adopt(self, entry: WalEntry) -> None:
        """Take our own stored `entry` into the MemTable (durable mode: its writes failed and never
        reached it) and move the next position past it."""
        state = self._state
        with state.cond:
            if self._config.durable_write:
                for batch in entry.batches:
                    conformed = conform_replayed(state.active.schema, self._wal, batch, entry.position)
                    state.active.append(conformed)
                state.active.last_wal_position = entry.position
            state.next_position = entry.position + 1

    def _close_entry(self) -> None:
        """Make the pending batches one ready WAL entry (caller holds the lock)."""
        state = self._state
        if state.pending:
            state.ready.append((state.pending, state.active))
            state.active.unlogged_entries += 1
            state.pending = []
            state.pending_bytes = 0

    def _append_ready(self) -> None:
        """Append the oldest ready entry (WAL thread). It stays ready until it is stored: a failed
        append is retried as it was."""
        state = self._state
        batches, memtable = state.ready[0]
        self._append_wal(batches, memtable.generation)
        with state.cond:
            if state.ready and state.ready[0][0] is batches:  # (a fence may have dropped every entry)
                state.ready.popleft()
            memtable.last_wal_position = state.next_position - 1
            memtable.unlogged_entries -= 1
            state.cond.notify_all()

    def _wal_buffer_full(self) -> bool:
        return (
            len(self._state.pending) >= self._config.max_wal_buffer_batches
            or self._state.pending_bytes >= self._config.max_wal_buffer_size
        )

    def _memtable_full(self) -> bool:
        a = self._state.active
        return (
            a.num_rows >= self._config.max_memtable_rows
            or a.nbytes >= self._config.max_memtable_size
            or len(a.batches) >= self._config.max_memtable_batches
        )

    def _wait_for_room(self, incoming: int) -> None:
        """Backpressure: wait (caller holds the lock) while sealed MemTables hold too many bytes."""
        state, config = self._state, self._config
        deadline = time.monotonic() + config.backpressure_timeout_s
        while state.sealed and state.unflushed_bytes() + incoming > config.max_unflushed_memtable_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackpressureTimeoutError(
                    f"region {state.region_id}: {state.unflushed_bytes()} unflushed bytes exceed "
                    f"max_unflushed_memtable_bytes={config.max_unflushed_memtable_bytes} for "
                    f"{config.backpressure_timeout_s}s; MemTable flushes are not keeping up"
                )
            state.cond.wait(min(left, 0.1))
            state.check_usable()

    def _wal_blocked(self) -> bool:
        """Whether the oldest ready entry must wait: an older sealed MemTable holds writes that no
        WAL entry holds and its generation is not committed yet (this entry first would let a crash
        keep newer writes and lose older ones). Caller holds the lock."""
        generation = self._state.ready[0][1].generation
        return any(m.unlogged_tail and m.generation < generation for m in self._state.sealed)

    def run_wal_thread(self) -> None:
        """Non-durable mode (the WAL thread): append ready entries in order, and make the pending
        batches one when the oldest is `max_wal_flush_interval_ms` old. Appends run without the
        lock: puts go on. Returns once the writer is closed or fenced."""
        state = self._state
        interval = self._config.max_wal_flush_interval_ms / 1000
        while True:
            with state.cond:
                if state.closed or state.error is not None:
                    return
                if not state.ready:
                    if not state.pending:
                        state.cond.wait()  # `write` notifies when the first pending batch arrives
                        continue
                    left = state.pending_since + interval - time.monotonic()
                    if left > 0:
                        state.cond.wait(left)
                        continue
                    self._close_entry()
                if self._wal_blocked():
                    state.cond.wait()  # until the older generation commits
                    continue
            try:
                self._append_ready()
            except WriterFencedError:
                return
            except MemWalError as e:  # retried; flush() and close() report it meanwhile
                log.warning("WAL flush of region %s failed: %s", state.region_id, e)
                with state.cond:
                    state.flush_error = e
                    state.cond.notify_all()
                    state.cond.wait(interval)


class _Group:
    """Durable writes that go into one WAL entry, and how its append ended."""

    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []
        self.done = False
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.done, self.error = True, error

    def result(self) -> None:
        """Return if the entry was stored; raise the append's error otherwise."""
        if self.error is not None:
            raise self.error


def _done() -> None:
    """Finishes a write with nothing left to do."""


class ExclusiveSection:
    """A region's exclusive section, entered by `WalCommitter.exclusive` (its lock held): the caller
    reads the region's rows, then `accept`s the batch it built from them, or `leave`s. Either leaves
    the section, once."""

    def __init__(
        self, lock: threading.Condition, take: Callable[[pa.RecordBatch | None], Callable[[], None]]
    ) -> None:
        self._lock = lock
        self._take = take
        self._open = True

    def accept(self, batch: pa.RecordBatch | None) -> Callable[[], None]:
        """Accept `batch` (None or empty: nothing to write) and leave the section; the call returned
        finishes the write (durable mode: stores the WAL entry, or raises the append's error). It
        must be made, even after an error of the caller's own."""
        try:
            return self._take(batch)
        finally:
            self.leave()

    def leave(self) -> None:
        """Leave the section without writing (a no-op once left)."""
        if self._open:
            self._open = False
            self._lock.release()
