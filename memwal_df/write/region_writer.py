"""The region writer: the single, epoch-fenced writer of one region.

Life cycle (spec "Writer Expectations", Lance 14's protocol), each step in the part that owns it:
1. Claim (`memwal_df.write.claim`): load the latest region manifest and commit a copy with
   `writer_epoch + 1` (a new region starts at version 1, epoch 1). Losing the put-if-not-exists race
   means another claimer won: reload and try again with a higher epoch.
2. Replay (`memwal_df.write.claim`): read WAL entries from `replay_after_wal_entry_position + 1` until
   a position is missing and rebuild the MemTable from them (sentinels skipped; entries of fenced or
   crashed writers included). An existing region then gets a fence sentinel at the first free
   position and a second manifest version whose `wal_entry_position_last_seen` is the sentinel's
   position.
3. Write (`memwal_df.write.wal_commit`): validate, append to the WAL (durable mode: before returning,
   concurrent writes sharing an entry; otherwise batched by size, count and time), add to the MemTable.
   A partial or conditional write (`memwal_df.write.partial`) first reads the current rows of its keys
   and merges them into full rows, in one read-modify-write step no other write of the region enters.
4. MemTable flush (`memwal_df.write.flush`; background, or `flush()`/`close()`): seal the MemTable,
   write it as a generation (a few of a region at once), then, in generation order and once every
   WAL entry holding its rows is stored, commit a manifest version that lists it, after checking the
   epoch is still ours.

`RegionWriter` composes these parts around one `RegionState` (`memwal_df.write.region_state`), the
state they share under one condition variable, and exposes the public API.

Guarantees: a write that returned in durable mode is in the WAL and survives any crash; a writer whose
WAL position or manifest shows a newer epoch raises `WriterFencedError` on every later call, carrying
the rows it accepted but never made durable; a failed generation write retries in a new directory and
never corrupts the manifest.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError, MissingGenerationError, RegionRoutingError
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.schema import TableSchema, delete_batch, upsert_chunks, with_tombstone
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal
from memwal_df.write.claim import claim, replay
from memwal_df.write.flush import FlushPipeline
from memwal_df.write.generation import generation_memtable
from memwal_df.write.memtable import MemTable, MemTableSnapshot
from memwal_df.write.memtable_index import BackgroundIndexer
from memwal_df.write.newest_rows import Found, newest_rows
from memwal_df.write.partial import (
    Applied,
    BaseRows,
    Condition,
    CurrentRows,
    encoded_keys,
    merge,
    needed_columns,
    put_merged,
    write_merged,
)
from memwal_df.write.region_state import KEPT_FLUSHED_BYTES, RegionState
from memwal_df.write.wal_commit import ExclusiveSection, WalCommitter
from memwal_df.write.writer_config import WriterConfig
from memwal_df.write.writer_lease import RecoveryClaim, WriterLease

log = logging.getLogger(__name__)


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
    current_rows: CurrentRows | None = None  # for partial and conditional writes (`memwal_df.write.partial`)


class RegionWriter:
    """The writer of one region. Thread-safe; use as a context manager or call `close()`."""

    def __init__(
        self,
        ctx: RegionContext,
        region_id: uuid.UUID,
        config: WriterConfig | None = None,
        *,
        recovery: RecoveryClaim | None = None,
    ) -> None:
        """Take the region's writer lease, claim the region and replay its WAL. `recovery`: claim only
        the manifest version after `recovery.expect_version`, holding `recovery.lease` (the maintain
        loop's recovery, `memwal_df.jobs.region_recovery`; `CommitConflictError` if the region moved on)."""
        self.ctx = ctx
        self.region_id = region_id
        self.config = config or WriterConfig()
        store = RegionManifestStore(ctx.storage, region_id, self.config.manifest_scan_batch_size)
        ttl = timedelta(seconds=self.config.lease_ttl_s)
        held = recovery.lease if recovery is not None else None
        self._lease = WriterLease(ctx.storage, region_id, ttl, lambda: self._still_ours(store), held)
        try:
            self._open(store, recovery.expect_version if recovery is not None else None)
        except BaseException:
            self._lease.release()
            raise

    def _still_ours(self, store: RegionManifestStore) -> bool:
        """Whether the region's latest manifest carries this writer's epoch (True before the claim)."""
        state = getattr(self, "_state", None)
        latest = store.latest()
        return state is None or latest is None or latest.writer_epoch == state.epoch

    def _open(self, store: RegionManifestStore, expect_version: int | None) -> None:
        ctx, region_id = self.ctx, self.region_id
        wal = Wal(ctx.storage, region_id)
        spec_id = ctx.spec.spec_id if ctx.spec else 0
        manifest, fresh = claim(store, region_id, spec_id, ctx.field_entries, expect_version)
        self._state = RegionState(region_id, ctx.schema, ctx.indexes, manifest)
        replay(self._state, wal, store, fresh)
        self._indexer: BackgroundIndexer | None = None
        if not self.config.indexed_write and self._state.active.indexes:
            self._indexer = BackgroundIndexer(f"memwal-index-{region_id}")
        self._wal_commit = WalCommitter(self._state, wal, self.config, self._indexer)
        self._flush_pipeline = FlushPipeline(
            self._state,
            store,
            ctx.storage,
            ctx.data_storage_version,
            ctx.indexes,
            self.config.max_flush_retries,
        )
        self._threads = [self._thread(self._flush_pipeline.run_flush_thread, "flush")]
        if not self.config.durable_write:
            self._threads.append(self._thread(self._wal_commit.run_wal_thread, "wal"))
        for t in self._threads:
            t.start()

    def _thread(self, target: Callable[[], None], kind: str) -> threading.Thread:
        return threading.Thread(target=target, name=f"memwal-{kind}-{self.region_id}", daemon=True)

    @property
    def epoch(self) -> int:
        """The writer epoch this writer claimed the region with."""
        return self._state.epoch

    @property
    def manifest(self) -> pb.ShardManifest:
        """The region manifest version this writer committed (or found) last."""
        return self._state.manifest

    # ------------------------------------------------------------------ public API

    def put(
        self, data: Any, *, partial: bool = False, if_match: Mapping[str, Any] | None = None
    ) -> Applied | None:
        """Upsert rows (any accepted input: pa.Table, RecordBatch, RecordBatchReader, pandas, dict,
        list of row dicts). Whole rows (every column of the table, `memwal_df.format.schema`) unless
        `partial`: then the primary key and any subset of the other columns, each row updating only
        the columns it carries (`memwal_df.write.partial`). `if_match` (column -> expected value, a
        scalar or one per row) applies a row only where the key's live row holds those values, and
        returns which rows were applied; an unconditional put returns None. Raises
        `WriterClosedError` once the writer is closed."""
        self._state.check_usable()
        if partial or if_match is not None:
            max_rows = self.config.max_memtable_rows
            return put_merged(self.ctx.schema, data, partial, if_match, max_rows, self._write_chunk)
        for rows in upsert_chunks(self.ctx.schema, data, self.config.max_memtable_rows):
            if rows.num_rows == 0:
                continue
            batch = with_tombstone(self.ctx.schema, rows, False)
            self._check_region(batch)
            self._wal_commit.write(batch)
            self._state.stats["puts"] += 1
        return None

    def insert_if_absent(self, data: Any, *, partial: bool = False) -> Applied:
        """Insert the rows whose key has no live row (absent or deleted); keep the existing rows.
        Whole rows unless `partial` (missing columns NULL). Returns which rows were inserted."""
        self._state.check_usable()
        condition, max_rows = Condition("insert_if_absent"), self.config.max_memtable_rows
        return write_merged(self.ctx.schema, data, partial, condition, max_rows, self._write_chunk)

    def _write_chunk(self, rows: pa.Table, condition: Condition) -> list[tuple[np.ndarray, Applied]]:
        """One chunk of a partial or conditional write (`write_merged`): one read-modify-write (one
        WAL entry of full rows)."""
        return [(np.arange(rows.num_rows), self.apply_merged(rows, condition))]

    def apply_merged(self, rows: pa.Table, condition: Condition) -> Applied:
        """Write conformed rows (`partial_rows` or `upsert_rows`) merged with the current rows of their
        keys under `condition`, as one read-modify-write: no other write of the region comes between
        the read and the write, and the read sees every write accepted before it."""
        write = self.merged_write(rows, condition)
        write.enter()
        return write.accept()()

    def merged_write(
        self, rows: pa.Table, condition: Condition, routed: bool = False, base: BaseRows | None = None
    ) -> MergedWrite:
        """`apply_merged` in steps (`MergedWrite`). `routed`: the table writer routed the rows to this
        region already; `base`: base rows it read for them (`CurrentRows.base_rows`)."""
        if self.ctx.current_rows is None:
            raise InvalidConfigError(
                "this writer has no row lookup for partial or conditional writes: open it with "
                "table.writer() or table.region_writer()"
            )
        return MergedWrite(self, rows, condition, routed, base)

    def _held(self) -> list[MemTable]:
        """The MemTables the lookups of partial and conditional writes read, newest first: active,
        sealed, and the generations kept in memory. The first call makes the writer keep the
        generations it commits from then on, and reads back the ones its manifest lists already
        (newest first, as many as `KEPT_FLUSHED_BYTES` allows, up to one that is gone)."""
        state = self._state
        with state.cond:
            first, state.keep_flushed = not state.keep_flushed, True
            held = {m.generation for m in [state.active, *state.sealed, *state.flushed]}
            stored = [s for s in state.manifest.sstables if s.generation not in held]
        if first and stored:
            loaded = []
            room = KEPT_FLUSHED_BYTES
            wal, pk = self.ctx.schema.wal, self.ctx.schema.primary_key
            for sstable in sorted(stored, key=lambda s: s.generation, reverse=True):
                room -= sstable.in_memory_bytes
                if room < 0:
                    break
                try:
                    loaded.append(generation_memtable(self.ctx.storage, self.region_id, sstable, wal, pk))
                except MissingGenerationError:
                    break  # (merged and collected: it and the older ones are the base's to answer)
            with state.cond:
                state.keep_loaded(loaded)
        with state.cond:
            return [state.active, *reversed(state.sealed), *reversed(state.flushed)]

    def write_routed(self, rows: pa.Table, deleted: bool) -> None:
        """Write rows that the table writer already validated and routed to this region.

        `rows` are conformed to the table schema (for deletes: full tombstone rows)."""
        self._wal_commit.write(with_tombstone(self.ctx.schema, rows, deleted))
        self._state.stats["deletes" if deleted else "puts"] += 1

    def delete(self, keys: Any) -> None:
        """Delete rows by primary key (a table of key columns, or an array/list for one-column keys).
        Raises `WriterClosedError` once the writer is closed."""
        self._state.check_usable()
        batch = delete_batch(self.ctx.schema, keys)
        if batch.num_rows == 0:
            return
        self._check_region(batch, keys_only=True)
        self._wal_commit.write(batch)
        self._state.stats["deletes"] += 1

    def flush(self) -> None:
        """Make everything written so far durable and flush it into generations; waits for it.

        Raises the error of a background write attempt that fails while it waits (the data stays
        buffered and is retried); failures of attempts before the call were already retried."""
        state = self._state
        with state.cond:
            state.check_usable()
            state.flush_error = None  # an earlier failed attempt was retried; report only this call's
            state.seal()
            while state.sealed and state.error is None:
                if state.flush_error is not None:
                    err, state.flush_error = state.flush_error, None
                    raise err
                state.cond.wait(0.05)
            state.check_usable()

    def close(self) -> None:
        """Flush every acknowledged write into a generation (visible to every reader when this
        returns), stop, and release the region's writer lease. Closing twice is a no-op; a fenced
        writer closes without flushing. If the flush fails (`StorageError`, `WriterFencedError`,
        ...) the writer stops anyway and the error is raised: durable writes stay in the WAL, as
        after `abort()`."""
        if self._state.closed:
            return
        try:
            if self._state.error is None:
                self.flush()
        finally:
            self._stop()

    def abort(self) -> None:
        """Stop without flushing, as a crash would, and release the region's writer lease. Durable
        writes stay in the WAL, invisible to readers of the flushed levels until the region is
        recovered: by its next writer, by the maintain loop's next round (the released lease tells it
        the writer is gone) or by `memwal recover` / `table.recover()`. Non-durable writes not yet in
        the WAL are lost."""
        self._stop()

    def __enter__(self) -> RegionWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """`close()` (flush, stop), also when the block raised: every acknowledged write becomes
        visible. When that close fails after an error, the writer is stopped as by `abort()` (durable
        writes wait in the WAL for recovery), the failure is logged and noted on the block's error,
        which propagates."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the block's own error is the one to raise
            log.warning("closing region writer %s after an error failed: %s", self.region_id, e)
            exc.add_note(
                f"closing the writer of region {self.region_id} failed too ({type(e).__name__}: {e}); "
                "its durable writes stay in the WAL until the region is recovered (maintain loop, "
                "memwal recover)"
            )  # (close() stopped the writer: nothing more to abort)

    @property
    def memtables(self) -> list[MemTable]:
        """Unflushed MemTables, oldest first (sealed ones, then the active one)."""
        with self._state.cond:
            return [*self._state.sealed, self._state.active]

    def memtable_snapshot(self) -> list[MemTableSnapshot]:
        """The newest row per key (tombstones included) of each unflushed MemTable, with access to its
        indexes, oldest first, copied consistently under the writer's lock."""
        with self._state.cond:
            return [mt.snapshot() for mt in [*self._state.sealed, self._state.active] if mt.num_rows]

    def stats(self) -> dict[str, int]:
        """Counters of this writer and the state of its MemTables and WAL, copied under its lock."""
        state = self._state
        with state.cond:
            return {
                **state.stats,
                "epoch": state.epoch,
                "generation": state.active.generation,
                "memtable_rows": state.active.num_rows,
                "sealed_memtables": len(state.sealed),
                "unflushed_bytes": state.unflushed_bytes(),
                "next_wal_position": state.next_position,
                "buffered_batches": len(state.pending)
                + sum(len(b) for b, _ in state.ready)
                + sum(len(m.unlogged_tail) for m in state.sealed),
            }

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

    def _stop(self) -> None:
        state = self._state
        with state.cond:
            state.closed = True
            state.cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._flush_pipeline.wait_for_writes()
        if self._indexer is not None:
            self._indexer.stop()
        self._lease.release()


class MergedWrite:
    """One read-modify-write of a region writer (`RegionWriter.merged_write`), in two steps, so that a
    table writer can read every region's MemTables before any region waits for the base rows it reads
    in the background:

    * `enter`: enter the region's exclusive section (`WalCommitter.exclusive`) and look the keys up in
      the MemTables the writer holds;
    * `accept`: look the others up in the region's stored levels, merge, accept the merged rows and
      leave the section; it returns the call that finishes the write (durable mode: waits for the WAL
      entry) and gives the `Applied` rows, which must be made, even after an error of the caller's.

    `accept` follows a successful `enter`, in the same thread; `leave` leaves a section entered but not
    accepted (a no-op otherwise). A step that raises leaves the section."""

    def __init__(
        self, writer: RegionWriter, rows: pa.Table, condition: Condition, routed: bool, base: BaseRows | None
    ) -> None:
        ts = writer.ctx.schema
        self._writer = writer
        self._rows = rows
        self._condition = condition
        self._routed = routed
        self._base = base
        self._keys = rows.select(list(ts.primary_key))
        self._asked = encoded_keys(rows, ts.primary_key)
        self._columns = needed_columns(ts, rows, condition)
        self._section: ExclusiveSection | None = None
        self._held: tuple[Found, list[int]] | None = None  # the MemTables' answers, their generations

    def enter(self) -> None:
        """Enter the exclusive section and read the keys' rows in the MemTables the writer holds."""
        writer = self._writer
        section = writer._wal_commit.exclusive(self._rows.nbytes)
        try:
            held = writer._held()
            schema = pa.schema([writer.ctx.schema.schema.field(c) for c in self._columns])
            found = newest_rows([writer._state.key_directory.level(held)], self._asked, schema)
        except BaseException:
            section.leave()
            raise
        self._section = section
        self._held = (found, [m.generation for m in held])

    def accept(self) -> Callable[[], Applied]:
        """Read the other keys' rows in the stored levels, merge, accept, leave the section."""
        section, held = self._section, self._held
        assert section is not None and held is not None, "accept() follows enter()"
        writer, ts, rows = self._writer, self._writer.ctx.schema, self._rows
        try:
            current, generations = held
            resolved = current.resolved
            if not resolved.all():  # the keys no MemTable holds, in the region's stored levels
                rest = self._keys if not resolved.any() else self._keys.filter(pa.array(~resolved))
                lookup = writer.ctx.current_rows
                assert lookup is not None
                manifest = writer._state.manifest
                stored = lookup(writer.region_id, manifest, generations, rest, self._columns, self._base)
                current = current.then(stored)
            full, mask = merge(ts, rows, self._condition, current, self._asked)
            batch = with_tombstone(ts, full, False) if full.num_rows else None
            if batch is not None and not self._routed:
                writer._check_region(batch)
        except BaseException:
            section.leave()
            raise
        finish = section.accept(batch)

        def applied() -> Applied:
            finish()
            writer._state.stats["puts"] += 1
            return Applied(mask, self._keys if mask.all() else self._keys.filter(pa.array(mask)))

        return applied

    def leave(self) -> None:
        """Leave the exclusive section if it was entered and not accepted."""
        if self._section is not None:
            self._section.leave()
