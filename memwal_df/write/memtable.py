"""The MemTable: the in-memory level of one region, one Arrow record batch per write.

Beside the batches it keeps the primary-key bloom filter that is flushed as `bloom_filter.bin`, which
catches up with the batches when it is read (one vectorized pass over the batches appended since), and
the positions of the newest row of every key (positions count rows across all batches in write order),
found by one hash aggregation over the key columns when asked for and kept until the next write. A
write pays only for appending its batch. Tombstones (`_tombstone = true`) are rows like any other: the
newest row of a key decides whether the key exists.

The maintained vector and full-text indexes (`memwal_df.write.memtable_index`) are kept in `indexes`: the
writer brings them up to date on every write (`indexed_write`) or in the background, and a reader's
`snapshot()` indexes whatever they do not cover yet when it searches.

Guarantees: `newest()` holds exactly one row per key, the newest, in forward write order; `take_rows`
returns the rows at the positions asked; a sealed MemTable takes no more writes. A
MemTable is not thread-safe; its region writer serializes access (its `indexes` are thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.bloom import BloomFilter
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.pk_index import pk_index_key
from memwal_df.format.rows import TOMBSTONE
from memwal_df.write.memtable_index import MemTableIndexes, TermRows, VectorRows

_CHUNKED_TAKE_ROWS = 32_768  # up to this many rows, one take over all batches beats one per batch
_ROWS_PER_SLICE = 64  # a take of at most one row in this many cuts slices instead of combining batches


class MemTable:
    """Batches of one generation with a bloom filter of their keys and the newest row of each key."""

    def __init__(
        self,
        generation: int,
        schema: pa.Schema,
        primary_key: Sequence[str],
        indexes: Sequence[MaintainedIndex] = (),
    ) -> None:
        self.generation = generation
        self.schema = schema
        self.primary_key = list(primary_key)
        self.batches: list[pa.RecordBatch] = []
        self.indexes = MemTableIndexes(indexes, schema)
        self._bloom = BloomFilter.empty()
        self._bloom_batches = 0  # batches already in _bloom
        # (batches covered, positions of the newest row per key; None when every row is the newest)
        self._newest_cache: tuple[int, int, np.ndarray | None, pa.Array | None] = (0, 0, None, None)
        self.num_rows = 0
        self.nbytes = 0
        # WAL positions holding this MemTable's rows (inclusive); 0 while none is durable.
        self.last_wal_position = 0
        self.unlogged_entries = 0  # its WAL entries not stored yet (non-durable writers)
        # Its last writes, which no WAL entry holds: its generation makes them durable (non-durable
        # writers seal without appending the buffered writes).
        self.unlogged_tail: list[pa.RecordBatch] = []
        self._sealed = False
        self._sealed_newest: tuple[pa.Table, np.ndarray | None] | None = None  # `_newest()`, once sealed

    def seal(self) -> None:
        """No more writes: `newest()` is computed once from now on, as one chunk (`held_bytes`
        counts that copy)."""
        self._sealed = True

    @property
    def held_bytes(self) -> int:
        """The bytes of its rows, and of the one-chunk `newest()` of a sealed MemTable once made."""
        return self.nbytes + (0 if self._sealed_newest is None else self._sealed_newest[0].nbytes)

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_keys(self) -> int:
        positions = self._newest_positions()
        return self.num_rows if positions is None else len(positions)

    @property
    def bloom(self) -> BloomFilter:
        """The bloom filter of every key written (tombstones included)."""
        if self._bloom_batches < len(self.batches):
            new = pa.Table.from_batches(self.batches[self._bloom_batches :], schema=self.schema)
            self._bloom.insert_keys([new.column(name) for name in self.primary_key])
            self._bloom_batches = len(self.batches)
        return self._bloom

    def append(self, batch: pa.RecordBatch) -> None:
        """Add one write (a batch in WAL schema) to the MemTable."""
        assert not self._sealed, "a sealed MemTable takes no writes"
        if batch.num_rows == 0:
            return
        self.batches.append(batch)
        self.num_rows += batch.num_rows
        self.nbytes += batch.nbytes

    def to_table(self) -> pa.Table:
        """Every row written, in write order (duplicates and tombstones included)."""
        return pa.Table.from_batches(self.batches, schema=self.schema)

    def _newest_positions(self) -> np.ndarray | None:
        """Ascending positions of the newest row of every key; None when every row is one (no key
        repeats). Kept between writes and patched by the rows written since: a kept position stays
        unless a newer row has its key, and the newer rows' own newest ones are added (one hash probe
        of the kept keys into the new ones, one aggregation of the new rows only)."""
        covered, covered_rows, positions, keys = self._newest_cache
        if covered == len(self.batches):
            return positions
        new_rows = pa.Table.from_batches(self.batches[covered:], schema=self.schema)
        new_keys = self._keys(new_rows)
        first = _newest_of(new_keys)  # positions within the new rows; None: all of them
        if first is not None:
            new_keys = new_keys.take(pa.array(first))
        new_positions = covered_rows + (np.arange(new_rows.num_rows) if first is None else first)
        if covered_rows:
            old_positions = np.arange(covered_rows) if positions is None else positions
            assert keys is not None
            stays = np.asarray(pc.invert(pc.is_in(keys, value_set=new_keys)).to_numpy(zero_copy_only=False))
            all_positions = np.concatenate([old_positions[stays], new_positions])
            all_keys = pa.concat_arrays([keys.filter(pa.array(stays)), new_keys])
        else:
            all_positions, all_keys = new_positions, new_keys
        positions = None if len(all_positions) == self.num_rows else all_positions.astype(np.int64)
        self._newest_cache = (len(self.batches), self.num_rows, positions, all_keys)
        return positions

    def _keys(self, rows: pa.Table) -> pa.Array:
        return pk_index_key([rows.column(c).combine_chunks() for c in self.primary_key])

    def newest_positions(self) -> np.ndarray:
        """Positions of the newest row of every key, ascending (= forward write order)."""
        positions = self._newest_positions()
        return np.arange(self.num_rows, dtype=np.int64) if positions is None else positions

    def newest(self) -> pa.Table:
        """One row per key, the newest (tombstones included), in forward write order."""
        return self._newest()[0]

    def _newest(self) -> tuple[pa.Table, np.ndarray | None]:
        """(`newest()`, the positions of its rows; None when it is every row)."""
        if self._sealed_newest is not None:
            return self._sealed_newest
        positions = self._newest_positions()
        return self.newest_at(len(self.batches), positions), positions

    def newest_at(
        self, batches: int, positions: np.ndarray | None, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """`newest()` as it was when the MemTable held its first `batches` batches, whose newest rows
        were at `positions` (None: every row); only `columns` (None: all), copying only those. A
        sealed MemTable's whole one is made once, as one chunk (`take_rows` then takes from it
        without combining batches)."""
        sealed = self._sealed_newest
        if sealed is not None and batches == len(self.batches):
            return sealed[0] if columns is None else sealed[0].select(list(columns))
        table = pa.Table.from_batches(self.batches[:batches], schema=self.schema)
        if columns is not None:
            return _kept(table.select(list(columns)), positions)
        table = _kept(table, positions)
        if self._sealed and batches == len(self.batches):
            self._sealed_newest = (table.combine_chunks(), positions)
            return self._sealed_newest[0]
        return table

    def snapshot(self) -> MemTableSnapshot:
        """The newest row of every key now: their positions and keys at once, their rows when a
        reader asks for them (`MemTableSnapshot.table`), and the MemTable indexes for them."""
        positions = self._newest_positions()
        keys = self._newest_cache[3]
        assert keys is not None, "a snapshot is taken of a MemTable with rows"
        return MemTableSnapshot(self.generation, self, len(self.batches), self.num_rows, positions, keys)

    def take_rows(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at `positions` (ascending, each the newest row of its key): `columns` and
        `_tombstone`. From the one-chunk `newest()` of a sealed MemTable once made (its flush makes
        it; a lookup does not wait for it), else from the batches: a take over chunked columns first
        combines them, copying every row, so a few rows (at most one in `_ROWS_PER_SLICE`) are cut
        out as zero-copy slices, one per run of consecutive positions, and only those are combined;
        more are one take over the batches of a small MemTable, else a take from each batch that
        holds some."""
        schema = _with_tombstone(self.schema, columns)
        if len(positions) == 0:
            return schema.empty_table()
        sealed_newest = self._sealed_newest
        if sealed_newest is not None:
            table, newest = sealed_newest
            at = positions if newest is None else np.searchsorted(newest, positions)
            return table.select(schema.names).take(pa.array(at))
        sizes = np.fromiter((b.num_rows for b in self.batches), np.int64, len(self.batches))
        ends = np.cumsum(sizes)
        which = np.searchsorted(ends, positions, side="right")
        if len(positions) * _ROWS_PER_SLICE <= self.num_rows:
            local = positions - (ends - sizes)[which]
            cuts = np.flatnonzero((np.diff(positions) != 1) | (np.diff(which) != 0)) + 1
            first = np.r_[0, cuts]
            lengths = np.diff(np.r_[first, len(positions)])
            runs = zip(which[first].tolist(), local[first].tolist(), lengths.tolist(), strict=True)
            pieces = [self.batches[b].slice(at, n) for b, at, n in runs]
            return pa.Table.from_batches(pieces, schema=self.schema).select(schema.names).combine_chunks()
        if self.num_rows <= _CHUNKED_TAKE_ROWS:
            table = pa.Table.from_batches(self.batches, schema=self.schema).select(schema.names)
            return table.take(pa.array(positions))
        parts = []
        for i in np.unique(which).tolist():
            local = positions[which == i] - (ends[i] - sizes[i])
            parts.append(self.batches[i].select(schema.names).take(pa.array(local)))
        return pa.Table.from_batches(parts, schema=schema)


