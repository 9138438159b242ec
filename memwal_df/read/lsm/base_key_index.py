"""The base key index: where each key lives in one version of the base table (key -> row address of
its live row), kept in memory across queries and patched from one base version to the next.

A Lance fragment's data files never change; a new version adds fragments, replaces some (compaction,
rewrites) or gives a fragment a new deletion file (a merge's updates and deletes). The index is a few
sorted runs of (key, row address), one per set of fragments read together, plus the rows each
fragment's deletion file deletes in the index's version (read from the deletion file itself:
`memwal_df.format.deletion_files`). The next version's index keeps the runs (minus the entries of
fragments that are gone, rewritten, or whose deletion file shrank), adds one run for the fragments
that are new, and takes the new deletion files. A merge therefore costs in proportion to the rows it
wrote and deleted, not to the base. An entry whose row a later version deleted stays in its run and is
filtered out when found; runs are merged (dropping such entries) when there are too many of them.

`BaseShadow` is what a scan of one base version needs from it: the row addresses of the live base rows
whose key a newer level holds, probed per batch through one flat bitmap.

Guarantees: `locate(keys)` returns the row address of every one of `keys` that has a live row in the
index's base version, and nothing else; within a run a key is held at most once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.deletion_files import deleted_offsets
from memwal_df.format.storage import Storage
from memwal_df.read.exec.batches import projected_schema
from memwal_df.read.lsm.cache import PerObjectCache
from memwal_df.read.lsm.fragments import fragment_take
from memwal_df.read.lsm.keys import key_array

__all__ = [
    "BASE_KEYS",
    "MAX_INDEXED_BASE_ROWS",
    "ShadowSet",
    "BaseKeyIndex",
    "BaseShadow",
    "base_key_index",
    "fragment_signature",
    "fragment_signatures",
    "indexable",
]

_ADDR = "_rowaddr"
MAX_INDEXED_BASE_ROWS = 16_000_000
"""A larger base gets no key index (16 bytes a row in memory): its scans drop the keys newer levels
hold by comparing keys, its lookups scan with a key filter."""
_OFFSET_MASK = np.uint64(0xFFFFFFFF)
_MEMO_ENTRIES = 256  # located keys and shadows kept per index (per view, per set of views)
_MAX_RUNS = 8  # more runs than this: every run but the largest is merged into one
T = TypeVar("T")


@dataclass(frozen=True)
class FragmentSignature:
    """What identifies a fragment's rows: its data (files and overlays) and its deletion file."""

    data: tuple[Any, ...]
    deletion: tuple[Any, ...] | None
    physical_rows: int
    deleted_rows: int


def fragment_signature(fragment: Any) -> FragmentSignature:
    m = fragment.metadata
    data = (tuple(f.path for f in m.files), repr(getattr(m, "overlays", None)))
    d = m.deletion_file
    deletion = None if d is None else (d.id, d.read_version, d.file_type, d.num_deleted_rows)
    return FragmentSignature(data, deletion, int(m.physical_rows), int(m.num_deletions or 0))


def indexable(ds: lance.LanceDataset) -> bool:
    """Whether the base version `ds` is small enough to get a key index (`MAX_INDEXED_BASE_ROWS`)."""
    return sum(s.physical_rows for s in fragment_signatures(ds).values()) <= MAX_INDEXED_BASE_ROWS


def fragment_signatures(ds: lance.LanceDataset) -> dict[int, FragmentSignature]:
    """Every fragment's signature, in fragment id order; read once per dataset object and version (a
    commit through the object moves the object itself to a new version)."""
    by_version = _SIGNATURES.get(ds, dict)
    version = ds.version
    if version not in by_version:
        by_version[version] = {f.fragment_id: fragment_signature(f) for f in ds.get_fragments()}
    return by_version[version]


_SIGNATURES: PerObjectCache[lance.LanceDataset, dict[int, dict[int, FragmentSignature]]] = PerObjectCache()


