"""DeduplicateExec: the live, newest rows of one region's unmerged levels, as an anti-join by level.

Levels are read newest first. Each level already holds at most one row per key, so a row of level L
is the newest version of its key exactly when no newer level of the region holds that key (a
tombstone included). The operator therefore probes each level's rows against the keys of the newer
levels (`LevelKeys`: one `KeySet` grown level by level, shared with the base table's shadow) and drops
the rows whose key is there; tombstones are dropped from the output but shadow older levels. This is
the spec's "newest by (_gen, _rowaddr)" without hashing or sorting any level whole.

The pushed filter is applied to each level's rows after the anti-join decision is made from the
level's full key set, so a stale row that matches the filter can never stand in for a newer row that
does not (filtering before deduplication would resurrect it).

Guarantees: output rows are live (not deleted), newest per key, match `filter`, and carry exactly
`columns`; unmerged levels whose directory was garbage-collected are skipped (their rows are in the
base), a collected gap level of a catch-up plan raises `MissingGenerationError`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.lsm.snapshot import RegionLevels

__all__ = ["DeduplicateExec", "LevelKeys"]


class LevelKeys:
    """The keys of a region's first `i` levels (newest first), built level by level and shared by the
    region's `DeduplicateExec` (which needs them for i = 1, 2, ...) and the base table's shadow (which
    needs all of them). Each level's keys are merged into the previous prefix once; the newest prefix
    is kept, so consumers that go forward, as both do, never rebuild it. Thread-safe."""

    def __init__(self, region: RegionLevels, primary_key: Sequence[str], key_type: pa.DataType) -> None:
        self.region = region
        self.primary_key = list(primary_key)
        self._type = key_type
        self._lock = threading.Lock()
        self._count = 0
        self._keys = KeySet.union([], key_type)

    def upto(self, count: int) -> KeySet:
        """The keys of `levels[:count]` (levels that are gone hold none)."""
        with self._lock:
            if count < self._count:
                self._count, self._keys = 0, KeySet.union([], self._type)
            while self._count < count:
                keys = self.region.levels[self._count].keys(self.primary_key)
                if keys is not None:
                    self._keys = self._keys.add(keys)
                self._count += 1
            return self._keys

    def all(self) -> KeySet:
        return self.upto(len(self.region.levels))


class DeduplicateExec(ExecNode):
    """Newest live rows of one region's levels (not the base table). The last `gap` levels are
    generations merged into the base but not covered by the index a catch-up plan reads the base
    through (see `memwal_df.read.scan.catchup`): they stand in for base rows, so they must be readable."""

    def __init__(
        self,
        keys: LevelKeys,
        columns: Sequence[str],
        filter: Any = None,
        schema: pa.Schema | None = None,
        gap: int = 0,
        gap_index: str = "",
    ) -> None:
        self.keys = keys
        self.region = keys.region
        self.schema = schema
        self.primary_key = keys.primary_key
        self.columns = list(columns)
        self.filter = filter
        self.gap = gap
        self.gap_index = gap_index

    def describe(self) -> str:
        names = [f"{lv.noun[0]}{lv.generation}" for lv in self.region.levels]
        split = len(names) - self.gap
        line = f"DeduplicateExec: region {self.region.region_id} levels=[{', '.join(names[:split])}]"
        if self.gap:
            line += f" then merged, not in {self.gap_index}: [{', '.join(names[split:])}]"
        f = "" if self.filter is None else f", filter={self.filter}"
        return f"{line} (newest first){f}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        needed = list(dict.fromkeys([*self.columns, *self.primary_key, TOMBSTONE]))
        levels = self.region.levels
        first_gap = len(levels) - self.gap
        for i, level in enumerate(levels):
            rows = level.to_table(needed, self.filter, self.schema)
            if rows is None:
                if i >= first_gap:
                    raise MissingGenerationError(
                        f"{level.name} was garbage-collected while a catch-up plan read it instead of"
                        " the base fragments that hold its rows; run the query again"
                    )
                continue  # garbage-collected: its rows are in the base table
            row_keys = key_array([rows.column(c) for c in self.primary_key])
            if self.filter is None:
                level.set_keys(row_keys)  # every key of the level: no second read
            if not rows.num_rows:
                continue
            keep = pc.invert(rows.column(TOMBSTONE)).to_numpy(zero_copy_only=False)
            if i and len(shadow := self.keys.upto(i)):
                keep &= ~shadow.contains(row_keys)
            if not self.columns:  # count(*): only the number of rows matters
                if n := int(keep.sum()):
                    yield pa.record_batch([pa.nulls(n)], names=["n"]).select([])
            else:
                out = rows.filter(pa.array(keep)) if not keep.all() else rows
                yield from out.select(self.columns).to_batches()
