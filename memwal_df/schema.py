"""The table's schema as writers see it, and the conversion of user input into WAL-schema batches.

Input may be a `pa.Table`, `pa.RecordBatch`, `pa.RecordBatchReader`, a pandas DataFrame, a dict of
columns or a list of row dicts. Columns are matched by name (order is free); a missing nullable column
is filled with NULLs; an extra column, a missing non-nullable column or a type that cannot be converted
without loss raises `SchemaMismatchError`; a NULL in a primary-key column raises
`NullPrimaryKeyError`. Nothing is written when an error is raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_df.errors import NullPrimaryKeyError, SchemaMismatchError
from memwal_df.wal import wal_schema


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

    @property
    def key_schema(self) -> pa.Schema:
        return pa.schema([self.schema.field(n) for n in self.primary_key])


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Types between which a safe cast preserves meaning (widening numbers, string/binary flavours)."""
    if src == dst:
        return True
    groups = (
        lambda t: pa.types.is_integer(t) or pa.types.is_floating(t),
        lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t),
        lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t),
        pa.types.is_timestamp,
        pa.types.is_date,
        lambda t: pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t),
        pa.types.is_null,
    )
    return (
        any(g(src) and g(dst) for g in groups)
        or pa.types.is_null(src)
        # a date widens to a timestamp; the reverse would drop the time of day (Arrow's safe cast
        # does not check that)
        or (pa.types.is_date(src) and pa.types.is_timestamp(dst))
    )


def to_table(data: Any) -> pa.Table:
    """Any accepted input as a pa.Table (a RecordBatchReader is read whole; see `iter_tables`)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.read_all()
    if isinstance(data, dict | list):
        if isinstance(data, list) and not all(isinstance(row, dict) for row in data):
            raise SchemaMismatchError("a list of rows must hold dicts (column name -> value)")
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


def conform(table: pa.Table, target: pa.Schema, what: str = "data") -> pa.Table:
    """`table` with exactly the columns of `target`, in its order and types."""
    if table.num_columns == 0 and table.num_rows == 0:  # an empty list of rows: nothing to write
        return target.empty_table()
    names, target_names = table.column_names, set(target.names)
    extra = [n for n in names if n not in target_names]
    if extra:
        raise SchemaMismatchError(f"{what} has columns that are not in the table: {extra}")
    present = set(names)
    if len(present) != len(names):
        raise SchemaMismatchError(f"{what} has duplicate column names: {names}")
    columns = []
    for f in target:
        if f.name not in present:
            if not f.nullable:
                raise SchemaMismatchError(f"{what} lacks the non-nullable column {f.name!r}")
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            if not _compatible(col.type, f.type):
                raise SchemaMismatchError(f"column {f.name!r} has type {col.type}, the table has {f.type}")
            try:
                col = col.cast(f.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaMismatchError(f"column {f.name!r} cannot be converted to {f.type}: {e}") from e
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=target)


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


def upsert_batch(ts: TableSchema, data: pa.Table) -> pa.RecordBatch:
    """User rows as one WAL-schema batch (`_tombstone` false)."""
    table = conform(data, ts.schema)
    check_keys(table, ts.primary_key)
    check_not_null(table)
    return with_tombstone(ts, table, False)


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


def delete_batch(ts: TableSchema, keys: pa.Table) -> pa.RecordBatch:
    """Tombstone rows for `keys` (the key columns; other columns are NULL)."""
    key_table = conform(keys, ts.key_schema, what="delete keys")
    check_keys(key_table, ts.primary_key)
    return with_tombstone(ts, tombstone_rows(ts, key_table), True)


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
