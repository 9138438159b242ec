"""The base table's key map for point lookups, carried across base versions.

A `BaseKeyMap` holds every key of one base version (a one-column integer key) with where its row
is: the fragment and the row's physical offset in it, plus each fragment's deleted physical offsets
(a row's visible offset, what `LanceFragment.take` takes, is its physical offset minus the deleted
offsets below it). 17 bytes per row (key, fragment, offset, live flag), plus 4 per deleted row. The
entries are two sorted runs: the main run, whose arrays carry over from version to version (only
its live flags are copied, one byte a row), and the rows read since, merged into it once they
outnumber a quarter of it.

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

A patch reads the new fragments' keys, searches them in both runs and copies the live flags and
the newer run; a full build reads every key. `STATS` counts both, and the key rows read.

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

    @classmethod
    def none(cls, like: _Rows | _Run) -> _Rows:
        """No rows, of `like`'s types."""
        return cls(like.keys[:0], like.fragments[:0], like.physical[:0])

    def deleted(self, fragment: _Fragment, fragment_id: int) -> np.ndarray:
        """The physical offsets of `fragment` these rows (all of its live rows) leave out."""
        live = np.zeros(fragment.physical_rows, dtype=bool)
        live[self.physical[self.fragments == fragment_id]] = True
        return np.flatnonzero(~live).astype(np.uint32)


