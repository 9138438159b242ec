"""Primary-key helpers shared by the operators: key encoding, membership, newest-per-key, filters.

Keys of one or several columns are compared through one array (`keyset.key_array`): the column
itself for a one-column key, Lance's order-preserving tuple encoding (`pk_index.encode_composite_keys`)
for a composite key. The encoding is injective, so equal encodings mean equal keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.exec.keyset import key_array

__all__ = [
    "TOMBSTONE",
    "distinct_keys",
    "encode_keys",
    "key_filter",
    "last_per_key",
    "member_mask",
    "output_columns",
]


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
    encoded = encode_keys(keys, primary_key)
    if pc.count_distinct(encoded).as_py() == keys.num_rows:
        return keys
    first = (
        pa.table({"k": encoded, "pos": pa.array(np.arange(keys.num_rows, dtype=np.int64))})
        .group_by("k", use_threads=False)
        .aggregate([("pos", "min")])
        .column("pos_min")
        .to_numpy()
    )
    return keys.take(pa.array(np.sort(first)))


def output_columns(columns: Sequence[str], primary_key: Sequence[str]) -> list[str]:
    """The requested columns (without `_tombstone`, each once), then the key columns not among them."""
    out: list[str] = []
    for name in [*columns, *primary_key]:
        if name != TOMBSTONE and name not in out:
            out.append(name)
    return out
