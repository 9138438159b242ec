"""The table's schema as writers see it, and the conversion of user input into WAL-schema batches.

Input may be a `pa.Table`, `pa.RecordBatch`, `pa.RecordBatchReader`, a pandas DataFrame, a dict of
columns or a list of row dicts (every row with the same keys). Columns are matched by name (order is
free). A put replaces whole rows, so it needs every column of the table (NULL where a value is
unknown): a missing column raises `MissingColumnsError` naming it; an extra or duplicate column, or
a type that cannot be converted without loss (a vector of another dimension, a list of strings for
a vector of floats) raises `SchemaMismatchError`; a NULL in a primary-key column raises
`NullPrimaryKeyError`. Deletes and lookups need the primary-key columns only. Nothing is written when
an error is raised.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingColumnsError, NullPrimaryKeyError, SchemaMismatchError
from memwal_df.format.rows import wal_schema


@dataclass(frozen=True)
class TableSchema:
    """Columns, primary key and Lance field ids of a MemWAL table."""

    schema: pa.Schema  # the base table's schema (no _tombstone)
    primary_key: tuple[str, ...]
    field_ids: dict[str, int]
    wal: pa.Schema = field(init=False)

    def __post_init__(self) -> None:
        if not self.primary_key:
            raise SchemaMismatchError("a MemWAL table needs a primary key")
        for name in self.primary_key:
            if name not in self.schema.names:
                raise SchemaMismatchError(f"primary key column {name!r} is not in the schema")
        object.__setattr__(self, "wal", wal_schema(self.schema, self.field_ids))

    @functools.cached_property
    def names_by_id(self) -> dict[int, str]:
        """Column name by Lance field id (`field_ids` inverted)."""
        return {i: n for n, i in self.field_ids.items()}

    @property
    def key_schema(self) -> pa.Schema:
        """The primary-key columns, in key order."""
        return pa.schema([self.schema.field(n) for n in self.primary_key])


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether input of type `src` may be written to a column of type `dst` (docs/writing.md, "Types"):
    decided by the types alone, never by the values. Integers of any width go to integer or float
    columns, floats to float columns (never to integer ones, not even 4.0), string and binary flavours
    to their own kind, dates to dates and timestamps, lists to lists whose values are compatible.
    The values are then converted by a safe cast, which refuses a value out of the column's range."""
    if src == dst:
        return True
    if _is_list(src) and _is_list(dst):  # list flavours, if their values are compatible
        return _compatible(src.value_type, dst.value_type)
    groups = (
        pa.types.is_integer,
        pa.types.is_floating,
        lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t),
        lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t),
        pa.types.is_timestamp,
        pa.types.is_date,
        pa.types.is_null,
    )
    return (
        any(g(src) and g(dst) for g in groups)
        or pa.types.is_null(src)
        # a date widens to a timestamp; the reverse would drop the time of day (Arrow's safe cast
        # does not check that)
        or (pa.types.is_date(src) and pa.types.is_timestamp(dst))
        or (pa.types.is_integer(src) and pa.types.is_floating(dst))
    )


def _leaf_type(t: pa.DataType) -> pa.DataType:
    return _leaf_type(t.value_type) if _is_list(t) else t


