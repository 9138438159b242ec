"""The key directory of a region writer: where, among the MemTables it holds, the newest row of each
key is, for the current rows of partial and conditional writes (`memwal_df.write.partial`).

It maps each key (`pk_index_key`-encoded) to the generation and row position of its newest row in the
MemTables the writer holds (active, sealed, and the flushed ones it keeps), so one hash probe per
asked key answers for all of them, instead of one search per MemTable. It catches up with the rows
written since the last lookup when asked (a writer that makes no partial or conditional write never
builds one), and forgets a MemTable once the writer no longer holds it.

Guarantees: `level(memtables)` answers each asked key from the newest of `memtables` holding it, with
that MemTable's newest row of the key (tombstones included), exactly as searching the MemTables
newest first would. A directory is not thread-safe: its region writer asks it inside the exclusive
section of a write. It holds about `KEY_BYTES` per key besides the MemTables' rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_df.write.memtable import MemTable
from memwal_df.write.partial import encoded_keys

__all__ = ["KEY_BYTES", "KeyDirectory"]

KEY_BYTES = 120
"""About what one key's entry in a directory costs (a dict slot, a key and a position object)."""

_POSITION_BITS = 32
_POSITION_MASK = (1 << _POSITION_BITS) - 1
_SAME_WIDTH_INT = {16: pa.int16(), 32: pa.int32(), 64: pa.int64()}


def _hashable_keys(keys: pa.Array) -> list[Any]:
    """`keys` (`pk_index_key`-encoded, no nulls) as Python values that are equal exactly when Arrow's
    hashing finds the keys equal: integers as themselves, floats and other fixed-width values by
    their bits (0.0 and -0.0 are two keys, as are NaNs of other bits), strings and binaries as
    `str`/`bytes`."""
    t = keys.type
    if pa.types.is_integer(t):
        return keys.to_numpy(zero_copy_only=False).tolist()
    if (pa.types.is_floating(t) or pa.types.is_temporal(t)) and t.bit_width in _SAME_WIDTH_INT:
        return keys.view(_SAME_WIDTH_INT[t.bit_width]).to_numpy().tolist()
    return keys.to_pylist()


class KeyDirectory:
    """Key -> (generation, row position) of its newest row among the MemTables a region writer holds."""

    def __init__(self) -> None:
        self._where: dict[Any, int] = {}  # key -> generation << 32 | row position in its MemTable
        # generation -> (its MemTable, batches and rows of it the directory covers)
        self._covered: dict[int, tuple[MemTable, int, int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def level(self, memtables: Sequence[MemTable]) -> _HeldLevel:
        """The `KeyedLevel` (`memwal_df.write.newest_rows`) of `memtables` (newest first: every MemTable
        the writer holds), with the directory brought up to date with them."""
        held = {m.generation: m for m in memtables}
        for generation, (memtable, _, _) in list(self._covered.items()):
            if held.get(generation) is not memtable:  # not held (or another MemTable of that generation)
                self._forget(generation)
        newest_covered = max(self._covered, default=-1)
        if any(m.generation < newest_covered and m.generation not in self._covered for m in memtables):
            self._where.clear()  # an older MemTable seen for the first time: cover all again, in order
            self._covered.clear()
        for memtable in sorted(memtables, key=lambda m: m.generation):  # oldest first: newer rows win
            self._cover(memtable)
        return _HeldLevel(self._where, held)

    def _cover(self, memtable: MemTable) -> None:
        """Add the rows `memtable` got since it was last covered."""
        _, batches, rows = self._covered.get(memtable.generation, (memtable, 0, 0))
        if batches < len(memtable.batches):
            keys = _keys_of(memtable, memtable.batches[batches:])
            start = memtable.generation << _POSITION_BITS | rows
            self._where.update(zip(keys, range(start, start + len(keys)), strict=True))
            rows += len(keys)
        self._covered[memtable.generation] = (memtable, len(memtable.batches), rows)

    def _forget(self, generation: int) -> None:
        """Drop the keys whose newest held row is in `generation`'s MemTable (no longer held)."""
        memtable, batches, _ = self._covered.pop(generation)
        if not batches:
            return
        keys = _keys_of(memtable, memtable.batches[:batches])
        at = np.fromiter(map(self._where.get, keys, repeat(-1)), np.int64, len(keys))
        mine = (at >= 0) & ((at >> _POSITION_BITS) == generation)
        deque(map(self._where.pop, compress(keys, mine.tolist()), repeat(None)), maxlen=0)


class _HeldLevel:
    """The MemTables a writer holds, as one level: the newest row of each asked key among them."""

    def __init__(self, where: dict[Any, int], held: dict[int, MemTable]) -> None:
        self._where = where
        self._held = held

    def find(
        self, keys: pa.Table | None, asked: pa.Array, columns: Sequence[str]
    ) -> tuple[pa.Table, np.ndarray]:
        """(the newest held rows of the asked keys: `columns` and `_tombstone`, one per key; the
        position there of each asked key's row, -1 where no held MemTable has the key). `keys` is
        not needed."""
        at = np.fromiter(map(self._where.get, _hashable_keys(asked), repeat(-1)), np.int64, len(asked))
        generations = at >> _POSITION_BITS
        where = np.full(len(asked), -1, np.int64)
        parts = []
        offset = 0
        for generation in np.unique(generations[at >= 0]).tolist():
            mine = np.flatnonzero(generations == generation)
            positions, row = np.unique(at[mine] & _POSITION_MASK, return_inverse=True)
            parts.append(self._held[generation].take_rows(positions, columns))
            where[mine] = row + offset
            offset += len(positions)
        if not parts:
            return pa.table({}), where
        return (parts[0] if len(parts) == 1 else pa.concat_tables(parts)), where


def _keys_of(memtable: MemTable, batches: Sequence[pa.RecordBatch]) -> list[Any]:
    """The keys of `batches` (some of `memtable`'s), one per row, as the directory holds them."""
    return _hashable_keys(
        encoded_keys(pa.Table.from_batches(batches, schema=memtable.schema), memtable.primary_key)
    )