def _kept(table: pa.Table, positions: np.ndarray | None) -> pa.Table:
    """The rows of `table` at `positions` (ascending; None: all of them)."""
    if positions is None:
        return table
    keep = np.zeros(table.num_rows, dtype=bool)
    keep[positions] = True  # a filter keeps forward order and copies each kept row once
    return table.filter(pa.array(keep))


def _newest_of(keys: pa.Array) -> np.ndarray | None:
    """Ascending positions of the last row of each key in `keys`; None when no key repeats."""
    n = len(keys)
    if n <= 1:
        return None
    if pa.types.is_integer(keys.type):
        values = keys.to_numpy(zero_copy_only=False)
        _, last_reversed = np.unique(values[::-1], return_index=True)
        if len(last_reversed) == n:
            return None
        return np.sort(n - 1 - last_reversed)
    table, position = _with_positions(pa.table({"k": keys}))
    newest = table.group_by("k", use_threads=False).aggregate([(position, "max")])
    if newest.num_rows == n:
        return None
    return np.sort(newest.column(f"{position}_max").to_numpy())


def _with_positions(keys: pa.Table) -> tuple[pa.Table, str]:
    """`keys` with a column of row positions 0, 1, 2 ... and that column's name (one no key has)."""
    name = "_position"
    while name in keys.column_names:
        name = "_" + name
    return keys.append_column(name, pa.array(np.arange(keys.num_rows, dtype=np.int64))), name


