"""FilterStaleExec: drops search candidates that a newer level of the LSM tree replaces or deletes.

A search ranks the rows of each level on its own (the base table, each region's generations and
MemTables). A candidate from level L is stale when its key exists in a level newer than L: for a
generation or MemTable, the newer levels of its region; for the base table, every unmerged level of
the regions read. Tombstones count: the older versions of a deleted key are stale.

`NewerLevels` answers "which of these keys does a newer level hold": each newer level's primary-key
bloom filter is asked first (spec "FilterStaleExec"), and only keys it may hold are checked against the
level's exact key set, so a bloom false positive never drops a live row. A generation's key set is read
once per process (generations never change); a MemTable's once per query.

`FilterStaleExec` makes a level's search exact despite stale rows: it asks its ranked child for the
best `n` candidates (n = k * overfetch at first), drops the stale ones, and asks again with 4n while
fewer than `k` survive and the child has more. Guarantees: the output is the child's best `k` live
candidates of the last round (all of them when the level holds fewer), best first.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from memwal_df.bloom import hash_primary_keys
from memwal_df.exec._cache import PerObjectCache
from memwal_df.exec.base import ExecNode, short_id
from memwal_df.exec.keyset import KeySet, key_array
from memwal_df.snapshot import Level

__all__ = ["FilterStaleExec", "NewerLevels", "RankedExec", "grow"]

_MEMTABLE_KEYS: PerObjectCache[Level, KeySet | None] = PerObjectCache()


def level_key_set(level: Level, primary_key: Sequence[str], key_type: pa.DataType) -> KeySet | None:
    """Every key the level holds (tombstones included); None if the generation was collected."""
    pk = list(primary_key)

    def build() -> KeySet | None:
        keys = level.keys(pk)
        return None if keys is None else KeySet(keys, key_type)

    if level.kind == "memtable":
        return _MEMTABLE_KEYS.get(level, build)
    return level.cached(f"keyset:{','.join(pk)}", build)


class NewerLevels:
    """The levels newer than some level, with an exact membership test of keys."""

    def __init__(self, levels: Sequence[Level], primary_key: Sequence[str], key_type: pa.DataType) -> None:
        self.levels = list(levels)
        self.primary_key = list(primary_key)
        self.key_type = key_type

    def describe(self) -> str:
        return (
            "["
            + ", ".join(f"bf[region {short_id(lv.region_id)}][gen={lv.generation}]" for lv in self.levels)
            + "]"
        )

    def key_sets(self) -> list[KeySet]:
        """The exact key set of each newer level that still exists."""
        sets = (level_key_set(lv, self.primary_key, self.key_type) for lv in self.levels)
        return [s for s in sets if s is not None]

    def holds(self, keys: pa.Array) -> np.ndarray:
        """Bool per key: a newer level holds it (exact key sets only: for whole levels)."""
        out = np.zeros(len(keys), dtype=bool)
        for key_set in self.key_sets():
            out |= key_set.contains(keys)
        return out

    def stale(self, rows: pa.Table | pa.RecordBatch) -> np.ndarray:
        """Bool per row: a newer level holds the row's key (bloom pre-check, then exact)."""
        n = rows.num_rows
        out = np.zeros(n, dtype=bool)
        if n == 0 or not self.levels:
            return out
        columns = [rows.column(c) for c in self.primary_key]
        keys = key_array(columns)
        hashes: np.ndarray | None = None
        for level in self.levels:
            todo = np.flatnonzero(~out)
            if len(todo) == 0:
                break
            bloom = level.bloom()
            if bloom is not None:
                if hashes is None:
                    hashes = hash_primary_keys(columns)
                todo = todo[bloom.contains_hashes(hashes[todo])]
                if len(todo) == 0:
                    continue
            key_set = level_key_set(level, self.primary_key, self.key_type)
            if key_set is not None:
                out[todo[key_set.contains(keys.take(pa.array(todo)))]] = True
        return out


class RankedExec(ExecNode):
    """A level's search: `top(n)` is its best `n` rows, best first (fewer only when it has no more);
    `execute()` yields `top(k)`."""

    k: int

    @abstractmethod
    def top(self, n: int) -> pa.Table:
        """The best `n` rows of the level, best first."""

    def execute(self) -> Iterator[pa.RecordBatch]:
        yield from self.top(self.k).to_batches()


def grow(
    fetch: Callable[[int], pa.Table], keep: Callable[[pa.Table], pa.Table], want: int, start: int
) -> pa.Table:
    """`keep(fetch(n))` for n = start, 4*start, ... until it has `want` rows or `fetch(n)` returned
    fewer than `n` (the source is exhausted); the first `want` of them."""
    n = max(start, want, 1)
    while True:
        rows = fetch(n)
        kept = keep(rows)
        if kept.num_rows >= want or rows.num_rows < n:
            return kept.slice(0, want)
        n *= 4


class FilterStaleExec(ExecNode):
    """The best `k` candidates of one level whose key no newer level holds."""

    def __init__(self, child: RankedExec, newer: NewerLevels, k: int, overfetch: int = 2) -> None:
        self.child = child
        self.newer = newer
        self.k = k
        self.overfetch = overfetch
        self.schema = child.schema
        self.fetched: int | None = None  # candidates asked of the child in the last round (after execute)

    @property
    def children(self) -> list[ExecNode]:
        return [self.child]

    def describe(self) -> str:
        line = f"FilterStaleExec: k={self.k}, newer={self.newer.describe()}"
        return line if self.fetched is None else line + f", fetched={self.fetched}"

    def _fetch(self, n: int) -> pa.Table:
        self.fetched = n
        return self.child.top(n)

    def _live(self, rows: pa.Table) -> pa.Table:
        stale = self.newer.stale(rows)
        return rows.filter(pa.array(~stale)) if stale.any() else rows

    def execute(self) -> Iterator[pa.RecordBatch]:
        if self.k <= 0:
            return
        start = self.k * self.overfetch if self.newer.levels else self.k
        yield from grow(self._fetch, self._live, self.k, start).to_batches()
