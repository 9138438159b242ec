"""The base key index: where each key lives in one version of the base table (key -> row address of
its live row), kept in memory across queries and patched from one base version to the next.

A Lance fragment's data files never change; a new version adds fragments, replaces some (compaction,
rewrites) or gives a fragment a new deletion file (a merge's updates and deletes). So the next
version's index is this one's entries minus those of fragments that are gone or rewritten, minus the
rows a grown deletion file hides (read as the fragment's live row addresses, no column read), plus the
keys of the fragments that are new (their key column read). A deletion file that shrinks (an older
version read after a newer one) re-reads the fragment. A merge therefore costs in proportion to the
rows it wrote, not to the base.

`BaseShadow` is what a scan of one base version needs from it: the row addresses of the live base rows
whose key a newer level holds, per fragment as a bitmap over the fragment's rows.

Guarantees: `locate(keys)` returns the row address of every one of `keys` that has a live row in the
index's base version, and nothing else; an index is kept only for the version it was built for.
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

from memwal_df.read.keys import key_array

__all__ = ["BASE_KEYS", "BaseKeyIndex", "BaseShadow", "base_key_index", "fragment_signature"]

_ADDR = "_rowaddr"
_MEMO_ENTRIES = 256  # located keys and shadows kept per index (per view, per set of views)
T = TypeVar("T")
_OFFSET_MASK = np.uint64(0xFFFFFFFF)


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
    deletion = None if d is None else (repr(d),)
    return FragmentSignature(data, deletion, int(m.physical_rows), int(m.num_deletions or 0))


def _signatures(ds: lance.LanceDataset) -> dict[int, FragmentSignature]:
    return {f.fragment_id: fragment_signature(f) for f in ds.get_fragments()}


def _read_keys(
    ds: lance.LanceDataset, primary_key: Sequence[str], fragment_ids: Sequence[int]
) -> tuple[pa.Array, np.ndarray]:
    """The keys and row addresses of the live rows of `fragment_ids`."""
    fragments = [ds.get_fragment(i) for i in fragment_ids]
    t = ds.scanner(columns=list(primary_key), with_row_address=True, fragments=fragments).to_table()
    keys = key_array([t.column(c) for c in primary_key])
    addrs = t.column(_ADDR).to_numpy().astype(np.uint64, copy=False)
    return keys, addrs


def _live_addrs(ds: lance.LanceDataset, fragment_ids: Sequence[int]) -> np.ndarray:
    """The row addresses of the live rows of `fragment_ids` (no column read)."""
    fragments = [ds.get_fragment(i) for i in fragment_ids]
    t = ds.scanner(columns=[], with_row_address=True, fragments=fragments).to_table()
    return t.column(_ADDR).to_numpy().astype(np.uint64, copy=False)


class _Bitmaps:
    """One bool per row of some fragments (by physical offset), probed with row addresses."""

    def __init__(self, addrs: np.ndarray, physical_rows: dict[int, int]) -> None:
        self.maps: dict[int, np.ndarray] = {}
        frags = (addrs >> np.uint64(32)).astype(np.int64)
        offsets = (addrs & _OFFSET_MASK).astype(np.int64)
        for fid in np.unique(frags).tolist():
            bitmap = np.zeros(physical_rows.get(fid, 0) or int(offsets[frags == fid].max()) + 1, dtype=bool)
            bitmap[offsets[frags == fid]] = True
            self.maps[fid] = bitmap

    def probe(self, addrs: np.ndarray) -> np.ndarray:
        """Bool per address: its bit is set."""
        out = np.zeros(len(addrs), dtype=bool)
        if not self.maps or not len(addrs):
            return out
        frags = addrs >> np.uint64(32)
        first, last = int(frags[0]), int(frags[-1])
        if first == last and (frags == first).all():
            bitmap = self.maps.get(first)
            if bitmap is not None:
                out[:] = bitmap[(addrs & _OFFSET_MASK).astype(np.int64)]
            return out
        for fid, bitmap in self.maps.items():
            here = frags == fid
            if here.any():
                out[here] = bitmap[(addrs[here] & _OFFSET_MASK).astype(np.int64)]
        return out


class BaseKeyIndex:
    """key -> row address of every live row of one base version (see the module docstring)."""

    def __init__(
        self,
        version: int,
        fragments: dict[int, FragmentSignature],
        keys: pa.Array,
        addrs: np.ndarray,
        key_type: pa.DataType,
    ) -> None:
        self.version = version
        self.fragments = fragments
        self.key_type = key_type
        self._int = pa.types.is_integer(key_type)
        if self._int:
            values = keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            order = np.argsort(values, kind="stable")
            self._sorted: np.ndarray | None = values[order]
            self._keys: pa.Array | None = None
            self.addrs = addrs[order]
        else:
            self._sorted = None
            self._keys = keys
            self.addrs = addrs
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = OrderedDict()

    @classmethod
    def _sorted_parts(
        cls, version: int, fragments: dict[int, FragmentSignature], keys: np.ndarray, addrs: np.ndarray
    ) -> BaseKeyIndex:
        """An index of integer keys from already sorted parts."""
        out = cls.__new__(cls)
        out.version, out.fragments, out.key_type, out._int = version, fragments, pa.int64(), True
        out._sorted, out._keys, out.addrs = keys, None, addrs
        out._lock, out._memo = threading.Lock(), OrderedDict()
        return out

    @property
    def rows(self) -> int:
        return len(self.addrs)

    @property
    def nbytes(self) -> int:
        keys = self._sorted.nbytes if self._sorted is not None else (self._keys.nbytes if self._keys else 0)
        return int(keys + self.addrs.nbytes)

    @classmethod
    def build(cls, ds: lance.LanceDataset, primary_key: Sequence[str], key_type: pa.DataType) -> BaseKeyIndex:
        """The index of `ds`'s version, read whole (its key column and row addresses)."""
        fragments = _signatures(ds)
        ids = sorted(fragments)
        if ids:
            keys, addrs = _read_keys(ds, primary_key, ids)
        else:
            keys, addrs = pa.array([], key_type), np.empty(0, np.uint64)
        return cls(ds.version, fragments, keys, addrs, key_type)

    def advance(
        self, ds: lance.LanceDataset, primary_key: Sequence[str], signatures: dict[int, FragmentSignature]
    ) -> BaseKeyIndex:
        """The index of `ds`'s version (its fragments' `signatures`), from this one."""
        new = signatures
        old = self.fragments
        gone, shrunk, grown = set(), [], []
        for fid, sig in old.items():
            now = new.get(fid)
            if now is None or now.data != sig.data:
                gone.add(fid)
            elif now.deletion != sig.deletion:
                (grown if now.deleted_rows >= sig.deleted_rows else shrunk).append(fid)
        gone.update(shrunk)
        added = sorted(fid for fid, sig in new.items() if fid in gone or fid not in old)
        if not gone and not grown and not added:
            return self._at(ds.version, new)
        frags = (self.addrs >> np.uint64(32)).astype(np.int64)
        keep = ~np.isin(frags, list(gone)) if gone else np.ones(len(frags), dtype=bool)
        if grown:
            live = _Bitmaps(_live_addrs(ds, grown), {f: new[f].physical_rows for f in grown})
            in_grown = np.isin(frags, grown)
            keep[in_grown] &= live.probe(self.addrs[in_grown])
        new_keys, new_addrs = (
            _read_keys(ds, primary_key, added)
            if added
            else (pa.array([], self.key_type), np.empty(0, np.uint64))
        )
        return self._patched(ds.version, new, keep, new_keys, new_addrs)

    def _at(self, version: int, fragments: dict[int, FragmentSignature]) -> BaseKeyIndex:
        if self._int:
            assert self._sorted is not None
            return BaseKeyIndex._sorted_parts(version, fragments, self._sorted, self.addrs)
        assert self._keys is not None
        return BaseKeyIndex(version, fragments, self._keys, self.addrs, self.key_type)

    def _patched(
        self,
        version: int,
        fragments: dict[int, FragmentSignature],
        keep: np.ndarray,
        new_keys: pa.Array,
        new_addrs: np.ndarray,
    ) -> BaseKeyIndex:
        if not self._int:
            assert self._keys is not None
            keys = pa.concat_arrays([self._keys.filter(pa.array(keep)), new_keys.cast(self._keys.type)])
            return BaseKeyIndex(
                version, fragments, keys, np.concatenate([self.addrs[keep], new_addrs]), self.key_type
            )
        assert self._sorted is not None
        kept_keys, kept_addrs = self._sorted[keep], self.addrs[keep]
        values = new_keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        order = np.argsort(values, kind="stable")
        values, new_addrs = values[order], new_addrs[order]
        at = np.searchsorted(kept_keys, values)
        return BaseKeyIndex._sorted_parts(
            version, fragments, np.insert(kept_keys, at, values), np.insert(kept_addrs, at, new_addrs)
        )

    def locate(self, keys: pa.Array) -> np.ndarray:
        """The row addresses (sorted) of the live rows holding any of `keys`."""
        if not len(keys) or not len(self.addrs):
            return np.empty(0, np.uint64)
        if self._sorted is not None:
            probe = keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            pos = np.searchsorted(self._sorted, probe)
            pos[pos == len(self._sorted)] = 0
            found = self.addrs[pos[self._sorted[pos] == probe]]
        else:
            assert self._keys is not None
            index = pc.index_in(keys.cast(self._keys.type), value_set=self._keys).to_numpy(
                zero_copy_only=False
            )
            index = index[~np.isnan(index)] if index.dtype.kind == "f" else index
            found = self.addrs[np.asarray(index, dtype=np.int64)]
        return np.unique(found)

    def located(self, owner: Any, keys: pa.Array) -> np.ndarray:
        """`locate(keys)`, kept per `owner` (the immutable object the keys belong to, e.g. a region
        view; compared by identity) for as long as this index lives."""
        return self._kept(("located", owner), lambda: self.locate(keys))

    def shadow(self, owners: Sequence[Any], keys: Callable[[Any], pa.Array]) -> BaseShadow:
        """The `BaseShadow` of the keys of `owners` (`keys(owner)` for each), kept per tuple of owners."""

        def compute() -> BaseShadow:
            parts = [self.located(o, keys(o)) for o in owners]
            addrs = np.unique(np.concatenate(parts)) if len(parts) > 1 else (parts[0] if parts else None)
            return BaseShadow(addrs if addrs is not None else np.empty(0, np.uint64), self.physical_rows)

        return self._kept(("shadow", *owners), compute)

    def _kept(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        ids = tuple(id(k) for k in key)
        with self._lock:
            hit = self._memo.get(ids)
            if hit is not None and all(a is b for a, b in zip(hit[0], key, strict=True)):
                self._memo.move_to_end(ids)
                return hit[1]  # type: ignore[no-any-return]
        value = compute()
        with self._lock:
            self._memo[ids] = (key, value)
            while len(self._memo) > _MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return value

    @property
    def physical_rows(self) -> dict[int, int]:
        return {f: s.physical_rows for f, s in self.fragments.items()}


class BaseShadow:
    """The live base rows whose key a newer level holds (sorted row addresses), with per-fragment
    bitmaps to drop them from a scan and counts per row-address range."""

    def __init__(self, addrs: np.ndarray, physical_rows: dict[int, int]) -> None:
        self.addrs = np.sort(addrs) if len(addrs) else np.empty(0, np.uint64)
        self._physical = physical_rows
        self._bitmaps: _Bitmaps | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.addrs)

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


