"""Which keys a newer level of the LSM tree holds: the staleness test of search candidates.

A search ranks the rows of each level on its own. A candidate from level L is stale when its key
exists in a level newer than L (tombstones count: the older versions of a deleted key are stale).

`NewerLevels` answers "which of these keys does a newer level hold" exactly, with each level's key
set (read once per process for a generation, which never changes; once per query for a MemTable).
The level's primary-key bloom filter (spec "FilterStaleExec") is the pre-check while a generation's
key set is not in memory yet: when it rules out every candidate, the key set is not read at all. A
bloom false positive therefore costs a read, never a live row. Once the key sets of all the newer
generations are in memory, their union is kept (per set of generations) and probed once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from memwal_df.format.bloom import hash_primary_keys
from memwal_df.read.lsm.cache import GENERATIONS
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.lsm.labels import short_id
from memwal_df.read.lsm.levels import GenerationLevel, Level

__all__ = ["NewerLevels"]


class NewerLevels:
    """The levels newer than some level, with an exact membership test of keys."""

    def __init__(self, levels: Sequence[Level], primary_key: Sequence[str], key_type: pa.DataType) -> None:
        self.levels = list(levels)
        self.primary_key = list(primary_key)
        self.key_type = key_type

    def describe(self) -> str:
        names = (
            f"{'bf' if isinstance(lv, GenerationLevel) else 'memtable'}[region {short_id(lv.region_id)}]"
            f"[gen={lv.generation}]"
            for lv in self.levels
        )
        return "[" + ", ".join(names) + "]"

    def _generations_union(self) -> KeySet | None:
        """One key set of all the newer generations, once each of their key sets is in memory (then
        kept per process: generations never change); None before that."""
        generations = [lv for lv in self.levels if isinstance(lv, GenerationLevel)]
        if len(generations) < 2:
            return None
        digest = hashlib.sha256("\n".join(lv.uri for lv in generations).encode()).hexdigest()
        name = f"union:{digest}:{','.join(self.primary_key)}"
        owner = generations[0]
        union = GENERATIONS.get(owner.uri, name, lambda: None)
        if union is not None:
            return union
        sets = [lv.key_set_in_memory(self.primary_key) for lv in generations]
        if any(key_set is None for key_set in sets):
            return None
        arrays = [key_set.to_array() for key_set in sets if key_set is not None]
        return owner.cached(name, lambda: KeySet.union(arrays, self.key_type))

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
            levels = [lv for lv in levels if not isinstance(lv, GenerationLevel)]
        hashes: np.ndarray | None = None
        for level in levels:
            todo = np.flatnonzero(~out)
            if len(todo) == 0:
                break
            key_set = level.key_set_in_memory(self.primary_key)
            if key_set is None and (bloom := level.bloom()) is not None:
                if hashes is None:
                    hashes = hash_primary_keys(columns)
                todo = todo[bloom.contains_hashes(hashes[todo])]
                if len(todo) == 0:
                    continue
            if key_set is None:
                key_set = level.key_set(self.primary_key, self.key_type)
            if key_set is not None:
                out[todo[key_set.contains(keys.take(pa.array(todo)))]] = True
        return out
