"""What the partitions of one scan share: each region's newest rows and the base rows they shadow.

Derived once per query, lazily and thread-safely, from state the process keeps across queries: each
region's `RegionView` (its flushed, unmerged generations deduplicated, patched on flush and merge) and
the base version's `BaseKeyIndex` (patched across base versions). A writer's MemTable copies (planned
with `writer=`) are per query: they are deduplicated here and shadow both their region's view and the
base.

Guarantees: `region(r)` is region r's newest version of every key its levels hold (MemTable rows over
its view); `shadow()` is every live base row whose key any of the scanned regions' levels holds,
split into parts that never hold the same row twice.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow.compute as pc

from memwal_df.read.lsm.base_key_index import BaseKeyIndex, BaseShadow, ShadowSet, base_key_index
from memwal_df.read.lsm.keys import KeySet
from memwal_df.read.lsm.levels import GenerationLevel, MemTableLevel
from memwal_df.read.lsm.snapshot import ReadSnapshot, RegionLevels
from memwal_df.read.scan.region_view import RegionView, ViewShape, region_view, view_of_tables

__all__ = ["RegionRows", "ScanState", "scannable"]


def scannable(region: RegionLevels) -> bool:
    """Whether a region's levels are MemTable copies over generations (the order snapshots make)."""
    seen_generation = False
    for level in region.levels:
        if isinstance(level, GenerationLevel):
            seen_generation = True
        elif not isinstance(level, MemTableLevel) or seen_generation:
            return False
    return True


@dataclass(frozen=True)
class RegionRows:
    """A region's newest rows: `top` (its MemTable copies deduplicated, or None) over `view`, whose rows
    of keys `top` holds are older versions."""

    view: RegionView
    top: RegionView | None

    @cached_property
    def live(self) -> list[tuple[RegionView, np.ndarray]]:
        """The views to read, newest first, each with a bool per row: the row is the newest version of
        its key (no newer view holds the key) and not a tombstone."""
        out = []
        if self.top is not None:
            out.append((self.top, ~self.top.tombstone))
        keep = ~self.view.tombstone
        if self.top is not None and self.top.rows.num_rows and len(keep):
            # a hash probe of the view's (unsorted) keys into the MemTable copies' keys
            newer = pc.is_in(self.view.row_keys, value_set=self.top.row_keys)
            keep &= ~np.asarray(newer.to_numpy(zero_copy_only=False), dtype=bool)
        out.append((self.view, keep))
        return out


class ScanState:
    """The regions and base shadow of one scan (see the module docstring)."""

    def __init__(self, snapshot: ReadSnapshot, regions: Sequence[RegionLevels], shape: ViewShape) -> None:
        self.snapshot = snapshot
        self.regions = list(regions)
        self.shape = shape
        self._lock = threading.RLock()
        self._rows: dict[uuid.UUID, RegionRows] = {}
        self._shadow: ShadowSet | None = None
        self._keys: KeySet | None = None

    @property
    def table(self) -> str:
        return str(self.snapshot.base.uri)

    def region(self, region: RegionLevels) -> RegionRows:
        with self._lock:
            found = self._rows.get(region.region_id)
            if found is None:
                found = self._rows[region.region_id] = self._region_rows(region)
            return found

    def _region_rows(self, region: RegionLevels) -> RegionRows:
        generations = [lv for lv in region.levels if isinstance(lv, GenerationLevel)]
        memtables = [lv for lv in region.levels if isinstance(lv, MemTableLevel)]
        view = region_view(self.table, region.region_id, generations, self.shape)
        top = None
        if memtables:
            tables = [m.table for m in memtables]
            top = view_of_tables(region.region_id, tables, [m.generation for m in memtables], self.shape)
        return RegionRows(view, top)

    def shadow_keys(self) -> KeySet:
        """Every key the scanned regions' levels hold (for an anti-join by key, when the base is too
        large to index)."""
        with self._lock:
            if self._keys is None:
                sets = [v.keys for r in self.regions if r.levels for v, _ in self.region(r).live]
                self._keys = KeySet.merge(sets, self.shape.key_type)
            return self._keys

    def base_index(self) -> BaseKeyIndex:
        s = self.snapshot
        return base_key_index(self.table, s.base, s.storage, self.shape.primary_key)

    def shadow(self) -> ShadowSet:
        """The base rows the scanned regions shadow, in disjoint parts: each region view's (kept with the
        base key index, per view), then the MemTable copies' not among them."""
        with self._lock:
            if self._shadow is None:
                self._shadow = self._compute_shadow()
            return self._shadow

    def _compute_shadow(self) -> ShadowSet:
        rows = [self.region(r) for r in self.regions if r.levels]
        if not rows:
            return ShadowSet([])
        index = self.base_index()
        parts = [shadow for r in rows if len(shadow := index.view_shadow(r.view))]
        tops = [r.top for r in rows if r.top is not None and r.top.rows.num_rows]
        if tops:
            addrs = np.sort(np.concatenate([index.locate(t.keys.to_array()) for t in tops]))
            for part in parts:
                addrs = addrs[~part.hidden(addrs)]
            if len(addrs):
                parts.append(BaseShadow(addrs, index.physical_rows))
        return ShadowSet(parts, lambda: index.mask(parts))
