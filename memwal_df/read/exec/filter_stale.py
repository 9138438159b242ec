"""FilterStaleExec: drops search candidates that a newer level of the LSM tree replaces or deletes.

A search ranks the rows of each level on its own (the base table, each region's generations and
MemTables). A candidate from level L is stale when its key exists in a level newer than L: for a
generation or MemTable, the newer levels of its region; for the base table, every unmerged level of
the regions read. Tombstones count: the older versions of a deleted key are stale.

`NewerLevels` answers "which of these keys does a newer level hold" exactly, with each level's key
set (read once per process for a generation, which never changes; once per query for a MemTable).
The level's primary-key bloom filter (spec "FilterStaleExec") is the pre-check while a generation's
key set is not in memory yet: when it rules out every candidate, the key set is not read at all. A
bloom false positive therefore costs a read, never a live row. Once the key sets of all the newer
generations are in memory, their union is kept (per set of generations) and probed once.

`FilterStaleExec` makes a level's search exact despite stale rows: it asks its child for the best `n`
candidates (n = k * overfetch at first), drops the stale ones, and asks again with 4n while fewer
than `k` survive and the child has more. Guarantees: `top(k)` is the child's best `k` live candidates
of the last round (all of them when the level holds fewer), best first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from memwal_df.format.bloom import hash_primary_keys
from memwal_df.read.cache import PerObjectCache
from memwal_df.read.exec.base import ExecNode, short_id
from memwal_df.read.exec.keyset import KeySet, key_array
from memwal_df.read.exec.ranked import RankedExec, grow
from memwal_df.read.snapshot import GENERATIONS, Level

__all__ = ["FilterStaleExec", "NewerLevels", "level_key_set"]

_MEMTABLE_KEYS: PerObjectCache[Level, KeySet | None] = PerObjectCache()


def _key_set_name(primary_key: Sequence[str]) -> str:
    return "keyset:" + ",".join(primary_key)


def level_key_set(level: Level, primary_key: Sequence[str], key_type: pa.DataType) -> KeySet | None:
    """Every key the level holds (tombstones included); None if the generation was collected."""
    pk = list(primary_key)

    def build() -> KeySet | None:
        keys = level.keys(pk)
        return None if keys is None else KeySet(keys, key_type)

    if level.kind == "memtable":
        return _MEMTABLE_KEYS.get(level, build)
    return level.cached(_key_set_name(pk), build)


def _key_set_in_memory(level: Level, primary_key: Sequence[str]) -> KeySet | None:
    """A generation's key set if this process has read it already (never reads it)."""
    if level.kind != "generation":
        return None
    return GENERATIONS.get(level.uri, _key_set_name(primary_key), lambda: None)  # type: ignore[no-any-return]


class NewerLevels:
    """The levels newer than some level, with an exact membership test of keys."""

    def __init__(self, levels: Sequence[Level], primary_key: Sequence[str], key_type: pa.DataType) -> None:
        self.levels = list(levels)
        self.primary_key = list(primary_key)
        self.key_type = key_type

    def describe(self) -> str:
        names = (
            f"{'bf' if lv.kind == 'generation' else 'memtable'}[region {short_id(lv.region_id)}]"
            f"[gen={lv.generation}]"
            for lv in self.levels
        )
        return "[" + ", ".join(names) + "]"

    def _generations_union(self) -> KeySet | None:
        """One key set of all the newer generations, once each of their key sets is in memory (then
        kept per process: generations never change); None before that."""
        generations = [lv for lv in self.levels if lv.kind == "generation"]
        if len(generations) < 2:
            return None
        digest = hashlib.sha256("\n".join(lv.uri for lv in generations).encode()).hexdigest()
        name = f"union:{digest}:{','.join(self.primary_key)}"
        owner = generations[0]
        union = GENERATIONS.get(owner.uri, name, lambda: None)
        if union is not None:
            return union  # type: ignore[no-any-return]
        sets = [_key_set_in_memory(lv, self.primary_key) for lv in generations]
        if any(key_set is None for key_set in sets):
            return None
        arrays = [key_set.to_array() for key_set in sets if key_set is not None]
        return owner.cached(name, lambda: KeySet.union(arrays, self.key_type))  # type: ignore[no-any-return]

    def stale(self, rows: pa.Table) -> np.ndarray:
        """Bool per row (its key columns): a newer level holds the row's key."""
        n = rows.num_rows
        out = np.zeros(n, dtype=bool)
        if n == 0 or not self.levels:
            return out
        columns = [rows.column(c) for c in self.primary_key]
        keys = key_array(columns)
        levels = self.levels
        union = self._generations_union()
        if union is not None:
            out |= union.contains(keys)
            levels = [lv for lv in levels if lv.kind != "generation"]
        hashes: np.ndarray | None = None
        for level in levels:
            todo = np.flatnonzero(~out)
            if len(todo) == 0:
                break
            key_set = _key_set_in_memory(level, self.primary_key)
            if key_set is None and (bloom := level.bloom()) is not None:
                if hashes is None:
                    hashes = hash_primary_keys(columns)
                todo = todo[bloom.contains_hashes(hashes[todo])]
                if len(todo) == 0:
                    continue
            if key_set is None:
                key_set = level_key_set(level, self.primary_key, self.key_type)
            if key_set is not None:
                out[todo[key_set.contains(keys.take(pa.array(todo)))]] = True
        return out


class FilterStaleExec(RankedExec):
    """The best candidates of one level whose key no newer level holds."""

    def __init__(self, child: RankedExec, newer: NewerLevels, overfetch: int = 2) -> None:
        self.child = child
        self.newer = newer
        self.k = child.k
        self.score = child.score
        self.descending = child.descending
        self.overfetch = overfetch
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

    def _live(self, candidates: pa.Table) -> pa.Table:
        stale = self.newer.stale(candidates)
        return candidates.filter(pa.array(~stale)) if stale.any() else candidates

    def top(self, n: int) -> pa.Table:
        return grow(self._fetch, self._live, n, n * self.overfetch)

    def rows(self, positions: np.ndarray) -> pa.Table:
        return self.child.rows(positions)