@dataclass(frozen=True, eq=False)
class MemTableSnapshot:
    """A MemTable's newest rows at one moment, the `rows` rows of its first `batches` batches: their
    positions (row i of `table` is MemTable row `positions[i]`, or row i when `positions` is None),
    their `keys` (`pk_index_key`-encoded, in the same order), the rows themselves (`table`, copied
    when first asked for: a point lookup takes only its rows, `take`), and the MemTable's indexes."""

    generation: int
    memtable: MemTable
    batches: int
    rows: int
    positions: np.ndarray | None
    keys: pa.Array

    @cached_property
    def table(self) -> pa.Table:
        """The newest rows, one per key, tombstones included, in forward write order."""
        return self.memtable.newest_at(self.batches, self.positions)

    def columns(self, names: Sequence[str]) -> pa.Table:
        """The newest rows' `names` columns, copying only those unless `table` was made."""
        if "table" in self.__dict__:  # made already (`cached_property` keeps it there)
            return self.table.select(list(names))
        return self.memtable.newest_at(self.batches, self.positions, names)

    def positions_of(self, wanted: pa.Array) -> np.ndarray:
        """The MemTable positions (ascending) of the newest rows whose key is in `wanted` (keys
        encoded as `pk_index_key` encodes them)."""
        if wanted.type != self.keys.type:
            wanted = wanted.cast(self.keys.type)
        hit = np.flatnonzero(pc.is_in(self.keys, value_set=wanted).to_numpy(zero_copy_only=False))
        return hit.astype(np.int64) if self.positions is None else self.positions[hit]

    def take(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at MemTable `positions` (from `positions_of`): `columns` and `_tombstone`."""
        return self.memtable.take_rows(positions, columns)

    def vectors(self, column: str) -> VectorRows | None:
        """The vector index of `column` over the MemTable's rows (indexing what it does not cover)."""
        mt = self.memtable
        return mt.indexes.vectors(column, mt.batches, self.batches, self.rows)

    def terms(self, column: str) -> TermRows | None:
        """The full-text index of `column` over the MemTable's rows (indexing what it does not cover)."""
        mt = self.memtable
        return mt.indexes.terms(column, mt.batches, self.batches, self.rows)


def _with_tombstone(schema: pa.Schema, columns: Sequence[str]) -> pa.Schema:
    """The fields of `schema` (a WAL schema) named by `columns`, then `_tombstone`."""
    return pa.schema([schema.field(c) for c in columns if c != TOMBSTONE] + [schema.field(TOMBSTONE)])
