"""The MemTable: the in-memory level of one region, one Arrow record batch per write.

Beside the batches it keeps a hash index from primary key to the position of the newest row with that
key (positions count rows across all batches in write order) and the primary-key bloom filter that is
flushed as `bloom_filter.bin`. Both catch up with the batches when they are read, in one vectorized pass
over every batch appended since, so a write pays only for appending its batch. Tombstones
(`_tombstone = true`) are rows like any other: the newest row of a key decides whether the key exists.

The maintained vector and full-text indexes (`memwal_df.memtable_index`) are kept in `indexes`: the
writer brings them up to date on every write (`indexed_write`) or in the background, and a reader's
`snapshot()` indexes whatever they do not cover yet when it searches.

Guarantees: `newest()` holds exactly one row per key, the newest, in forward write order; `lookup`
returns the same rows `newest()` holds for those keys. A MemTable is not thread-safe; its region
writer serializes access (its `indexes` are thread-safe).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memwal_df.bloom import BloomFilter
from memwal_df.maintained import MaintainedIndex
from memwal_df.memtable_index import MemTableIndexes, TermRows, VectorRows


def key_list(columns: Sequence[pa.Array | pa.ChunkedArray]) -> list[Hashable]:
    """Primary keys as hashable Python values: scalars for one column, tuples for composite keys."""
    values = [c.to_pylist() for c in columns]
    return values[0] if len(values) == 1 else list(zip(*values, strict=True))


class MemTable:
    """Batches of one generation with a pk → newest-row index and a bloom filter."""

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
        self._index: dict[Hashable, int] = {}
        self._indexed_batches = 0  # batches already in _index and _bloom
        self._indexed_rows = 0
        self.num_rows = 0
        self.nbytes = 0
        # WAL positions holding this MemTable's rows (inclusive); 0 while none is durable.
        self.last_wal_position = 0
        self.unlogged_entries = 0  # its WAL entries not stored yet (non-durable writers)

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_keys(self) -> int:
        return len(self._catch_up())

    @property
    def bloom(self) -> BloomFilter:
        """The bloom filter of every key written (tombstones included)."""
        self._catch_up()
        return self._bloom

    def append(self, batch: pa.RecordBatch) -> None:
        """Add one write (a batch in WAL schema) to the MemTable."""
        if batch.num_rows == 0:
            return
        self.batches.append(batch)
        self.num_rows += batch.num_rows
        self.nbytes += batch.nbytes

    def _catch_up(self) -> dict[Hashable, int]:
        """Index and bloom-filter the batches appended since the last call; returns the index."""
        if self._indexed_batches < len(self.batches):
            new = pa.Table.from_batches(self.batches[self._indexed_batches :], schema=self.schema)
            keys = [new.column(name) for name in self.primary_key]
            start = self._indexed_rows
            self._index.update(zip(key_list(keys), range(start, start + new.num_rows), strict=True))
            self._bloom.insert_keys(keys)
            self._indexed_batches = len(self.batches)
            self._indexed_rows += new.num_rows
        return self._index

    def to_table(self) -> pa.Table:
        """Every row written, in write order (duplicates and tombstones included)."""
        return pa.Table.from_batches(self.batches, schema=self.schema)

    def newest_positions(self) -> np.ndarray:
        """Positions of the newest row of every key, ascending (= forward write order)."""
        index = self._catch_up()
        return np.sort(np.fromiter(index.values(), dtype=np.int64, count=len(index)))

    def newest(self) -> pa.Table:
        """One row per key, the newest (tombstones included), in forward write order."""
        return self._newest()[0]

    def _newest(self) -> tuple[pa.Table, np.ndarray | None]:
        """(`newest()`, the positions of its rows; None when it is every row)."""
        table = self.to_table()
        if len(self._catch_up()) == table.num_rows:
            return table, None
        positions = self.newest_positions()
        # Take from one contiguous table: a take across the MemTable's many small batches costs ~30x more.
        return table.combine_chunks().take(pa.array(positions)), positions

    def snapshot(self) -> MemTableSnapshot:
        """`newest()` now, with access to the MemTable indexes for those rows."""
        table, positions = self._newest()
        return MemTableSnapshot(self.generation, table, self, len(self.batches), self.num_rows, positions)

    def lookup(self, keys: Sequence[pa.Array]) -> pa.Table:
        """The newest rows (tombstones included) of the given keys that this MemTable holds."""
        index = self._catch_up()
        hits = [p for k in key_list(keys) if (p := index.get(k)) is not None]
        return self.to_table().take(pa.array(sorted(set(hits)), pa.int64()))


@dataclass(frozen=True, eq=False)
class MemTableSnapshot:
    """A MemTable's newest rows at one moment (`table`, row i = MemTable row `positions[i]`, or row i
    when `positions` is None) and its indexes over the `rows` rows of its first `batches` batches."""

    generation: int
    table: pa.Table
    memtable: MemTable
    batches: int
    rows: int
    positions: np.ndarray | None

    def vectors(self, column: str) -> VectorRows | None:
        """The vector index of `column` over the MemTable's rows (indexing what it does not cover)."""
        mt = self.memtable
        return mt.indexes.vectors(column, mt.batches, self.batches, self.rows)

    def terms(self, column: str) -> TermRows | None:
        """The full-text index of `column` over the MemTable's rows (indexing what it does not cover)."""
        mt = self.memtable
        return mt.indexes.terms(column, mt.batches, self.batches, self.rows)
