"""Region views: the newest row of every key of one region's flushed, unmerged generations, kept in
memory across queries and patched when the region's generations change.

A view is immutable and belongs to one ordered set of generations (newest first). The next set is
reached from it without reading the generations it already holds:

* a flush adds newer generations on top: their rows are deduplicated newest first and replace the
  view's rows of the same keys;
* a merge removes the oldest generations: a view row whose newest version came from a merged
  generation is dropped. No generation kept holds that key (else that newer generation's row would
  be the view's), so the base table alone holds it now.

Any other change (a generation removed above a kept one, a generation number with a new directory)
rebuilds the view from its generations.

Guarantees: `rows` holds exactly one row per key held by any of the generations (tombstones
included): the one of the newest generation holding it, with every table column plus `_tombstone`;
`keys` is the set of those keys and `live` the number of rows that are not tombstones. A view is
kept only when every generation could be read (a garbage-collected one makes a view for one query).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.lsm.keys import KeySet, first_positions, key_array
from memwal_df.read.lsm.levels import GenerationLevel

__all__ = [
    "VIEWS",
    "VIEW_CACHE_BYTES",
    "RegionView",
    "ViewCache",
    "ViewShape",
    "region_view",
    "view_of_tables",
]

VIEW_CACHE_BYTES = 512 << 20
"""Default bound of the memory the process keeps region views in (least recently used dropped)."""

GenerationId = tuple[int, str]  # (generation number, directory)


@dataclass(frozen=True)
class RegionView:
    """The newest row per key of a region's unmerged generations (see the module docstring)."""

    region_id: uuid.UUID
    generations: tuple[GenerationId, ...]  # newest first
    rows: pa.Table
    generation_of: np.ndarray  # per row, the generation it came from
    keys: KeySet
    row_keys: pa.Array  # per row, its key (`key_array` of the key columns)
    tombstone: np.ndarray  # per row, bool
    complete: bool  # every generation was read (a view of a collected generation is not kept)
    parent: RegionView | None = field(default=None, repr=False, compare=False)
    added: KeySet | None = field(default=None, repr=False, compare=False)
    """When the view is its `parent` with generations added on top (a flush, no merge): the keys of
    their rows. Its keys are then the parent's plus these, which lets state derived from the parent
    be patched instead of recomputed."""

    @property
    def live(self) -> int:
        """The number of rows that are not tombstones."""
        return int(len(self.tombstone) - np.count_nonzero(self.tombstone))

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.generation_of.nbytes + self.row_keys.nbytes + len(self.tombstone))


@dataclass(frozen=True)
class ViewShape:
    """What a view's rows look like: the table's columns then `_tombstone`, and how keys compare."""

    schema: pa.Schema  # the row schema
    primary_key: tuple[str, ...]
    key_type: pa.DataType

    @classmethod
    def of(cls, table_schema: pa.Schema, primary_key: Sequence[str], key_type: pa.DataType) -> ViewShape:
        fields = [pa.field(f.name, f.type, f.nullable) for f in table_schema]
        schema = pa.schema([*fields, pa.field(TOMBSTONE, pa.bool_(), nullable=False)])
        return cls(schema, tuple(primary_key), key_type)

    def conform(self, t: pa.Table) -> pa.Table:
        t = t.select(self.schema.names)
        return t if t.schema.equals(self.schema) else t.cast(self.schema)

    def keys(self, t: pa.Table) -> pa.Array:
        return key_array([t.column(c) for c in self.primary_key])


def _newest_first(
    tables: Sequence[pa.Table], generations: Sequence[int], shape: ViewShape
) -> tuple[pa.Table, np.ndarray, pa.Array]:
    """The rows of `tables` (levels newest first, each with one row per key) keeping the first row of
    every key; with the generation and key of each row."""
    nonempty = [(shape.conform(t), g) for t, g in zip(tables, generations, strict=True) if t.num_rows]
    if not nonempty:
        empty = shape.schema.empty_table()
        return empty, np.empty(0, np.int64), shape.keys(empty)
    rows = pa.concat_tables([t for t, _ in nonempty]).combine_chunks()
    gens = np.concatenate([np.full(t.num_rows, g, np.int64) for t, g in nonempty])
    keys = shape.keys(rows)
    if len(nonempty) > 1:
        first = first_positions(keys)
        if first is not None:
            index = pa.array(first)
            rows, gens, keys = rows.take(index), gens[first], keys.take(index)
    return rows, gens, keys


def _read(levels: Sequence[GenerationLevel]) -> tuple[list[pa.Table], list[int], bool]:
    """Every column of each level that is still there, their generations, and whether all were."""
    tables, generations = [], []
    for level in levels:
        t = level.to_table()
        if t is not None:
            tables.append(t)
            generations.append(level.generation)
    return tables, generations, len(tables) == len(levels)


def _ids(levels: Sequence[GenerationLevel]) -> tuple[GenerationId, ...]:
    return tuple((lv.generation, lv.path) for lv in levels)


def build_view(region_id: uuid.UUID, levels: Sequence[GenerationLevel], shape: ViewShape) -> RegionView:
    """A view read from every level (newest first)."""
    tables, generations, complete = _read(levels)
    rows, gens, keys = _newest_first(tables, generations, shape)
    return _view(region_id, _ids(levels), rows, gens, keys, shape.key_type, complete)


