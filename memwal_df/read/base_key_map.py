"""The base table's key map for point lookups, carried across base versions.

A `BaseKeyMap` holds every key of one base version (a one-column integer key), sorted, with where
its row is: the fragment and the row's physical offset in it, plus each fragment's deleted physical
offsets (a row's visible offset, what `LanceFragment.take` takes, is its physical offset minus the
deleted offsets below it). 16 bytes per row, plus 4 per deleted row.

Built from one scan of the key column the first time a table is looked up in; for every later base
version it is patched from the newest map of the same table (`of_version`), reading only the
fragments that are new (or whose data files changed) in that version:

* a fragment with the same id, data files and physical row count is kept; when its deletion vector is
  the same, its entries carry over as they are;
* a key read from a new fragment that the previous map holds in a kept fragment has moved (an upsert
  deletes the old row and appends the new one): its old offset joins that fragment's deleted offsets;
* a kept fragment whose deletion vector changed is exact when the offsets so deleted add up to the
  deleted-row count of its new deletion file: the base holds each key once and deletions only ever
  grow (the new deletion file's read version is not older), so the rows still mapped include every
  live row, and equal counts leave no other. Otherwise (plain deletes, a restore) that fragment's
  keys are read again.

A patch reads the new fragments' keys and does O(rows) array copies; a full build reads every key.
`STATS` counts both, and the key rows read.

Guarantees: the map of a version lists exactly that version's live rows; a map is never changed once
made (readers holding an older version keep theirs); `take` verifies the rows it takes carry the keys
mapped (None otherwise, and the caller scans).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.read.batches import projected_schema
from memwal_df.read.cache import PerObjectCache
from memwal_df.read.fragments import fragment_take

__all__ = [
    "MAX_MAPPED_BASE_ROWS",
    "STATS",
    "BaseKeyMap",
    "KeyMapStats",
    "base_key_map",
    "mappable",
    "of_version",
]

MAX_MAPPED_BASE_ROWS = 4_000_000
_ROWADDR = "_rowaddr"
_LOW32 = np.uint64(0xFFFFFFFF)
_MAX_TABLES = 16  # tables whose newest map is kept for patching


@dataclass
class KeyMapStats:
    """What the key maps of this process cost: full builds, patches, and key rows read by either."""

    builds: int = 0
    patches: int = 0
    rows_read: int = 0


STATS = KeyMapStats()


@dataclass(frozen=True)
class _Fragment:
    """One fragment of a mapped version: what identifies its rows, and its deleted physical offsets."""

    files: tuple[str, ...]
    physical_rows: int
    deletion: tuple[int, int] | None  # (read version, id) of its deletion file
    num_deleted: int
    deleted: np.ndarray  # sorted uint32 physical offsets

    def same_rows(self, other: _Fragment) -> bool:
        return self.files == other.files and self.physical_rows == other.physical_rows

    def deletes_at_least(self, older: _Fragment) -> bool:
        """Whether this deletion vector can only have grown from `older`'s."""
        if older.deletion is None:
            return True
        return self.deletion is not None and self.deletion[0] >= older.deletion[0]


def _describe(fragment: lance.LanceFragment) -> _Fragment:
    md = fragment.metadata
    d = md.deletion_file
    return _Fragment(
        tuple(f.path for f in md.files),
        md.physical_rows,
        None if d is None else (d.read_version, d.id),
        0 if d is None else d.num_deleted_rows,
        np.empty(0, np.uint32),
    )


@dataclass(frozen=True)
class _Rows:
    """Key rows: key, fragment id, physical offset (unsorted)."""

    keys: np.ndarray
    fragments: np.ndarray
    physical: np.ndarray

    @classmethod
    def read(cls, ds: lance.LanceDataset, column: str, fragments: Sequence[lance.LanceFragment]) -> _Rows:
        t = ds.scanner(columns=[column], with_row_address=True, fragments=list(fragments)).to_table()
        STATS.rows_read += t.num_rows
        address = t.column(_ROWADDR).to_numpy()
        keys = t.column(column).to_numpy()
        return cls(keys, (address >> np.uint64(32)).astype(np.uint32), (address & _LOW32).astype(np.uint32))

    def deleted(self, fragment: _Fragment, fragment_id: int) -> np.ndarray:
        """The physical offsets of `fragment` these rows (all of its live rows) leave out."""
        live = np.zeros(fragment.physical_rows, dtype=bool)
        live[self.physical[self.fragments == fragment_id]] = True
        return np.flatnonzero(~live).astype(np.uint32)


