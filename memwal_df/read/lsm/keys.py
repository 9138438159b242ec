"""Primary keys on the read side: key arrays, key sets, and the filters and dedup steps built on them.

Keys of one or several columns are compared through one array (`key_array`): the column itself for
a one-column key, Lance's order-preserving tuple encoding (`pk_index.encode_composite_keys`) for a
composite key. The encoding is injective, so equal encodings mean equal keys.

`KeySet` holds a set of such keys with vectorized membership tests (the building block of the
anti-joins): single integer keys as a sorted, unique numpy array (membership by `searchsorted`, or by
a bool lookup table over the keys' range when they are dense enough for it to stay small); every
other key (strings, binaries, booleans, composite keys) as an Arrow array probed with a hash-based
`is_in`. `contains(keys)` is exact (no false positives or negatives) and costs O(n log m) or O(n).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.pk_index import encode_composite_keys
from memwal_df.format.rows import TOMBSTONE

__all__ = [
    "TOMBSTONE",
    "KeySet",
    "distinct_keys",
    "encode_keys",
    "first_positions",
    "key_array",
    "key_filter",
    "last_per_key",
    "member_mask",
    "output_columns",
]


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

    _table: tuple[int, np.ndarray] | Literal[False] | None = None  # see `_dense`

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


def _column(table: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def encode_keys(table: pa.Table | pa.RecordBatch, primary_key: Sequence[str]) -> pa.Array:
    """One comparable array of the rows' keys (see the module docstring)."""
    return key_array([_column(table, c) for c in primary_key])


def member_mask(
    table: pa.Table | pa.RecordBatch, primary_key: Sequence[str], value_set: pa.Array
) -> np.ndarray:
    """Bool per row of `table`: its key is in `value_set` (an `encode_keys` array)."""
    if table.num_rows == 0:
        return np.zeros(0, dtype=bool)
    encoded = encode_keys(table, primary_key)
    if value_set.type != encoded.type:
        value_set = value_set.cast(encoded.type)
    return np.asarray(pc.is_in(encoded, value_set=value_set).to_numpy(zero_copy_only=False), dtype=bool)


def last_per_key(table: pa.Table, primary_key: Sequence[str], order: np.ndarray | None = None) -> pa.Table:
    """One row per key: the one with the largest `order` (default: the last one), in `order` order."""
    n = table.num_rows
    if n <= 1:
        return table
    if order is not None:
        ranks = np.argsort(np.asarray(order), kind="stable")
        if not np.array_equal(ranks, np.arange(n)):
            table = table.take(pa.array(ranks))
    encoded = encode_keys(table, primary_key)
    if pc.count_distinct(encoded).as_py() == n:
        return table
    last = (
        pa.table({"k": encoded, "pos": pa.array(np.arange(n, dtype=np.int64))})
        .group_by("k", use_threads=False)
        .aggregate([("pos", "max")])
        .column("pos_max")
        .to_numpy()
    )
    return table.take(pa.array(np.sort(last)))


_I64_MIN = -(2**63)


def _sql_literal(value: object, data_type: pa.DataType) -> str | None:
    """A Lance SQL literal that reads back as exactly `value` in a column of `data_type`, or None."""
    if pa.types.is_integer(data_type):
        # Lance's parser reads -2^63 as a float; the expression stays exact (and index-answerable).
        return "(-9223372036854775807 - 1)" if value == _I64_MIN else str(value)
    if pa.types.is_boolean(data_type):
        return "true" if value else "false"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        assert isinstance(value, str)
        return "'" + value.replace("'", "''") + "'"
    if pa.types.is_binary(data_type) or pa.types.is_large_binary(data_type):
        assert isinstance(value, bytes)
        return f"X'{value.hex()}'"
    return None


def _sql_in_list(name: str, values: pa.Array) -> str:
    """`` `name` IN (v1, v2, ...) ``, every value written so that Lance reads back exactly it.

    Checked against Lance 14 for NUL bytes, quotes, backslashes, non-ASCII text, -2^63 and 2^64 - 1.
    """
    if "`" in name:  # Lance 14 resolves no such column, whether in a filter or a projection
        raise ValueError(f"Lance cannot filter on the column {name!r} (its name holds a backtick)")
    literals = []
    for value in values.to_pylist():
        lit = _sql_literal(value, values.type) if value is not None else None
        if lit is None:
            raise TypeError(f"no exact SQL literal for {value!r} of type {values.type} (column {name!r})")
        literals.append(lit)
    return f"`{name}` IN ({', '.join(literals)})"


def key_filter(keys: pa.Table, primary_key: Sequence[str]) -> str:
    """A Lance SQL filter matching at least the rows with these keys: per column `IN (...)`, ANDed.

    Exact for one-column keys; for composite keys it may match more (combine with `member_mask`).
    Lance answers `IN` on a column with a scalar index (btree, bitmap) from the index. SQL, not a
    pyarrow expression: Lance converts those through Substrait, which adds a cost to every scan and
    rejects uint64, large_utf8 and large_binary columns. Every Lance primary-key type has literals.
    """
    if keys.num_rows == 0:
        raise ValueError("a key filter needs at least one key")
    parts = [_sql_in_list(name, pc.unique(_column(keys, name))) for name in primary_key]
    if len(parts) == 1:
        return parts[0]
    return " AND ".join(f"({part})" for part in parts)


def distinct_keys(keys: pa.Table, primary_key: Sequence[str]) -> pa.Table:
    """The key columns of `keys`, without rows that have a NULL key column, each key once (first kept)."""
    keys = keys.select(list(primary_key))
    valid = None
    for name in primary_key:
        col = keys.column(name)
        if col.null_count:
            ok = pc.is_valid(col)
            valid = ok if valid is None else pc.and_(valid, ok)
    if valid is not None:
        keys = keys.filter(valid)
    if keys.num_rows <= 1:
        return keys
    first = first_positions(encode_keys(keys, primary_key))
    return keys if first is None else keys.take(pa.array(first))


def first_positions(keys: pa.Array) -> np.ndarray | None:
    """Ascending positions of the first occurrence of each key in `keys` (a `key_array`); None when
    no key repeats."""
    n = len(keys)
    if n <= 1:
        return None
    if pa.types.is_integer(keys.type):
        _, first = np.unique(keys.to_numpy(zero_copy_only=False), return_index=True)
    else:
        first = (
            pa.table({"k": keys, "pos": pa.array(np.arange(n, dtype=np.int64))})
            .group_by("k", use_threads=False)
            .aggregate([("pos", "min")])
            .column("pos_min")
            .to_numpy()
        )
    return None if len(first) == n else np.sort(first)


def output_columns(columns: Sequence[str], primary_key: Sequence[str]) -> list[str]:
    """The requested columns (without `_tombstone`, each once), then the key columns not among them."""
    out: list[str] = []
    for name in [*columns, *primary_key]:
        if name != TOMBSTONE and name not in out:
            out.append(name)
    return out