def view_of_tables(
    region_id: uuid.UUID, tables: Sequence[pa.Table], generations: Sequence[int], shape: ViewShape
) -> RegionView:
    """A view of in-memory levels (newest first; e.g. a writer's MemTable copies), never kept."""
    rows, gens, keys = _newest_first(tables, generations, shape)
    return _view(region_id, (), rows, gens, keys, shape.key_type, False)


def _view(
    region_id: uuid.UUID,
    ids: tuple[GenerationId, ...],
    rows: pa.Table,
    gens: np.ndarray,
    keys: pa.Array,
    key_type: pa.DataType,
    complete: bool,
) -> RegionView:
    return RegionView(region_id, ids, rows, gens, KeySet(keys, key_type), keys, _tombstones(rows), complete)


def _tombstones(rows: pa.Table) -> np.ndarray:
    if not rows.num_rows:
        return np.zeros(0, bool)
    return np.asarray(rows.column(TOMBSTONE).to_numpy(zero_copy_only=False), dtype=bool)


def _bottom_and_top(removed: set[int], kept: set[int], added: set[int]) -> bool:
    """Whether, in generation order, every removed generation comes before every kept one and every
    kept one before every added one (the changes a merge and a flush make)."""
    if len(removed | kept | added) != len(removed) + len(kept) + len(added):
        return False  # a generation number with another directory
    return max(removed, default=-1) < min(kept | added, default=2**63) and max(kept, default=-1) < min(
        added, default=2**63
    )


def advance_view(prev: RegionView, levels: Sequence[GenerationLevel], shape: ViewShape) -> RegionView | None:
    """The view of `levels` derived from `prev` when the change is generations added on top and/or
    merged ones removed at the bottom (reading only the added ones); None for any other change."""
    ids = _ids(levels)
    if ids == prev.generations:
        return prev
    before = set(prev.generations)
    added = [lv for lv in levels if (lv.generation, lv.path) not in before]
    removed_gens = {g for g, _ in before - set(ids)}
    if not _bottom_and_top(removed_gens, {g for g, _ in before & set(ids)}, {lv.generation for lv in added}):
        return None
    tables, generations, complete = _read(added)
    top, top_gens, top_keys = _newest_first(tables, generations, shape)
    key_type = shape.key_type
    keep = np.ones(prev.rows.num_rows, dtype=bool)
    if removed_gens:
        keep &= prev.generation_of > max(removed_gens)
    if top.num_rows and prev.rows.num_rows:
        # a hash probe of the view's (unsorted) keys into the few added ones
        keep &= ~np.asarray(
            pc.is_in(prev.row_keys, value_set=top_keys).to_numpy(zero_copy_only=False), dtype=bool
        )
    old = prev.rows.filter(pa.array(keep)) if not keep.all() else prev.rows
    old_keys = prev.row_keys.filter(pa.array(keep)) if not keep.all() else prev.row_keys
    if top.num_rows == 0:
        rows, gens, keys = old, prev.generation_of[keep], old_keys
    else:
        rows = pa.concat_tables([top, old]).combine_chunks()
        gens = np.concatenate([top_gens, prev.generation_of[keep]])
        keys = pa.concat_arrays([top_keys, old_keys])
    complete = complete and prev.complete
    if removed_gens:
        return _view(prev.region_id, ids, rows, gens, keys, key_type, complete)
    added_keys = KeySet(top_keys, key_type)
    key_set = KeySet.merge([prev.keys, added_keys], key_type)
    return RegionView(
        prev.region_id, ids, rows, gens, key_set, keys, _tombstones(rows), complete, prev, added_keys
    )


class ViewCache:
    """The latest views of each region of each table in this process, bounded in bytes (least
    recently used region dropped first). Thread-safe; racing queries may build a view twice."""

    def __init__(self, max_bytes: int = VIEW_CACHE_BYTES, per_region: int = 2) -> None:
        self._views: OrderedDict[tuple[str, uuid.UUID], list[RegionView]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self._per_region = per_region
        self.builds = 0  # views read whole from their generations
        self.advances = 0  # views derived from an earlier one

    def candidates(self, table: str, region_id: uuid.UUID) -> list[RegionView]:
        with self._lock:
            found = self._views.get((table, region_id))
            if found is None:
                return []
            self._views.move_to_end((table, region_id))
            return list(found)

    def keep(self, table: str, view: RegionView) -> None:
        if not view.complete:
            return
        key = (table, view.region_id)
        with self._lock:
            views = [v for v in self._views.get(key, []) if v.generations != view.generations]
            self._views[key] = [view, *views][: self._per_region]
            self._views.move_to_end(key)
            while len(self._views) > 1 and self.nbytes > self.max_bytes:
                self._views.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for views in self._views.values() for v in views)


VIEWS = ViewCache()


def region_view(
    table: str,
    region_id: uuid.UUID,
    levels: Sequence[GenerationLevel],
    shape: ViewShape,
    cache: ViewCache = VIEWS,
) -> RegionView:
    """The view of a region's generation `levels` (newest first) of the table at `table`: a kept one,
    else one derived from a kept one of the region, else one read whole; kept for later queries."""
    ids = _ids(levels)
    found = cache.candidates(table, region_id)
    for view in found:
        if view.generations == ids:
            return view
    for view in found:
        derived = advance_view(view, levels, shape)
        if derived is not None:
            cache.advances += 1
            cache.keep(table, derived)
            return derived
    cache.builds += 1
    view = build_view(region_id, levels, shape)
    cache.keep(table, view)
    return view