@dataclass(frozen=True)
class BaseKeyMap:
    """Every key of one base version, sorted, with its row's fragment and physical offset."""

    column: str
    key_type: pa.DataType
    version: int
    keys: np.ndarray
    fragments: np.ndarray  # uint32 fragment id per key
    physical: np.ndarray  # uint32 physical offset per key
    layout: dict[int, _Fragment]

    @classmethod
    def build(cls, ds: lance.LanceDataset, column: str) -> BaseKeyMap:
        """The map of `ds`'s version from one scan of its key column."""
        STATS.builds += 1
        fragments = ds.get_fragments()
        rows = _Rows.read(ds, column, fragments)
        layout = {}
        for f in fragments:
            described = _describe(f)
            layout[f.fragment_id] = _with_deleted(described, rows.deleted(described, f.fragment_id))
        order = np.argsort(rows.keys, kind="stable")
        keys, fragment_ids, physical = rows.keys[order], rows.fragments[order], rows.physical[order]
        return cls(column, ds.schema.field(column).type, ds.version, keys, fragment_ids, physical, layout)

    def patched(self, ds: lance.LanceDataset) -> BaseKeyMap:
        """The map of `ds`'s version (a later version of the same table), reading only what changed."""
        STATS.patches += 1
        current = {f.fragment_id: (f, _describe(f)) for f in ds.get_fragments()}
        kept: dict[int, _Fragment] = {}
        fresh: list[lance.LanceFragment] = []
        for fid, (fragment, now) in current.items():
            before = self.layout.get(fid)
            if before is None or not now.same_rows(before) or not now.deletes_at_least(before):
                fresh.append(fragment)
            else:
                kept[fid] = _with_deleted(now, before.deleted)
        keep = self._in(kept)
        new = _Rows.read(ds, self.column, fresh) if fresh else None
        if new is not None and len(self.keys):
            pos = np.minimum(np.searchsorted(self.keys, new.keys), len(self.keys) - 1)
            moved = pos[(self.keys[pos] == new.keys) & keep[pos]]
            keep[moved] = False
            for fid in np.unique(self.fragments[moved]).tolist():
                gone = self.physical[moved[self.fragments[moved] == fid]]
                kept[fid] = _with_deleted(kept[fid], np.union1d(kept[fid].deleted, gone).astype(np.uint32))
        recount = [fid for fid, f in kept.items() if len(f.deleted) != f.num_deleted]
        if recount:  # deletions the new rows do not explain: read those fragments again
            keep &= ~np.isin(self.fragments, recount)
            again = _Rows.read(ds, self.column, [current[fid][0] for fid in recount])
            for fid in recount:
                kept[fid] = _with_deleted(kept[fid], again.deleted(kept[fid], fid))
            new = again if new is None else _concat(new, again)
        for f in fresh:
            assert new is not None
            described = current[f.fragment_id][1]
            kept[f.fragment_id] = _with_deleted(described, new.deleted(described, f.fragment_id))
        return self._merged(ds.version, keep, new, kept)

    def _in(self, fragments: dict[int, _Fragment]) -> np.ndarray:
        """Bool per entry: its fragment is one of `fragments`."""
        if not len(self.fragments):
            return np.zeros(0, dtype=bool)
        wanted = np.zeros(int(self.fragments.max()) + 1, dtype=bool)
        ids = [fid for fid in fragments if fid < len(wanted)]
        wanted[ids] = True
        return wanted[self.fragments]

    def _merged(
        self, version: int, keep: np.ndarray, new: _Rows | None, layout: dict[int, _Fragment]
    ) -> BaseKeyMap:
        """This map's entries at `keep` with the `new` rows inserted in key order."""
        every = bool(keep.all())
        keys = self.keys if every else self.keys[keep]
        fragments = self.fragments if every else self.fragments[keep]
        physical = self.physical if every else self.physical[keep]
        if new is not None and len(new.keys):
            order = np.argsort(new.keys, kind="stable")
            at = np.searchsorted(keys, new.keys[order])
            keys = np.insert(keys, at, new.keys[order])
            fragments = np.insert(fragments, at, new.fragments[order])
            physical = np.insert(physical, at, new.physical[order])
        return BaseKeyMap(self.column, self.key_type, version, keys, fragments, physical, layout)

    def take(self, ds: lance.LanceDataset, wanted: pa.ChunkedArray, columns: list[str]) -> pa.Table | None:
        """The rows of the `wanted` keys (NULLs match nothing), `columns` including the key column;
        None when the keys are not of the map's type or the rows taken are not the rows mapped (then
        the caller scans)."""
        if wanted.type != self.key_type:
            return None
        probe = pc.drop_null(wanted).to_numpy()
        empty = pa.Table.from_batches([], schema=projected_schema(ds.schema, columns))
        if len(self.keys) == 0 or len(probe) == 0:
            return empty
        pos = np.minimum(np.searchsorted(self.keys, probe), len(self.keys) - 1)
        hits = np.unique(pos[self.keys[pos] == probe])
        if len(hits) == 0:
            return empty
        parts = []
        for fid in np.unique(self.fragments[hits]).tolist():
            physical = self.physical[hits[self.fragments[hits] == fid]]
            visible = physical - np.searchsorted(self.layout[fid].deleted, physical)
            parts.append(fragment_take(ds, fid, np.sort(visible), columns))
        taken = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        got = np.sort(taken.column(self.column).to_numpy())
        return taken if np.array_equal(got, self.keys[hits]) else None


