"""The table writer: routes each row to the region its region-spec values name, one region writer each.

Rows are grouped by their region values with one vectorized group-by per write; each group goes to the
writer of its region, which is claimed on first use (a new region is created for a new value, with a
region id derived from the values, so concurrent writers of the same value meet in the same region and
fence each other instead of splitting a key across two regions).

Guarantees: each chunk of a write (up to `max_memtable_rows` rows; a RecordBatchReader's batches) is
validated as a whole (schema: every column of the table for a put; NULL keys; routability) before any
region receives a row of it, and a put lacking a column writes nothing; a write spanning several
regions is applied region by region (regions are independent, there is no cross-region atomicity), so
a region whose manifest or WAL entry cannot be decoded refuses only its own rows; `close()` flushes
and closes every region writer, reporting the first error, and every later put, delete or flush raises
`WriterClosedError`. A partial or conditional write (`memwal_df.write.partial`) is routed the same way;
each region's part is one read-modify-write of its writer (in the calling thread: every region reads
its MemTables, then each reads its stored levels and accepts its rows; durable WAL entries then
stored concurrently), and the regions' answers are combined in input order. Non-durable writes run
in the calling thread, durable ones concurrently.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import (
    CorruptManifestError,
    CorruptWalEntryError,
    MemWalError,
    RegionRoutingError,
    WriterClosedError,
)
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.schema import key_rows, tombstone_rows, upsert_chunks
from memwal_df.format.table_handle import TableHandle
from memwal_df.write.partial import (
    Applied,
    BaseRows,
    Condition,
    CurrentRows,
    needed_columns,
    put_merged,
    write_merged,
)
from memwal_df.write.region_open import open_routed_writer
from memwal_df.write.region_writer import MergedWrite, RegionWriter
from memwal_df.write.writer_config import WriterConfig

_MAX_PARALLEL_REGIONS = 8

log = logging.getLogger(__name__)


class TableWriter:
    """Writes to every region of a table through per-region writers. Thread-safe: concurrent durable
    writes of one region share WAL entries (group commit, `RegionWriter`)."""

    def __init__(
        self,
        table: TableHandle,
        config: WriterConfig,
        *,
        allow_non_key_region_columns: bool = False,
        current_rows: CurrentRows | None = None,
    ) -> None:
        if table.spec is None:
            raise RegionRoutingError(
                "the table has no region spec, so rows cannot be routed: use table.region_writer(region_id)"
            )
        table.check_writable(allow_non_key_region_columns)
        self.table = table
        self._allow_non_key = allow_non_key_region_columns
        self._current_rows = current_rows
        self.spec = table.spec
        self.config = config
        self.writers: dict[uuid.UUID, RegionWriter] = {}
        self._by_values: dict[tuple[Any, ...], RegionWriter] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards opening region writers and the pool
        self._closed = False
        self._count_lock = threading.Lock()
        self._write_count = 0

    def put(
        self, data: Any, *, partial: bool = False, if_match: Mapping[str, Any] | None = None
    ) -> Applied | None:
        """Upsert rows, routed to their regions: whole rows (every column of the table,
        `memwal_df.format.schema`), or with `partial` the primary key and any subset of the other
        columns; `if_match` applies a row only where its key's live row holds the expected values and
        returns which rows were applied (see `RegionWriter.put`; an unconditional put returns None).

        Rows of a region whose manifest or WAL entry cannot be decoded are refused: the rows of the
        other regions are written, then that region's `CorruptWalEntryError` / `CorruptManifestError`
        (naming the file) is raised, with a note per further refused region. Input longer than
        `max_memtable_rows` is written in chunks of that many rows; chunks after the one that raised
        are not written. `delete` does the same."""
        self._check_open()
        if partial or if_match is not None:
            max_rows = self.config.max_memtable_rows
            return put_merged(self.table.schema, data, partial, if_match, max_rows, self._write_chunk)
        for table in upsert_chunks(self.table.schema, data, self.config.max_memtable_rows):
            if table.num_rows:
                self._write_parts(self._route(table), deleted=False)
        return None

    def insert_if_absent(self, data: Any, *, partial: bool = False) -> Applied:
        """Insert the rows whose key has no live row, keep the existing ones; returns which rows were
        inserted (see `RegionWriter.insert_if_absent`)."""
        self._check_open()
        condition, max_rows = Condition("insert_if_absent"), self.config.max_memtable_rows
        return write_merged(self.table.schema, data, partial, condition, max_rows, self._write_chunk)

    def _write_chunk(self, rows: pa.Table, condition: Condition) -> list[tuple[np.ndarray, Applied]]:
        """One chunk of a partial or conditional write (`write_merged`): its rows routed, each region's
        part one read-modify-write of its writer."""
        ts = self.table.schema
        if not self.spec.reads_only(ts.field_ids[c] for c in rows.column_names):
            raise RegionRoutingError(
                "the region spec reads columns the partial rows do not carry: give them, or write "
                "through table.region_writer(region_id)"
            )
        groups = group_positions(self.spec, ts.field_ids, rows)
        writers, unavailable = self._open([values for values, _ in groups])
        routed = [(w, pos) for w, (_, pos) in zip(writers, groups, strict=True) if w is not None]
        routed.sort(key=lambda r: r[0].region_id)  # the order every caller enters regions' sections in
        base = self._base_rows(rows, condition) if len(routed) > 1 else None
        writes = [
            w.merged_write(rows.take(pa.array(pos)), condition.take(pos), True, base) for w, pos in routed
        ]
        results = self._run_writes(_started(writes))  # regions read and accepted here, then stored
        if unavailable:
            raise _refused(unavailable, False)
        return [(pos, applied) for (_, pos), applied in zip(routed, results, strict=True)]

    def _base_rows(self, rows: pa.Table, condition: Condition) -> BaseRows | None:
        """The base rows of every key of `rows`, read once for all their regions, in the background
        while they read their own levels (each region's lookup uses them if it reads the same base
        version)."""
        if self._current_rows is None:
            return None
        ts = self.table.schema
        keys = rows.select(list(ts.primary_key))
        return self._current_rows.base_rows(keys, needed_columns(ts, rows, condition))

    def delete(self, keys: Any) -> None:
        """Delete rows by primary key; the region spec must depend on key columns only."""
        self._check_open()
        ts = self.table.schema
        if not self.spec.reads_only(ts.field_ids[c] for c in ts.primary_key):
            raise RegionRoutingError(
                "the region spec reads non-key columns, so a key alone cannot be routed: "
                "delete through table.region_writer(region_id)"
            )
        table = key_rows(ts, keys)
        if table.num_rows:
            self._write_parts(self._route(tombstone_rows(ts, table)), deleted=True)

    def flush(self) -> None:
        """Seal and flush every region's MemTable into a generation (regions in parallel)."""
        self._check_open()
        self._run([(w.flush, ()) for w in self.writers.values()])

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError("the table writer is closed: open a new one with table.writer()")

    def _write_parts(self, parts: list[tuple[tuple[Any, ...], pa.Table]], deleted: bool) -> None:
        """Hand each region its rows (`_run_writes`)."""
        writers, unavailable = self._open([values for values, _ in parts])
        calls = [
            (w.write_routed, (rows, deleted))
            for w, (_, rows) in zip(writers, parts, strict=True)
            if w is not None
        ]
        self._run_writes(calls)
        if unavailable:
            raise _refused(unavailable, deleted)

    def _run_writes(self, calls: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
        """Run the regions' writes: durable ones concurrently (each waits for its WAL append), others
        one after the other in this thread (they wait for nothing, and threads would only contend
        for the interpreter). Counted once they ran (`write_count`), also when one failed."""
        try:
            return self._run(calls, concurrently=self.config.durable_write)
        finally:
            with self._count_lock:
                self._write_count += 1

    @property
    def write_count(self) -> int:
        """How many writes (`put`, `delete`, `insert_if_absent` chunks) this writer has run, failed
        ones included: it has grown whenever what its readers see may have changed."""
        return self._write_count

    def _open(self, values: list[tuple[Any, ...]]) -> tuple[list[RegionWriter | None], list[MemWalError]]:
        """The writer of each region (None where the region's manifest or WAL entry cannot be
        decoded, so it cannot be claimed) and those regions' errors."""
        writers: list[RegionWriter | None] = []
        errors: list[MemWalError] = []
        for v in values:
            try:
                writers.append(self._writer(v))
            except (CorruptManifestError, CorruptWalEntryError) as e:
                writers.append(None)
                errors.append(e)
        return writers, errors

    def _run(self, calls: list[tuple[Any, tuple[Any, ...]]], concurrently: bool = True) -> list[Any]:
        """Run the calls (one per region) concurrently, the first in this thread (else all in this
        thread, in order); raise the first error after all finished, else return their results in
        call order."""
        if not calls:
            return []
        futures = [self._region_pool().submit(fn, *args) for fn, args in calls[1:]] if concurrently else []
        errors: list[BaseException] = []
        results = []
        for fn, args in calls if not concurrently else calls[:1]:
            try:
                results.append(fn(*args))
            except Exception as e:  # reported once the other regions' calls are done too
                errors.append(e)
        errors += [error for f in futures if (error := f.exception()) is not None]
        if errors:
            raise errors[0]
        return [*results, *(f.result() for f in futures)]

    def close(self) -> None:
        """Flush and close every region writer (`RegionWriter.close`): every acknowledged write is
        visible to every reader when this returns. Raises the first error after closing all of them
        (a region whose flush failed is stopped anyway, its durable writes left in the WAL as after
        `abort()`). Closing twice is a no-op."""
        if not self._mark_closed():
            return
        try:
            self._run([(w.close, ()) for w in self.writers.values()])
        finally:
            self._shutdown_pool()

    def abort(self) -> None:
        """Stop every region writer without flushing, as a crash would (`RegionWriter.abort`): durable
        writes stay in the WAL until their regions are recovered (next writer, the maintain loop's
        next round, `memwal recover`); non-durable writes not yet in the WAL are lost."""
        self._mark_closed()
        for w in self.writers.values():
            w.abort()
        self._shutdown_pool()

    def _mark_closed(self) -> bool:
        """Close the writer to every later call, so that no region writer opens any more (`writers`
        stays as it is); whether it was open."""
        with self._lock:
            was_open, self._closed = not self._closed, True
            return was_open

    def _region_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_MAX_PARALLEL_REGIONS, thread_name_prefix="memwal-route")
            return self._pool

    def _shutdown_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """`close()` (flush, stop), also when the block raised: every acknowledged write becomes
        visible. When that close fails after an error, every region writer is stopped as by `abort()`
        (durable writes wait in the WAL for recovery), the failure is logged and noted on the block's
        error, which propagates."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the block's own error is the one to raise
            log.warning("closing the table writer of %s after an error failed: %s", self.table.uri, e)
            exc.add_note(
                f"closing the table writer failed too ({type(e).__name__}: {e}); durable writes of the "
                "regions it could not flush stay in the WAL until they are recovered (maintain loop, "
                "memwal recover)"
            )
            self.abort()

    def _writer(self, values: tuple[Any, ...]) -> RegionWriter:
        w = self._by_values.get(values)
        if w is None:
            with self._lock:  # one writer per region: a second claim would fence the first
                self._check_open()  # (close() may have run since put() checked)
                w = self._by_values.get(values)
                if w is None:
                    w = open_routed_writer(
                        self.table,
                        values,
                        self.config,
                        allow_non_key_region_columns=self._allow_non_key,
                        current_rows=self._current_rows,
                    )
                    self.writers[w.region_id] = self._by_values[values] = w
        return w

    def _route(self, table: pa.Table) -> list[tuple[tuple[Any, ...], pa.Table]]:
        return group_by_region(self.spec, self.table.schema.field_ids, table)


def _refused(errors: list[MemWalError], deleted: bool) -> MemWalError:
    """The first error of the regions that refused rows, noting the others and what was written."""
    first = errors[0]
    for e in errors[1:]:
        first.add_note(f"also refused: {e}")
    what = "deletes" if deleted else "rows"
    first.add_note(
        f"the {what} of the {len(errors)} region(s) named here were not written; those of every other "
        "region were (see 'Corrupt regions' in docs/operations.md)"
    )
    return first


def group_by_region(
    spec: RegionSpec, field_ids: dict[str, int], table: pa.Table
) -> list[tuple[tuple[Any, ...], pa.Table]]:
    """(region values, rows) groups of `table` under `spec`, rows in their input order within each
    group (one vectorized spec evaluation, a stable sort by the value tuples' codes, one take)."""
    groups = group_positions(spec, field_ids, table)
    if len(groups) == 1:
        return [(groups[0][0], table)]
    grouped = table.take(pa.array(np.concatenate([positions for _, positions in groups])))
    out, start = [], 0
    for values, positions in groups:
        out.append((values, grouped.slice(start, len(positions))))
        start += len(positions)
    return out


def _started(writes: list[MergedWrite]) -> list[tuple[Any, tuple[()]]]:
    """Run the writes' steps in this thread: each region in turn enters its exclusive section and reads
    its MemTables, then each reads its stored levels and accepts its rows (so the base rows read in
    the background arrive while the MemTables are read). Returns the calls that finish them (one that
    raises the step's error where a write failed), to be run concurrently: every accepted write is
    finished, whatever the others did."""
    failed: list[Exception | None] = []
    finishes: list[tuple[Any, tuple[()]]] = []
    try:
        for write in writes:
            try:
                write.enter()
                failed.append(None)
            except Exception as e:  # raised when the finishing calls run, after every accepted one finished
                failed.append(e)
        for write, error in zip(writes, failed, strict=True):
            if error is None:
                try:
                    finishes.append((write.accept(), ()))
                except Exception as e:
                    error = e
            if error is not None:
                finishes.append((functools.partial(_raise, error), ()))
    finally:
        for write in writes:  # (after an interruption: no section stays entered)
            write.leave()
    return finishes


def _raise(error: BaseException) -> None:
    raise error


def group_positions(
    spec: RegionSpec, field_ids: dict[str, int], table: pa.Table
) -> list[tuple[tuple[Any, ...], np.ndarray]]:
    """(region values, ascending row positions) groups of `table` under `spec`."""
    values = spec.evaluate(table, field_ids)
    codes = value_codes(values, table.num_rows)
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
    ends = np.r_[starts[1:], len(order)]
    return [
        (region_of_row(values, int(order[start])), order[start:end])
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def value_codes(values: list[pa.Array], num_rows: int) -> np.ndarray:
    """One int64 code per row, equal for two rows exactly when their region value tuples are equal
    (mixed radix over the fields' dictionary indices; NULL is a value of its own)."""
    codes = np.zeros(num_rows, dtype=np.int64)
    for v in values:
        encoded = pc.dictionary_encode(v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v)
        idx = encoded.indices.fill_null(len(encoded.dictionary)).to_numpy(zero_copy_only=False)
        codes = codes * (len(encoded.dictionary) + 1) + idx
    return codes


def region_of_row(values: list[pa.Array], row: int) -> tuple[Any, ...]:
    """The region values of one row, as `open_routed_writer` takes them."""
    return tuple(v[row].as_py() for v in values)