def _leaves(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """The values of `col`, of lists flattened down to non-list values."""
    while _is_list(col.type):
        col = pc.list_flatten(col)
    return col


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def to_table(data: Any) -> pa.Table:
    """Any accepted input as a pa.Table (a RecordBatchReader is read whole; see `iter_tables`)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.read_all()
    if isinstance(data, dict | list):
        if isinstance(data, list):
            _check_rows(data)
        try:
            return pa.table(data) if isinstance(data, dict) else pa.Table.from_pylist(data)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SchemaMismatchError(f"cannot convert the {type(data).__name__} to columns: {e}") from e
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False)
    raise SchemaMismatchError(f"cannot write data of type {type(data).__name__}")


def iter_tables(data: Any, max_rows: int) -> Iterator[pa.Table]:
    """The input in chunks of at most `max_rows` rows, streaming a RecordBatchReader."""
    if isinstance(data, pa.RecordBatchReader):
        for batch in data:
            if batch.num_rows:
                yield from iter_tables(batch, max_rows)
        return
    table = to_table(data)
    if table.num_rows == 0:
        yield table  # (slicing a table without columns would invent rows)
        return
    for offset in range(0, table.num_rows, max_rows):
        yield table.slice(offset, max_rows)


def _check_rows(rows: list[Any]) -> None:
    """Every row is a dict with the keys of the first row (Arrow would fill a key a row lacks with
    NULL and drop a key the first row lacks)."""
    if not all(isinstance(row, dict) for row in rows):
        raise SchemaMismatchError("a list of rows must hold dicts (column name -> value)")
    names = rows[0].keys() if rows else set()
    for i, row in enumerate(rows):
        if row.keys() == names:
            continue
        missing, extra = sorted(names - row.keys()), sorted(row.keys() - names)
        differences = [f"lacks the columns {missing} of row 0"] if missing else []
        differences += [f"has the columns {extra} that row 0 lacks"] if extra else []
        message = f"row {i} {' and '.join(differences)}: every row of a list must have the same columns"
        if missing:
            raise MissingColumnsError(message, tuple(missing))
        raise SchemaMismatchError(message)


_WHOLE_ROWS = (
    "a put replaces whole rows, so a missing column would erase its values: "
    "give every column (NULL where a value is unknown)"
)


def check_columns(names: Sequence[str], target: pa.Schema, what: str = "data", keys: bool = False) -> None:
    """Refuse input columns `names` unless they are the columns of `target` (the table's, or its
    key columns' if `keys`), in any order: `SchemaMismatchError` for an extra or duplicate column,
    `MissingColumnsError` naming every column of `target` that `names` lacks."""
    scope = "the primary key" if keys else "the table"
    allowed = set(target.names)
    extra = [n for n in names if n not in allowed]
    if extra:
        raise SchemaMismatchError(f"{what} has columns that are not in {scope}: {extra}")
    present = set(names)
    if len(present) != len(names):
        raise SchemaMismatchError(f"{what} has duplicate column names: {list(names)}")
    missing = tuple(n for n in target.names if n not in present)
    if missing:
        hint = "give every primary-key column" if keys else _WHOLE_ROWS
        raise MissingColumnsError(f"{what} lacks the columns of {scope} {list(missing)}: {hint}", missing)


def conform(table: pa.Table, target: pa.Schema, what: str = "data", keys: bool = False) -> pa.Table:
    """`table` with exactly the columns of `target`, in its order and types (`check_columns`, then
    lossless conversions only)."""
    if table.num_columns == 0 and table.num_rows == 0:  # an empty list of rows: nothing to write
        return target.empty_table()
    check_columns(table.column_names, target, what, keys)
    return pa.Table.from_arrays([_convert(table.column(f.name), f) for f in target], schema=target)


def _convert(col: pa.ChunkedArray, f: pa.Field) -> pa.ChunkedArray:
    """`col` as the type of column `f`, if that loses nothing (else `SchemaMismatchError`)."""
    if col.type == f.type:
        return col
    if not _compatible(col.type, f.type):
        src, dst = _leaf_type(col.type), _leaf_type(f.type)
        why = (
            ": floating-point values are never converted to integers"
            if pa.types.is_floating(src) and pa.types.is_integer(dst)
            else ""
        )
        raise SchemaMismatchError(f"column {f.name!r} has type {col.type}, the table has {f.type}{why}")
    if pa.types.is_fixed_size_list(f.type) and _is_list(col.type):  # (not a column of NULLs)
        _check_dimension(col, f)
    try:
        out = col.cast(f.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaMismatchError(
            f"column {f.name!r} of type {col.type} cannot be converted to the table's {f.type}: {e}"
        ) from e
    src_leaf, dst_leaf = _leaf_type(col.type), _leaf_type(f.type)
    if pa.types.is_floating(src_leaf) and dst_leaf.bit_width < src_leaf.bit_width:
        # a safe cast turns a float beyond the narrower type's range into infinity
        before, after = (pc.sum(pc.is_inf(_leaves(c))).as_py() or 0 for c in (col, out))
        if after != before:
            raise SchemaMismatchError(
                f"column {f.name!r} of type {col.type} has values out of the range of the table's {f.type}"
            )
    return out


def convert_values(values: pa.Array | pa.ChunkedArray, f: pa.Field) -> pa.ChunkedArray:
    """`values` as the type of column `f` under the rules of `conform` (`SchemaMismatchError`)."""
    col = values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])
    return _convert(col, f)


def _check_dimension(col: pa.ChunkedArray, f: pa.Field) -> None:
    """Every non-NULL list of `col` has the length of the fixed-size lists (vectors) of column `f`."""
    want = f.type.list_size
    if pa.types.is_fixed_size_list(col.type):
        got = [col.type.list_size] if col.type.list_size != want else []
    else:
        lengths = pc.list_value_length(col)
        got = pc.unique(pc.filter(lengths, pc.not_equal(lengths, want))).to_pylist()
    if got:
        raise SchemaMismatchError(
            f"column {f.name!r} holds vectors of dimension {want}; the data has lists of "
            f"{' / '.join(map(str, sorted(got)[:5]))} values: give {want} values per row"
        )


def check_keys(table: pa.Table, primary_key: tuple[str, ...]) -> None:
    for name in primary_key:
        if table.column(name).null_count:
            raise NullPrimaryKeyError(f"primary key column {name!r} has NULL values")


def check_not_null(table: pa.Table) -> None:
    """Lance refuses NULLs in a non-nullable column (at flush, when it is too late): refuse them now.
    Call after `check_keys`, so that a NULL key is reported as a NullPrimaryKeyError."""
    for f in table.schema:
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaMismatchError(f"column {f.name!r} is not nullable but has NULL values")


def upsert_rows(ts: TableSchema, data: pa.Table) -> pa.Table:
    """User rows to upsert, conformed to the table schema (every column given, lossless types),
    with non-NULL keys and no NULL in a non-nullable column."""
    table = conform(data, ts.schema)
    check_keys(table, ts.primary_key)
    check_not_null(table)
    return table


def upsert_chunks(ts: TableSchema, data: Any, max_rows: int) -> Iterator[pa.Table]:
    """The rows of one put (any accepted input) as `upsert_rows` chunks of at most `max_rows` rows.
    A RecordBatchReader's columns are checked before its first batch is read."""
    if isinstance(data, pa.RecordBatchReader):
        check_columns(data.schema.names, ts.schema)
    for chunk in iter_tables(data, max_rows):
        yield upsert_rows(ts, chunk)


def key_rows(ts: TableSchema, keys: Any) -> pa.Table:
    """Delete keys (any input `keys_table` takes) conformed to the key schema, none NULL."""
    table = conform(keys_table(ts, keys), ts.key_schema, what="delete keys", keys=True)
    check_keys(table, ts.primary_key)
    return table


def tombstone_rows(ts: TableSchema, keys: pa.Table) -> pa.Table:
    """Full-schema rows for conformed, non-NULL `keys`: the key columns, NULL everywhere else."""
    n = keys.num_rows
    columns = []
    for f in ts.schema:
        if f.name in ts.primary_key:
            columns.append(keys.column(f.name))
        elif f.nullable:
            columns.append(pa.nulls(n, f.type))
        else:
            raise SchemaMismatchError(
                f"cannot delete: column {f.name!r} is not nullable, tombstones need NULLs"
            )
    return pa.Table.from_arrays(columns, schema=ts.schema)


def delete_batch(ts: TableSchema, keys: Any) -> pa.RecordBatch:
    """Tombstone rows for `keys` (any input `key_rows` takes; other columns are NULL)."""
    return with_tombstone(ts, tombstone_rows(ts, key_rows(ts, keys)), True)


def keys_table(ts: TableSchema, keys: Any) -> pa.Table:
    """Delete keys given as a table/batch/dict/list of rows, or as a bare array/list for one-column keys."""
    if isinstance(keys, pa.Array | pa.ChunkedArray) or (
        isinstance(keys, list) and keys and not isinstance(keys[0], dict)
    ):
        if len(ts.primary_key) != 1:
            raise SchemaMismatchError(f"a composite key {ts.primary_key} needs a table of key columns")
        return pa.table({ts.primary_key[0]: keys})
    return to_table(keys)


def with_tombstone(ts: TableSchema, table: pa.Table, deleted: bool) -> pa.RecordBatch:
    """A table already conformed to `ts.schema` as one WAL-schema batch with `_tombstone` = `deleted`."""
    flag = pa.array(np.full(table.num_rows, deleted), pa.bool_())
    columns = [c.chunk(0) if c.num_chunks == 1 else c.combine_chunks() for c in table.columns] + [flag]
    return pa.RecordBatch.from_arrays(columns, schema=ts.wal)