def _with_deleted(fragment: _Fragment, deleted: np.ndarray) -> _Fragment:
    return _Fragment(fragment.files, fragment.physical_rows, fragment.deletion, fragment.num_deleted, deleted)


def _concat(a: _Rows, b: _Rows) -> _Rows:
    return _Rows(
        np.concatenate([a.keys, b.keys]),
        np.concatenate([a.fragments, b.fragments]),
        np.concatenate([a.physical, b.physical]),
    )


_NOT_MAPPED = object()
_per_dataset: PerObjectCache[lance.LanceDataset, object] = PerObjectCache()
_newest: OrderedDict[tuple[str, str], BaseKeyMap] = OrderedDict()
_newest_lock = threading.Lock()


def mappable(ds: lance.LanceDataset, primary_key: Sequence[str]) -> bool:
    """Whether lookups in `ds` use a key map: a one-column integer key, at most MAX_MAPPED_BASE_ROWS rows."""
    return (
        len(primary_key) == 1
        and pa.types.is_integer(ds.schema.field(primary_key[0]).type)
        and ds.count_rows() <= MAX_MAPPED_BASE_ROWS
    )


def base_key_map(ds: lance.LanceDataset, primary_key: Sequence[str]) -> BaseKeyMap | None:
    """The key map of this base dataset object (a pinned version), made on first use (patched from
    the newest map of the same table when that one is of an older or the same version); None when
    the base is not mapped."""

    def make() -> object:
        return of_version(ds, primary_key[0]) if mappable(ds, primary_key) else _NOT_MAPPED

    found = _per_dataset.get(ds, make)
    return found if isinstance(found, BaseKeyMap) else None


def of_version(ds: lance.LanceDataset, column: str) -> BaseKeyMap:
    """The map of `ds`'s version: patched from the table's newest map when that is not newer, else built."""
    name = (ds.uri, column)
    with _newest_lock:
        previous = _newest.get(name)
    made = (
        previous.patched(ds)
        if previous is not None and previous.version <= ds.version
        else BaseKeyMap.build(ds, column)
    )
    with _newest_lock:
        latest = _newest.get(name)
        if latest is None or latest.version <= made.version:
            _newest[name] = made
            _newest.move_to_end(name)
            while len(_newest) > _MAX_TABLES:
                _newest.popitem(last=False)
    return made