def _read_keys(
    ds: lance.LanceDataset, primary_key: Sequence[str], fragment_ids: Sequence[int]
) -> tuple[pa.Array, np.ndarray]:
    """The keys and row addresses of the live rows of `fragment_ids`."""
    wanted = set(fragment_ids)
    fragments = [f for f in ds.get_fragments() if f.fragment_id in wanted]
    t = ds.scanner(columns=list(primary_key), with_row_address=True, fragments=fragments).to_table()
    keys = key_array([t.column(c) for c in primary_key])
    addrs = t.column(_ADDR).to_numpy().astype(np.uint64, copy=False)
    BASE_KEYS.rows_read += len(addrs)
    return keys, addrs


def _deleted_addrs(storage: Storage | None, fragment: Any) -> np.ndarray:
    """The row addresses a fragment's deletion file deletes (see `memwal_df.format.deletion_files`)."""
    offsets = deleted_offsets(storage, fragment).astype(np.uint64)
    return (np.uint64(fragment.fragment_id) << np.uint64(32)) | offsets


class _Bitmaps:
    """One bit per physical row of a base version's fragments (one flat bool array and a fragment ->
    start table), set for the given row addresses; probed with row addresses. Addresses outside the
    fragments given are never set and probe as unset."""

    def __init__(self, addrs: np.ndarray, physical_rows: dict[int, int]) -> None:
        ids = np.array(sorted(physical_rows), dtype=np.int64)
        sizes = np.array([physical_rows[int(f)] for f in ids], dtype=np.int64)
        self._start = np.full(int(ids[-1]) + 1 if len(ids) else 0, -1, dtype=np.int64)
        self._sizes = np.zeros(len(self._start), dtype=np.int64)
        if len(ids):
            self._start[ids] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            self._sizes[ids] = sizes
        self._bits = np.zeros(int(sizes.sum()), dtype=bool)
        self.set(addrs)

    def set(self, addrs: np.ndarray) -> None:
        if len(addrs):
            index, inside = self._positions(addrs)
            self._bits[index[inside]] = True

    def _positions(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each address's position in the flat array, and whether it is inside a known fragment."""
        frags = (addrs >> np.uint64(32)).astype(np.int64)
        offsets = (addrs & _OFFSET_MASK).astype(np.int64)
        known = frags < len(self._start)
        clipped = np.where(known, frags, 0)
        start = np.where(known, self._start[clipped], -1)
        inside = (start >= 0) & (offsets < self._sizes[clipped])
        return start + offsets, inside

    def probe(self, addrs: np.ndarray) -> np.ndarray:
        """Bool per address: its bit is set."""
        if not len(self._bits) or not len(addrs):
            return np.zeros(len(addrs), dtype=bool)
        first = int(addrs[0] >> np.uint64(32))
        if first < len(self._start) and self._start[first] >= 0:
            # the common case: a batch of one fragment's rows (Lance reads fragment by fragment)
            base, size = int(self._start[first]), int(self._sizes[first])
            offsets = addrs - np.uint64(first << 32)
            if int(offsets.max()) < size:  # every address is of that fragment
                return self._bits[base + offsets.astype(np.int64)]
        index, inside = self._positions(addrs)
        out = np.zeros(len(addrs), dtype=bool)
        out[inside] = self._bits[index[inside]]
        return out


class _Run:
    """Sorted (key, row address) entries of rows read together; each key at most once."""

    def __init__(self, keys: pa.Array, addrs: np.ndarray) -> None:
        self.int = pa.types.is_integer(keys.type)
        if self.int:
            values = keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            order = np.argsort(values, kind="stable")
            self.sorted: np.ndarray | None = values[order]
            self.keys: pa.Array | None = None
            self.addrs = addrs[order]
        else:
            self.sorted, self.keys, self.addrs = None, keys, addrs

    def __len__(self) -> int:
        return len(self.addrs)

    @property
    def nbytes(self) -> int:
        keys = self.sorted.nbytes if self.sorted is not None else (self.keys.nbytes if self.keys else 0)
        return int(keys + self.addrs.nbytes)

    def key_array(self) -> pa.Array:
        if self.sorted is not None:
            return pa.array(self.sorted)
        assert self.keys is not None
        return self.keys

    def filtered(self, keep: np.ndarray) -> _Run:
        if keep.all():
            return self
        out = _Run.__new__(_Run)
        out.int, out.addrs = self.int, self.addrs[keep]
        out.sorted = self.sorted[keep] if self.sorted is not None else None
        out.keys = self.keys.filter(pa.array(keep)) if self.keys is not None else None
        return out

    def find(self, keys: pa.Array) -> np.ndarray:
        """The addresses of the entries holding any of `keys`."""
        if not len(self.addrs) or not len(keys):
            return np.empty(0, np.uint64)
        if self.sorted is not None:
            probe = keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            pos = np.searchsorted(self.sorted, probe)
            pos[pos == len(self.sorted)] = 0
            return self.addrs[pos[self.sorted[pos] == probe]]
        assert self.keys is not None
        index = pc.index_in(keys.cast(self.keys.type), value_set=self.keys).drop_null()
        return self.addrs[index.to_numpy().astype(np.int64)]


class BaseKeyIndex:
    """key -> row address of every live row of one base version (see the module docstring)."""

    def __init__(
        self,
        version: int,
        fragments: dict[int, FragmentSignature],
        runs: list[_Run],
        deleted: dict[int, np.ndarray],
        key_type: pa.DataType,
    ) -> None:
        self.version = version
        self.fragments = fragments
        self.runs = runs
        self.deleted = deleted  # fragment id -> sorted row addresses its deletion file deletes
        self.key_type = key_type
        self._dead: _Bitmaps | None = None
        self._deleted_read: dict[int, np.ndarray] = {}  # deleted offsets read for takes
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = OrderedDict()

    @property
    def entries(self) -> int:
        return sum(len(r) for r in self.runs)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs) + sum(int(d.nbytes) for d in self.deleted.values())

    @property
    def physical_rows(self) -> dict[int, int]:
        return {f: s.physical_rows for f, s in self.fragments.items()}

    def _dead_rows(self) -> _Bitmaps:
        with self._lock:
            if self._dead is None:
                addrs = [d for d in self.deleted.values() if len(d)]
                all_dead = np.concatenate(addrs) if addrs else np.empty(0, np.uint64)
                self._dead = _Bitmaps(all_dead, self.physical_rows)
            return self._dead

    @classmethod
    def build(
        cls,
        ds: lance.LanceDataset,
        storage: Storage | None,
        primary_key: Sequence[str],
        key_type: pa.DataType,
    ) -> BaseKeyIndex:
        """The index of `ds`'s version, read whole (its key column and row addresses)."""
        fragments = fragment_signatures(ds)
        runs = [_Run(*_read_keys(ds, primary_key, sorted(fragments)))] if fragments else []
        return cls(ds.version, fragments, runs, {}, key_type)  # a fresh read holds live rows only

    def advance(
        self,
        ds: lance.LanceDataset,
        storage: Storage | None,
        primary_key: Sequence[str],
        signatures: dict[int, FragmentSignature],
    ) -> BaseKeyIndex:
        """The index of `ds`'s version (its fragments' `signatures`), from this one."""
        old = self.fragments
        gone = set()
        for fid, sig in old.items():
            now = signatures.get(fid)
            if now is None or now.data != sig.data or now.deleted_rows < sig.deleted_rows:
                gone.add(fid)
        added = sorted(fid for fid in signatures if fid in gone or fid not in old)
        runs = self.runs
        if gone:
            runs = [
                r.filtered(~np.isin((r.addrs >> np.uint64(32)).astype(np.int64), list(gone))) for r in runs
            ]
        deleted = {f: d for f, d in self.deleted.items() if f not in gone and signatures[f] == old[f]}
        for fid, sig in signatures.items():
            if fid not in added and sig.deletion is not None and fid not in deleted:
                deleted[fid] = _deleted_addrs(storage, ds.get_fragment(fid))
        if added:
            runs = [*runs, _Run(*_read_keys(ds, primary_key, added))]
        index = BaseKeyIndex(ds.version, signatures, [r for r in runs if len(r)], deleted, self.key_type)
        if len(index.runs) > _MAX_RUNS:
            index = index._merged_runs()
        return index

    def _merged_runs(self) -> BaseKeyIndex:
        """This index with every run but the largest merged into one (dead entries dropped)."""
        largest = max(range(len(self.runs)), key=lambda i: len(self.runs[i]))
        small = [r for i, r in enumerate(self.runs) if i != largest]
        dead = self._dead_rows()
        live = [r.filtered(~dead.probe(r.addrs)) for r in small]
        merged = _Run(
            pa.concat_arrays([r.key_array().cast(self.key_type) for r in live]),
            np.concatenate([r.addrs for r in live]),
        )
        return BaseKeyIndex(
            self.version, self.fragments, [self.runs[largest], merged], self.deleted, self.key_type
        )

    def locate(self, keys: pa.Array) -> np.ndarray:
        """The row addresses (sorted) of the live rows holding any of `keys`."""
        if not len(keys) or not self.runs:
            return np.empty(0, np.uint64)
        found = np.concatenate([r.find(keys) for r in self.runs])
        if self.deleted and len(found):
            found = found[~self._dead_rows().probe(found)]
        found = np.sort(found)  # a key has one live row, in one run; a key asked twice is found twice
        return found[np.r_[True, found[1:] != found[:-1]]] if len(found) > 1 else found

    def take(
        self, ds: lance.LanceDataset, storage: Storage | None, keys: pa.Array, columns: Sequence[str]
    ) -> pa.Table:
        """The live rows of `ds` (this index's version) holding any of `keys`, `columns` only, each
        fragment's rows read through its kept `FragmentSession` by visible offset (a row's physical
        offset minus the rows deleted below it)."""
        addrs = self.locate(keys)
        if not len(addrs):
            return pa.Table.from_batches([], schema=projected_schema(ds.schema, columns))
        frags = (addrs >> np.uint64(32)).astype(np.int64)
        parts = []
        for fid in np.unique(frags).tolist():
            offsets = (addrs[frags == fid] & _OFFSET_MASK).astype(np.int64)
            deleted = self._deleted_offsets(ds, storage, fid)
            visible = offsets - np.searchsorted(deleted, offsets) if len(deleted) else offsets
            parts.append(fragment_take(ds, fid, visible, columns))
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def _deleted_offsets(self, ds: lance.LanceDataset, storage: Storage | None, fid: int) -> np.ndarray:
        """The sorted physical offsets fragment `fid`'s deletion file deletes (kept with the index)."""
        sig = self.fragments.get(fid)
        if sig is None or sig.deletion is None:
            return np.empty(0, np.int64)
        known = self.deleted.get(fid)
        if known is not None:
            return (known & _OFFSET_MASK).astype(np.int64)
        with self._lock:
            found = self._deleted_read.get(fid)
        if found is None:
            found = deleted_offsets(storage, ds.get_fragment(fid))
            with self._lock:
                self._deleted_read[fid] = found
        return found

    def view_shadow(self, view: Any) -> BaseShadow:
        """The live base rows holding a key of `view` (a `RegionView`), kept per view for as long as
        this index lives. A view that is its parent plus keys added on top (a flush) extends its
        parent's shadow by the rows of the added keys instead of locating every key again."""

        def compute() -> BaseShadow:
            parent = view.parent
            if parent is not None and view.added is not None:
                return self.view_shadow(parent).extended(self.locate(view.added.to_array()))
            return BaseShadow(self.locate(view.keys.to_array()), self.physical_rows)

        return self._kept(("view", view), compute)

    def mask(self, parts: Sequence[BaseShadow]) -> _Bitmaps:
        """One bitmap of the rows any of `parts` shadows, kept per tuple of parts."""

        def compute() -> _Bitmaps:
            bits = _Bitmaps(np.empty(0, np.uint64), self.physical_rows)
            for part in parts:
                bits.set(part.addrs)
            return bits

        return self._kept(("mask", *parts), compute)

    def _kept(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        ids = tuple(id(k) for k in key)
        with self._lock:
            hit = self._memo.get(ids)
            if hit is not None and all(a is b for a, b in zip(hit[0], key, strict=True)):
                self._memo.move_to_end(ids)
                found: T = hit[1]
                return found
        value = compute()
        with self._lock:
            self._memo[ids] = (key, value)
            while len(self._memo) > _MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return value


class BaseShadow:
    """The live base rows whose key a newer level holds (sorted row addresses), with per-fragment
    bitmaps to drop them from a scan and counts per row-address range."""

    def __init__(self, addrs: np.ndarray, physical_rows: dict[int, int]) -> None:
        self.addrs = np.sort(addrs) if len(addrs) else np.empty(0, np.uint64)  # distinct
        self._physical = physical_rows
        self._bitmaps: _Bitmaps | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.addrs)

    def extended(self, addrs: np.ndarray) -> BaseShadow:
        """This shadow plus the rows at `addrs` (sorted), as a new one."""
        if not len(addrs):
            return self
        out = BaseShadow(np.empty(0, np.uint64), self._physical)
        pos = np.searchsorted(self.addrs, addrs)
        present = (
            self.addrs[np.minimum(pos, len(self.addrs) - 1)] == addrs
            if len(self.addrs)
            else np.zeros(len(addrs), bool)
        )
        out.addrs = np.insert(self.addrs, pos[~present], addrs[~present])
        return out

    def hidden(self, addrs: np.ndarray) -> np.ndarray:
        """Bool per row address: the row is shadowed."""
        if not len(self.addrs):
            return np.zeros(len(addrs), dtype=bool)
        with self._lock:
            if self._bitmaps is None:
                self._bitmaps = _Bitmaps(self.addrs, self._physical)
        return self._bitmaps.probe(addrs)

    def count_between(self, start: int, stop: int) -> int:
        """The number of shadowed rows with a row address in `[start, stop)`."""
        lo, hi = np.searchsorted(self.addrs, np.array([start, stop], dtype=np.uint64))
        return int(hi - lo)


