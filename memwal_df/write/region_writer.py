"""The region writer: the single, epoch-fenced writer of one region.

Life cycle (spec "Writer Expectations", Lance 14's protocol):
1. Claim: load the latest region manifest and commit a copy with `writer_epoch + 1` (a new region
   starts at version 1, epoch 1). Losing the put-if-not-exists race means another claimer won: reload
   and try again with a higher epoch.
2. Replay: read WAL entries from `replay_after_wal_entry_position + 1` until a position is missing and
   rebuild the MemTable from them (sentinels skipped; entries of fenced or crashed writers included).
   An existing region then gets a fence sentinel at the first free position and a second manifest
   version whose `wal_entry_position_last_seen` is the sentinel's position.
3. Write: validate, append to the WAL (durable mode: before returning, concurrent writes sharing an
   entry; otherwise batched by size, count and time), add to the MemTable.
4. MemTable flush (background, or `flush()`/`close()`): seal the MemTable, write it as a generation
   (up to `_FLUSH_DEPTH` of a region at once), then, in generation order and once every WAL entry
   holding its rows is stored, commit a manifest version that lists it, after checking the epoch is
   still ours.

Guarantees: a write that returned in durable mode is in the WAL and survives any crash; a writer whose
WAL position or manifest shows a newer epoch raises `WriterFencedError` on every later call, carrying
the rows it accepted but never made durable; a failed generation write retries in a new directory and
never corrupts the manifest.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import (
    BackpressureTimeoutError,
    CorruptWalEntryError,
    MemWalError,
    RegionRoutingError,
    WriterClosedError,
    WriterFencedError,
)
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.manifest import RegionManifestStore, new_manifest, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.schema import TableSchema, delete_batch, upsert_chunks, with_tombstone
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal, WalEntry, encode_entry, encode_fence_sentinel
from memwal_df.pools import shared_pool
from memwal_df.write.generation import write_generation
from memwal_df.write.memtable import MemTable, MemTableSnapshot
from memwal_df.write.memtable_index import BackgroundIndexer

log = logging.getLogger(__name__)

# Sealed MemTables of one region written as generations at the same time (their commits stay in
# order); the process-wide pool bounds the generation writes of all regions together.
_FLUSH_DEPTH = 2
_FLUSH_THREADS = 8


def _flush_pool() -> ThreadPoolExecutor:
    return shared_pool("flush", _FLUSH_THREADS)


@dataclass(frozen=True)
class WriterConfig:
    """Writer settings; names and defaults follow Lance's `writer_config_defaults`.

    `durable_write`: a write returns after its WAL entry is stored; otherwise entries are batched by
    size (`max_wal_buffer_size`), count (`max_wal_buffer_batches`) and age (`max_wal_flush_interval_ms`).
    `indexed_write`: a write returns after the MemTable's vector and full-text indexes (of the
    maintained indexes, `memwal_df.format.maintained_indexes`) include its rows; otherwise a background
    thread indexes
    them, and a search indexes what that thread has not reached yet, so searches see every write either
    way. The key index and bloom filter catch up whenever they are read, in both modes.
    """

    durable_write: bool = True
    indexed_write: bool = True
    max_wal_buffer_size: int = 10 * 1024 * 1024
    max_wal_buffer_batches: int = 1024
    max_wal_flush_interval_ms: int = 100
    max_memtable_size: int = 256 * 1024 * 1024
    max_memtable_rows: int = 100_000
    max_memtable_batches: int = 8000
    max_unflushed_memtable_bytes: int = 1024 * 1024 * 1024
    manifest_scan_batch_size: int = 2
    backpressure_timeout_s: float = 120.0
    max_flush_retries: int = 3

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, str], **overrides: Any) -> WriterConfig:
        """Config from a MemWAL index's `writer_config_defaults` map, then explicit overrides."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = "durable_write" if f.name == "durable_write" else f.name
            if key in defaults:
                raw = defaults[key]
                values[f.name] = (
                    raw.lower() == "true" if f.type in (bool, "bool") else type(getattr(cls, f.name))(raw)
                )
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown writer settings: {sorted(unknown)}")
        return replace(cls(), **values)


