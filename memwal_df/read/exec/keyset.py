"""Sets of primary keys with vectorized membership tests: the building block of the anti-joins.

Single integer keys are kept as a sorted, unique numpy array (membership by `searchsorted`, or by a
bool lookup table over the keys' range when they are dense enough for it to stay small); every
other key (strings, binaries, booleans, composite keys in Lance's order-preserving tuple encoding) as
an Arrow array probed with a hash-based `is_in`.

Guarantees: `contains(keys)` is exact (no false positives or negatives) and costs O(n log m) or O(n).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.pk_index import encode_composite_keys


def key_array(columns: Sequence[pa.Array | pa.ChunkedArray]) -> pa.Array:
    """One array holding the key of each row: the column itself, or the tuple encoding of several."""
    arrays = [
        (c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()) if isinstance(c, pa.ChunkedArray) else c
        for c in columns
    ]
    if len(arrays) == 1:
        return arrays[0]
    return encode_composite_keys(arrays)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (np.unique, without its overhead: a sort and a neighbour comparison)."""
    a = np.sort(a)
    if len(a) > 1:
        a = a[np.r_[True, a[1:] != a[:-1]]]
    return a


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


_DENSE_MIN_KEYS = 1024
_DENSE_BYTES_PER_KEY = 16  # a lookup table may cost this many bytes per key in the set


class KeySet:
    """An immutable set of primary keys."""

    _table: tuple[int, np.ndarray] | bool | None = None  # see `_dense`

    def __init__(self, keys: pa.Array, key_type: pa.DataType | None = None) -> None:
        t = key_type or keys.type
        self.type = t
        if _is_int(t):
            self._sorted: np.ndarray | None = _sorted_unique(_as_int64(keys))
            self._values: pa.Array | None = None
            self.size = len(self._sorted)
        else:
            self._sorted = None
            self._values = pc.unique(keys.cast(t)) if len(keys) else pa.array([], t)
            self.size = len(self._values)

    @classmethod
    def union(cls, parts: Iterable[pa.Array], key_type: pa.DataType) -> KeySet:
        arrays = [p for p in parts if len(p)]
        if not arrays:
            return cls(pa.array([], key_type), key_type)
        return cls(pa.concat_arrays([a.cast(key_type) for a in arrays]), key_type)

    @classmethod
    def merge(cls, sets: Sequence[KeySet], key_type: pa.DataType) -> KeySet:
        """The union of several sets, reusing their sorted arrays (integer keys: a merge of sorted runs)."""
        nonempty = [s for s in sets if len(s)]
        if len(nonempty) == 1 and nonempty[0].type == key_type:
            return nonempty[0]
        if _is_int(key_type):
            out = cls(pa.array([], key_type), key_type)
            out._sorted = _merge_sorted([s._sorted for s in nonempty if s._sorted is not None])
            out.size = len(out._sorted)
            return out
        return cls.union([s.to_array() for s in nonempty], key_type)

    def add(self, keys: pa.Array) -> KeySet:
        """A new set holding this one's keys and `keys` (this one is unchanged). Integer keys: a merge of
        two sorted runs, linear in the set's size, so adding level after level costs no re-sort."""
        if len(keys) == 0:
            return self
        return KeySet.merge([self, KeySet(keys, self.type)], self.type)

    def __len__(self) -> int:
        return self.size

    def contains(self, keys: pa.Array) -> np.ndarray:
        """A boolean mask: which of `keys` are in the set."""
        if self.size == 0 or len(keys) == 0:
            return np.zeros(len(keys), dtype=bool)
        if self._sorted is not None:
            probe = _as_int64(keys)
            if (dense := self._dense()) is not None:
                lo, table = dense
                hit = np.zeros(len(probe), dtype=bool)
                inside = (probe >= lo) & (probe <= lo + (len(table) - 1))
                hit[inside] = table[probe[inside] - lo]
                return hit
            pos = np.searchsorted(self._sorted, probe)
            pos[pos == len(self._sorted)] = 0
            return self._sorted[pos] == probe
        assert self._values is not None
        return pc.is_in(keys, value_set=self._values).to_numpy(zero_copy_only=False)

    def _dense(self) -> tuple[int, np.ndarray] | None:
        """(lowest key, one bool per key value up to the highest): a lookup table, faster to probe than
        `searchsorted`, built once when the keys are dense enough that it stays small."""
        if self._table is None:
            keys = self._sorted
            assert keys is not None
            lo, hi = (int(keys[0]), int(keys[-1])) if len(keys) else (0, -1)
            if len(keys) < _DENSE_MIN_KEYS or hi - lo >= _DENSE_BYTES_PER_KEY * len(keys):
                self._table = False
            else:
                table = np.zeros(hi - lo + 1, dtype=bool)
                table[keys - lo] = True
                self._table = (lo, table)
        return self._table or None

    def to_array(self) -> pa.Array:
        if self._sorted is not None:
            return pa.array(self._sorted, pa.int64()).cast(self.type)
        assert self._values is not None
        return self._values


def _as_int64(keys: pa.Array) -> np.ndarray:
    return keys.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _merge_sorted(runs: Sequence[np.ndarray]) -> np.ndarray:
    """Sorted distinct values of several sorted, distinct arrays. Two runs: the shorter is inserted into
    the longer at its `searchsorted` positions (linear in their sizes); more: one sort."""
    if not runs:
        return np.empty(0, np.int64)
    if len(runs) == 1:
        return runs[0]
    if len(runs) == 2:
        big, small = sorted(runs, key=len, reverse=True)
        pos = np.searchsorted(big, small)
        present = big[np.minimum(pos, len(big) - 1)] == small
        return np.insert(big, pos[~present], small[~present])
    merged = np.sort(np.concatenate(runs))
    return merged[np.r_[True, merged[1:] != merged[:-1]]]