class ShadowSet:
    """The union of disjoint `BaseShadow`s (one per region view, one for MemTable copies): its size
    from the parts, membership through one bitmap of them all (built on first probe)."""

    def __init__(self, parts: Sequence[BaseShadow], mask: Callable[[], _Bitmaps] | None = None) -> None:
        self.parts = list(parts)
        self._mask = mask
        self._bits: _Bitmaps | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def hidden(self, addrs: np.ndarray) -> np.ndarray:
        """Bool per row address: the row is shadowed."""
        if not self.parts or self._mask is None:
            return np.zeros(len(addrs), dtype=bool)
        with self._lock:
            if self._bits is None:
                self._bits = self._mask()
        return self._bits.probe(addrs)


class _IndexCache:
    """The latest base key indexes of each table in this process (two per table)."""

    def __init__(self, per_table: int = 2) -> None:
        self._items: dict[str, list[BaseKeyIndex]] = {}
        self._lock = threading.Lock()
        self._per_table = per_table
        self.builds = 0  # indexes read whole
        self.advances = 0  # indexes patched from an earlier version
        self.rows_read = 0  # key rows read from the base, by builds and patches

    def get(self, uri: str) -> list[BaseKeyIndex]:
        with self._lock:
            return list(self._items.get(uri, []))

    def keep(self, uri: str, index: BaseKeyIndex) -> None:
        with self._lock:
            found = [i for i in self._items.get(uri, []) if i.version != index.version]
            self._items[uri] = sorted([index, *found], key=lambda i: -i.version)[: self._per_table]


BASE_KEYS = _IndexCache()


def base_key_index(
    uri: str,
    ds: lance.LanceDataset,
    storage: Storage | None,
    primary_key: Sequence[str],
) -> BaseKeyIndex:
    """The key index of `ds` (the base table at `uri`, at its version): kept (same version, same
    fragments: a table created again at the same path is another table), else patched from the newest
    kept one, else read whole. Keys are compared as `key_array` makes them: the key column's type,
    or the tuple encoding (binary) of a composite key."""
    found = BASE_KEYS.get(uri)
    signatures = fragment_signatures(ds)
    for index in found:
        if index.version == ds.version and index.fragments == signatures:
            return index
    if found:
        index = found[0].advance(ds, storage, primary_key, signatures)
        BASE_KEYS.advances += 1
    else:
        key_type = ds.schema.field(primary_key[0]).type if len(primary_key) == 1 else pa.binary()
        index = BaseKeyIndex.build(ds, storage, primary_key, key_type)
        BASE_KEYS.builds += 1
    BASE_KEYS.keep(uri, index)
    return index