@dataclass(frozen=True)
class _Run:
    """Entries sorted by key (each key once), with a live flag per entry."""

    keys: np.ndarray
    fragments: np.ndarray  # uint32 fragment id per key
    physical: np.ndarray  # uint32 physical offset per key
    live: np.ndarray  # bool per key

    @classmethod
    def of(cls, rows: _Rows) -> _Run:
        order = np.argsort(rows.keys, kind="stable")
        live = np.ones(len(order), dtype=bool)
        return cls(rows.keys[order], rows.fragments[order], rows.physical[order], live)

    def find(self, probe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bool per probe: a live entry holds it, the entry index of each probe found)."""
        if len(self.keys) == 0:
            return np.zeros(len(probe), dtype=bool), np.zeros(0, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.keys, probe), len(self.keys) - 1)
        found = (self.keys[pos] == probe) & self.live[pos]
        return found, pos[found]

    def only(self, fragments: np.ndarray) -> _Run:
        """This run with the entries of fragments where `fragments` (bool by id) is False dead."""
        inside = np.zeros(len(self.keys), dtype=bool)
        known = self.fragments < len(fragments)
        inside[known] = fragments[self.fragments[known]]
        return _Run(self.keys, self.fragments, self.physical, self.live & inside)

    def without(self, at: np.ndarray) -> _Run:
        live = self.live.copy()
        live[at] = False
        return _Run(self.keys, self.fragments, self.physical, live)

    def live_rows(self) -> _Rows:
        if self.live.all():
            return _Rows(self.keys, self.fragments, self.physical)
        return _Rows(self.keys[self.live], self.fragments[self.live], self.physical[self.live])

    def plus(self, rows: _Rows) -> _Run:
        """The live entries with `rows` (of keys not live here) inserted in key order: O(entries)."""
        mine = self.live_rows()
        order = np.argsort(rows.keys, kind="stable")
        at = np.searchsorted(mine.keys, rows.keys[order])
        keys = np.insert(mine.keys, at, rows.keys[order])
        fragments = np.insert(mine.fragments, at, rows.fragments[order])
        physical = np.insert(mine.physical, at, rows.physical[order])
        return _Run(keys, fragments, physical, np.ones(len(keys), dtype=bool))


_COMPACT_ROWS = 1 << 16  # the newer run is folded into the main run beyond this and 1/4 of it


@dataclass(frozen=True)
class BaseKeyMap:
    """Every key of one base version with its row's fragment and physical offset, in two sorted
    runs: the main run (kept from version to version, with a live flag per entry) and a small run
    of the rows read since (rebuilt by each patch; folded into the main run when it grows beyond
    1/4 of it). A key is live in at most one of them."""

    column: str
    key_type: pa.DataType
    version: int
    main: _Run
    newer: _Run
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
        newer = _Run.of(_Rows.none(rows))
        return cls(column, ds.schema.field(column).type, ds.version, _Run.of(rows), newer, layout)

    def entries(self) -> _Rows:
        """Every live entry, sorted by key."""
        both = _concat(self.main.live_rows(), self.newer.live_rows())
        order = np.argsort(both.keys, kind="stable")
        return _Rows(both.keys[order], both.fragments[order], both.physical[order])

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
        runs = [self.main, self.newer]
        if set(self.layout) - set(kept):  # fragments gone or rewritten: their entries die
            runs = [r.only(_flags(kept)) for r in runs]
        new = _Rows.read(ds, self.column, fresh) if fresh else None
        if new is not None:
            for i, run in enumerate(runs):
                found, at = run.find(new.keys)
                if len(at):
                    runs[i] = run.without(at)
                    _delete(kept, run.fragments[at], run.physical[at])
        recount = [fid for fid, f in kept.items() if len(f.deleted) != f.num_deleted]
        if recount:  # deletions the new rows do not explain: read those fragments again
            flags = _flags(kept)
            flags[recount] = False
            runs = [r.only(flags) for r in runs]
            again = _Rows.read(ds, self.column, [current[fid][0] for fid in recount])
            for fid in recount:
                kept[fid] = _with_deleted(kept[fid], again.deleted(kept[fid], fid))
            new = again if new is None else _concat(new, again)
        for f in fresh:
            assert new is not None
            described = current[f.fragment_id][1]
            kept[f.fragment_id] = _with_deleted(described, new.deleted(described, f.fragment_id))
        main, newer = runs
        if new is not None:
            newer = newer.plus(new)
        if len(newer.keys) > max(_COMPACT_ROWS, len(main.keys) // 4):
            main, newer = main.plus(newer.live_rows()), _Run.of(_Rows.none(newer))
        return BaseKeyMap(self.column, self.key_type, ds.version, main, newer, kept)

    def take(self, ds: lance.LanceDataset, wanted: pa.ChunkedArray, columns: list[str]) -> pa.Table | None:
        """The rows of the `wanted` keys (NULLs match nothing), `columns` including the key column;
        None when the keys are not of the map's type or the rows taken are not the rows mapped (then
        the caller scans)."""
        if wanted.type != self.key_type:
            return None
        probe = np.unique(pc.drop_null(wanted).to_numpy())
        hit_keys, hit_fragments, hit_physical = [], [], []
        for run in (self.newer, self.main):
            found, at = run.find(probe)
            hit_keys.append(run.keys[at])
            hit_fragments.append(run.fragments[at])
            hit_physical.append(run.physical[at])
            probe = probe[~found]
        keys, fragments, physical = (np.concatenate(a) for a in (hit_keys, hit_fragments, hit_physical))
        if len(keys) == 0:
            return pa.Table.from_batches([], schema=projected_schema(ds.schema, columns))
        parts = []
        for fid in np.unique(fragments).tolist():
            at = physical[fragments == fid]
            visible = at - np.searchsorted(self.layout[fid].deleted, at)
            parts.append(fragment_take(ds, fid, np.sort(visible), columns))
        taken = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        got = np.sort(taken.column(self.column).to_numpy())
        return taken if np.array_equal(got, np.sort(keys)) else None


def _flags(fragments: dict[int, _Fragment]) -> np.ndarray:
    """Bool by fragment id: one of `fragments`."""
    flags = np.zeros(max(fragments, default=-1) + 1, dtype=bool)
    flags[list(fragments)] = True
    return flags


def _delete(layout: dict[int, _Fragment], fragments: np.ndarray, physical: np.ndarray) -> None:
    """Add the rows at (`fragments`, `physical`) to their kept fragment's deleted offsets."""
    for fid in np.unique(fragments).tolist():
        if fid in layout:
            gone = np.unique(physical[fragments == fid])  # live rows: none of them deleted already
            deleted = layout[fid].deleted
            layout[fid] = _with_deleted(layout[fid], np.insert(deleted, np.searchsorted(deleted, gone), gone))


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