class _IndexCache:
    """The latest base key indexes of each table in this process (two per table)."""

    def __init__(self, per_table: int = 2) -> None:
        self._items: dict[str, list[BaseKeyIndex]] = {}
        self._lock = threading.Lock()
        self._per_table = per_table
        self.builds = 0  # indexes read whole
        self.advances = 0  # indexes patched from an earlier version

    def get(self, uri: str) -> list[BaseKeyIndex]:
        with self._lock:
            return list(self._items.get(uri, []))

    def keep(self, uri: str, index: BaseKeyIndex) -> None:
        with self._lock:
            found = [i for i in self._items.get(uri, []) if i.version != index.version]
            self._items[uri] = sorted([index, *found], key=lambda i: -i.version)[: self._per_table]

    def forget(self, uri: str) -> None:
        with self._lock:
            self._items.pop(uri, None)


BASE_KEYS = _IndexCache()


def base_key_index(
    uri: str, ds: lance.LanceDataset, primary_key: Sequence[str], key_type: pa.DataType
) -> BaseKeyIndex:
    """The key index of `ds` (the base table at `uri`, at its version): kept (same version, same
    fragments: a table created again at the same path is another table), else patched from the newest
    kept one, else read whole."""
    found = BASE_KEYS.get(uri)
    signatures = _signatures(ds)
    for index in found:
        if index.version == ds.version and index.fragments == signatures:
            return index
    if found:
        index = found[0].advance(ds, primary_key, signatures)
        BASE_KEYS.advances += 1
    else:
        index = BaseKeyIndex.build(ds, primary_key, key_type)
        BASE_KEYS.builds += 1
    BASE_KEYS.keep(uri, index)
    return index