@dataclass(frozen=True)
class RegionContext:
    """What a region writer needs to know about its table."""

    storage: Storage
    schema: TableSchema
    data_storage_version: str
    spec: RegionSpec | None
    region_values: tuple[Any, ...] | None  # this region's values under `spec`, None for manual regions
    field_entries: dict[str, bytes]
    indexes: tuple[MaintainedIndex, ...] = ()  # the maintained indexes, resolved at writer open


class RegionWriter:
    """The writer of one region. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, ctx: RegionContext, region_id: uuid.UUID, config: WriterConfig | None = None) -> None:
        self.ctx = ctx
        self.region_id = region_id
        self.config = config or WriterConfig()
        self._storage = ctx.storage
        self._store = RegionManifestStore(ctx.storage, region_id, self.config.manifest_scan_batch_size)
        self._wal = Wal(ctx.storage, region_id)
        self._cond = threading.Condition(threading.RLock())
        self._sealed: deque[MemTable] = deque()
        self._writes: dict[int, Future[pb.SsTable]] = {}  # generation -> its write (flush thread only)
        # Non-durable mode: accepted batches collect in `_pending` until a threshold makes them one
        # WAL entry in `_ready` (sealing the MemTable makes them its `unlogged_tail` instead, made
        # durable by its generation alone), with the MemTable holding its rows; the WAL
        # thread alone appends ready entries, in order, outside the lock: puts never wait for storage.
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._ready: deque[tuple[list[pa.RecordBatch], MemTable]] = deque()
        # Durable mode: the writes waiting for the next WAL entry, and whether an append is in flight.
        self._joining: _Group | None = None
        self._appending = False
        self._error: MemWalError | None = None  # a fatal error (fencing): every later call raises it
        self._flush_error: BaseException | None = None  # last failed background write (retried)
        self._closed = False
        self._stats = {"puts": 0, "deletes": 0, "rows": 0, "wal_entries": 0, "wal_bytes": 0, "generations": 0}
        self.manifest = self._claim()
        self.epoch = self.manifest.writer_epoch
        self._active = self._new_memtable(self.manifest.current_generation)
        self._indexer: BackgroundIndexer | None = None
        self._next_position = self.manifest.replay_after_wal_entry_position + 1
        self._replay()
        self._threads = [
            threading.Thread(target=self._flush_loop, name=f"memwal-flush-{region_id}", daemon=True)
        ]
        if not self.config.durable_write:
            self._threads.append(
                threading.Thread(target=self._wal_loop, name=f"memwal-wal-{region_id}", daemon=True)
            )
        for t in self._threads:
            t.start()
        if not self.config.indexed_write and self._active.indexes:
            self._indexer = BackgroundIndexer(f"memwal-index-{region_id}")

    def _new_memtable(self, generation: int) -> MemTable:
        return MemTable(generation, self.ctx.schema.wal, self.ctx.schema.primary_key, self.ctx.indexes)

    # ------------------------------------------------------------------ claim and replay

    def _claim(self) -> pb.ShardManifest:
        while True:
            latest = self._store.latest()
            if latest is None:
                m = new_manifest(
                    self.region_id, self.ctx.spec.spec_id if self.ctx.spec else 0, self.ctx.field_entries
                )
            else:
                m = next_version(latest)
                m.writer_epoch = latest.writer_epoch + 1
            if self._store.commit(m):
                self._fresh = latest is None
                return m

    def _replay(self) -> None:
        """Rebuild the MemTable from the WAL, then fence older writers with a sentinel."""
        position = self._next_position
        while True:
            entry = self._wal.read(position)
            if entry is None:
                if self._fresh or self._wal.append(position, encode_fence_sentinel(self.epoch)):
                    break
                continue  # an older writer took the position first: replay that entry too
            if entry.writer_epoch > self.epoch:
                raise self._fence(f"WAL entry {position} has epoch {entry.writer_epoch} > ours {self.epoch}")
            for batch in entry.batches:
                self._active.append(self._conform_replayed(batch, position))
            position += 1
        if self._fresh:
            self._next_position = position
            self._active.last_wal_position = position - 1
            return
        self._active.last_wal_position = position  # the sentinel needs no replay either
        self._next_position = position + 1
        self._commit(lambda m: _set_last_seen(m, position))

    def _conform_replayed(self, batch: pa.RecordBatch, position: int) -> pa.RecordBatch:
        try:
            return batch.replace_schema_metadata(None).cast(self.ctx.schema.wal)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError) as e:
            raise CorruptWalEntryError(
                f"WAL entry {position} does not match the table schema ({e})", self._wal.path(position)
            ) from e

    # ------------------------------------------------------------------ public API

    def put(self, data: Any) -> None:
        """Upsert whole rows (any accepted input: pa.Table, RecordBatch, RecordBatchReader, pandas,
        dict, list of row dicts; every column of the table, `memwal_df.format.schema`). Raises
        `WriterClosedError` once the writer is closed."""
        self._check_usable()
        for rows in upsert_chunks(self.ctx.schema, data, self.config.max_memtable_rows):
            if rows.num_rows == 0:
                continue
            batch = with_tombstone(self.ctx.schema, rows, False)
            self._check_region(batch)
            self._write(batch)
            self._stats["puts"] += 1

    def write_routed(self, rows: pa.Table, deleted: bool) -> None:
        """Write rows that the table writer already validated and routed to this region.

        `rows` are conformed to the table schema (for deletes: full tombstone rows)."""
        self._write(with_tombstone(self.ctx.schema, rows, deleted))
        self._stats["deletes" if deleted else "puts"] += 1

    def delete(self, keys: Any) -> None:
        """Delete rows by primary key (a table of key columns, or an array/list for one-column keys).
        Raises `WriterClosedError` once the writer is closed."""
        self._check_usable()
        batch = delete_batch(self.ctx.schema, keys)
        if batch.num_rows == 0:
            return
        self._check_region(batch, keys_only=True)
        self._write(batch)
        self._stats["deletes"] += 1

    def flush(self) -> None:
        """Make everything written so far durable and flush it into generations; waits for it.

        Raises the error of a background write attempt that fails while it waits (the data stays
        buffered and is retried); failures of attempts before the call were already retried."""
        with self._cond:
            self._check_usable()
            self._flush_error = None  # an earlier failed attempt was retried; report only this call's
            self._seal()
            while self._sealed and self._error is None:
                if self._flush_error is not None:
                    err, self._flush_error = self._flush_error, None
                    raise err
                self._cond.wait(0.05)
            self._check_usable()

    def close(self) -> None:
        """Flush and stop. Closing twice is a no-op; a fenced writer closes without flushing."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
        finally:
            self._stop()

    def abort(self) -> None:
        """Stop without flushing, as a crash would: durable writes are replayed by the next writer,
        non-durable writes not yet in the WAL are lost."""
        self._stop()

    def __enter__(self) -> RegionWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except MemWalError:
                log.exception("closing region writer %s after an error failed", self.region_id)

    @property
    def memtables(self) -> list[MemTable]:
        """Unflushed MemTables, oldest first (sealed ones, then the active one)."""
        with self._cond:
            return [*self._sealed, self._active]

    def memtable_snapshot(self) -> list[MemTableSnapshot]:
        """The newest row per key (tombstones included) of each unflushed MemTable, with access to its
        indexes, oldest first, copied consistently under the writer's lock."""
        with self._cond:
            return [mt.snapshot() for mt in [*self._sealed, self._active] if mt.num_rows]

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                **self._stats,
                "epoch": self.epoch,
                "generation": self._active.generation,
                "memtable_rows": self._active.num_rows,
                "sealed_memtables": len(self._sealed),
                "unflushed_bytes": self._unflushed_bytes(),
                "next_wal_position": self._next_position,
                "buffered_batches": len(self._pending)
                + sum(len(b) for b, _ in self._ready)
                + sum(len(m.unlogged_tail) for m in self._sealed),
            }

    # ------------------------------------------------------------------ write path

    def _check_region(self, batch: pa.RecordBatch, keys_only: bool = False) -> None:
        spec, expected = self.ctx.spec, self.ctx.region_values
        if spec is None or expected is None:
            return
        if keys_only and not spec.reads_only(
            self.ctx.schema.field_ids[c] for c in self.ctx.schema.primary_key
        ):
            return  # tombstones carry only the key: a spec over other columns cannot be checked
        values = spec.evaluate(batch, self.ctx.schema.field_ids)
        for field, got, want in zip(spec.fields, values, expected, strict=True):
            if want is None:
                if got.null_count == len(got):
                    continue
                bad = got.is_valid()
            else:
                same = pc.equal(got, want)  # NULL where `got` is NULL: not the region's value either
                if same.true_count == len(same):
                    continue  # every row belongs here: one compute call on the put path
                bad = pc.invert(pc.fill_null(same, False))
            row = pc.index(bad, True).as_py()
            label = field.label(self.ctx.schema.names_by_id)
            raise RegionRoutingError(
                f"row {row} belongs to region value {label}={got[row].as_py()!r}, "
                f"not to region {self.region_id} ({label}={want!r})"
            )

    def _write(self, batch: pa.RecordBatch) -> None:
        if self.config.durable_write:
            self._write_durable(batch)
            return
        with self._cond:
            self._check_usable()
            self._wait_for_room(batch.nbytes)
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(batch)
            self._pending_bytes += batch.nbytes
            if self._wal_buffer_full():
                self._close_entry()
            if len(self._pending) <= 1:
                self._cond.notify_all()  # the WAL loop starts its timer, or appends
            self._add([batch])

    def _write_durable(self, batch: pa.RecordBatch) -> None:
        """Group commit: a write joins the group of writes waiting for the next WAL entry; the first
        of them to find no append in flight appends the whole group as one entry (outside the lock),
        adds it to the MemTable and wakes the others. Every write of the group returns (or raises
        the append's error) once that entry is stored. A writer used from one thread writes one entry
        per write."""
        with self._cond:
            self._check_usable()
            self._wait_for_room(batch.nbytes)
            group = self._joining
            if group is None:
                group = self._joining = _Group()
            group.batches.append(batch)
            while self._appending and not group.done:
                self._cond.wait()
            if not group.done:  # lead the group
                self._joining = None
                try:
                    self._check_usable()
                except MemWalError as e:
                    group.finish(e)
                    self._cond.notify_all()
                    raise
                self._appending = True
                generation = self._active.generation
        if group.done:
            group.result()
            return
        error: BaseException | None = None
        try:
            self._append_wal(group.batches, generation)
        except BaseException as e:
            error = e
        with self._cond:
            self._appending = False
            if error is None:
                self._add(group.batches)
            group.finish(error)
            self._cond.notify_all()
        group.result()

    def _add(self, batches: list[pa.RecordBatch]) -> None:
        """Add accepted (durable mode: stored) batches to the active MemTable (caller holds the lock)."""
        for batch in batches:
            self._active.append(batch)
            self._stats["rows"] += batch.num_rows
        self._index(self._active)
        if self.config.durable_write:
            self._active.last_wal_position = self._next_position - 1
        if self._memtable_full():
            self._seal()

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
        while True:
            data = encode_entry(batches, self.epoch, generation)
            position = self._next_position
            if self._wal.append(position, data):
                break
            other = self._wal.read(position)
            if other is None or other.is_sentinel or other.writer_epoch != self.epoch:
                epoch = other.writer_epoch if other is not None else "?"
                raise self._fence(f"WAL position {position} was taken by a writer with epoch {epoch}")
            # Our own earlier append, which raised (a failed fsync, a lost answer) but landed: it is
            # durable and every replay includes it, so this writer's MemTable includes it too.
            self._adopt(other)
            if not self.config.durable_write:  # the adopted entry holds the first batches of this one
                del batches[: len(other.batches)]
                if not batches:
                    return
        self._next_position = position + 1
        self._stats["wal_entries"] += 1
        self._stats["wal_bytes"] += len(data)

    def _adopt(self, entry: WalEntry) -> None:
        with self._cond:
            if self.config.durable_write:  # the writes that failed never reached the MemTable
                for batch in entry.batches:
                    self._active.append(self._conform_replayed(batch, entry.position))
                self._active.last_wal_position = entry.position
            self._next_position = entry.position + 1

    def _close_entry(self) -> None:
        """Make the pending batches one ready WAL entry (caller holds the lock)."""
        if self._pending:
            self._ready.append((self._pending, self._active))
            self._active.unlogged_entries += 1
            self._pending = []
            self._pending_bytes = 0

    def _append_ready(self) -> None:
        """Append the oldest ready entry (WAL thread). It stays ready until it is stored: a failed
        append is retried as it was."""
        batches, memtable = self._ready[0]
        self._append_wal(batches, memtable.generation)
        with self._cond:
            if self._ready and self._ready[0][0] is batches:  # (a fence may have dropped every entry)
                self._ready.popleft()
            memtable.last_wal_position = self._next_position - 1
            memtable.unlogged_entries -= 1
            self._cond.notify_all()

    def _wal_buffer_full(self) -> bool:
        return (
            len(self._pending) >= self.config.max_wal_buffer_batches
            or self._pending_bytes >= self.config.max_wal_buffer_size
        )

    def _memtable_full(self) -> bool:
        a = self._active
        return (
            a.num_rows >= self.config.max_memtable_rows
            or a.nbytes >= self.config.max_memtable_size
            or len(a.batches) >= self.config.max_memtable_batches
        )

    def _unflushed_bytes(self) -> int:
        return self._active.nbytes + sum(m.nbytes for m in self._sealed)

    def _wait_for_room(self, incoming: int) -> None:
        deadline = time.monotonic() + self.config.backpressure_timeout_s
        while self._sealed and self._unflushed_bytes() + incoming > self.config.max_unflushed_memtable_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackpressureTimeoutError(
                    f"region {self.region_id}: {self._unflushed_bytes()} unflushed bytes exceed "
                    f"max_unflushed_memtable_bytes={self.config.max_unflushed_memtable_bytes} for "
                    f"{self.config.backpressure_timeout_s}s; MemTable flushes are not keeping up"
                )
            self._cond.wait(min(left, 0.1))
            self._check_usable()

    def _seal(self) -> None:
        """Close the active MemTable and queue it for flushing. Its buffered (non-durable) writes get
        no WAL entry: its generation makes them durable, and newer WAL entries wait for that commit
        (`_wal_blocked`), so a crash still loses only the newest writes. Waits for a durable append
        in flight, whose rows belong to the active MemTable."""
        while self._appending:
            self._cond.wait()
        if self._active.num_rows == 0:
            return
        self._active.unlogged_tail, self._pending, self._pending_bytes = self._pending, [], 0
        self._sealed.append(self._active)
        self._active = self._new_memtable(self._active.generation + 1)
        self._active.last_wal_position = self._next_position - 1
        self._cond.notify_all()

    # ------------------------------------------------------------------ background work

    def _flush_loop(self) -> None:
        """Flush sealed MemTables: up to `_FLUSH_DEPTH` of the oldest are written as generations at
        once (on the shared flush pool), and their manifest commits follow strictly in generation
        order, each only once its generation is durable and its rows are in the WAL. A failed write
        is retried in a new directory (after a backoff) while newer generations already written wait
        for it; a failed commit is retried with the generation already written."""
        backoff = 0.05
        while True:
            with self._cond:
                while not self._sealed and not self._closed:
                    self._cond.wait()
                if self._closed or self._error is not None:
                    return
                queue = list(self._sealed)[:_FLUSH_DEPTH]
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

    def _flush_failed(self, memtable: MemTable, error: Exception, backoff: float) -> float:
        """Report a failed flush step to `flush()` callers and wait `backoff`; the next backoff."""
        log.warning(
            "flush of generation %d of region %s failed: %s", memtable.generation, self.region_id, error
        )
        with self._cond:
            self._flush_error = error
            self._cond.notify_all()
            self._cond.wait(backoff)
        return min(backoff * 2, 5.0)

    def _write_generation(self, memtable: MemTable) -> pb.SsTable:
        """Write `memtable` as a generation, retrying in a new directory up to `max_flush_retries`."""
        last_error: BaseException | None = None
        for _ in range(self.config.max_flush_retries):
            try:
                return write_generation(
                    self._storage, self.region_id, memtable, self.ctx.data_storage_version, self.ctx.indexes
                )
            except (OSError, ValueError, RuntimeError) as e:  # each retry writes a new directory
                last_error = e
        assert last_error is not None
        raise last_error

    def _commit_generation(self, memtable: MemTable, sstable: pb.SsTable) -> None:
        """Commit the manifest version listing `memtable`'s generation (the oldest sealed one), once
        every WAL entry holding its rows is stored."""
        with self._cond:  # the manifest may list it only once its rows are durable in the WAL
            while memtable.unlogged_entries and self._error is None and not self._closed:
                self._cond.wait()
            if memtable.unlogged_entries:
                return  # stopped or fenced first: the directory is an orphan for garbage collection
        self._commit(lambda m: _add_generation(m, sstable, memtable.last_wal_position))
        with self._cond:
            self._sealed.popleft()
            self._stats["generations"] += 1
            self._cond.notify_all()

    def _wal_blocked(self) -> bool:
        """Whether the oldest ready entry must wait: an older sealed MemTable holds writes that no
        WAL entry holds and its generation is not committed yet (this entry first would let a crash
        keep newer writes and lose older ones). Caller holds the lock."""
        generation = self._ready[0][1].generation
        return any(m.unlogged_tail and m.generation < generation for m in self._sealed)

    def _wal_loop(self) -> None:
        """Non-durable mode: append ready entries in order, and make the pending batches one when
        the oldest is `max_wal_flush_interval_ms` old. Appends run without the lock: puts go on."""
        interval = self.config.max_wal_flush_interval_ms / 1000
        while True:
            with self._cond:
                if self._closed or self._error is not None:
                    return
                if not self._ready:
                    if not self._pending:
                        self._cond.wait()  # _write notifies when the first pending batch arrives
                        continue
                    left = self._pending_since + interval - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    self._close_entry()
                if self._wal_blocked():
                    self._cond.wait()  # until the older generation commits
                    continue
            try:
                self._append_ready()
            except WriterFencedError:
                return
            except MemWalError as e:  # retried; flush() and close() report it meanwhile
                log.warning("WAL flush of region %s failed: %s", self.region_id, e)
                with self._cond:
                    self._flush_error = e
                    self._cond.notify_all()
                    self._cond.wait(interval)

    # ------------------------------------------------------------------ manifest commits and fencing

    def _commit(self, change: Any) -> None:
        """Apply `change` to the latest manifest and commit it, if the epoch is still ours."""
        while True:
            latest = self._store.latest()
            assert latest is not None
            if latest.writer_epoch != self.epoch:
                raise self._fence(
                    f"the region manifest has epoch {latest.writer_epoch}, ours is {self.epoch}"
                )
            m = next_version(latest)
            if change(m) is False:  # nothing to change: an earlier attempt of ours made this commit
                with self._cond:
                    self.manifest = latest
                return
            if self._store.commit(m):
                with self._cond:
                    self.manifest = m
                return

    def _fence(self, reason: str) -> WriterFencedError:
        with self._cond:
            lost: list[pa.RecordBatch] = []  # in write order
            committed = {s.generation for s in self.manifest.sstables}
            for m in [*self._sealed, self._active]:
                lost += [b for batches, owner in self._ready if owner is m for b in batches]
                if m.generation not in committed:
                    lost += m.unlogged_tail
            lost += self._pending
            self._ready, self._pending = deque(), []
            not_durable = pa.Table.from_batches(lost, schema=self.ctx.schema.wal) if lost else None
            err = WriterFencedError(
                f"writer of region {self.region_id} (epoch {self.epoch}) is fenced: {reason}", not_durable
            )
            if self._error is None:
                self._error = err
            self._cond.notify_all()
            return err

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise WriterClosedError(f"the writer of region {self.region_id} is closed")

    def _stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        wait(list(self._writes.values()))  # a stopped writer leaves no write running (orphans stay)
        if self._indexer is not None:
            self._indexer.stop()


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


def _set_last_seen(m: pb.ShardManifest, position: int) -> None:
    m.wal_entry_position_last_seen = max(m.wal_entry_position_last_seen, position)


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
