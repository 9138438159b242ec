"""Writes to the served tables: bulk ingest (`CommandStatementIngest`), `INSERT INTO t ...` and
`DELETE FROM t WHERE ...`, each applied through the server's one `TableWriter` per table and
acknowledged once the writer returns (after the WAL commit for a durable table).

How rows apply (`WRITE_MODES`, from the call's `x-memwal-write-mode` header, default `upsert`):
`upsert` writes whole rows (an INSERT's columns left out are NULL); `partial` writes the given
columns and keeps the others' current values; `insert_if_absent` writes only rows whose key has no
live row. The affected row count is the number of rows written (for `insert_if_absent`, inserted;
for DELETE, the live rows its WHERE matched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datafusion
import pyarrow as pa

from memwal_df.read.dataset import MemWalTable
from memwal_df.server.statements import Delete, Insert, tokens
from memwal_df.server.status import InvalidRequest, TooLarge
from memwal_df.table import Table
from memwal_df.write.table_writer import TableWriter

__all__ = [
    "WRITE_MODES",
    "ServedTable",
    "Writes",
    "bind_rows",
    "insert_parameter_schema",
    "parameter_sets",
    "placeholder_row",
    "read_stream",
]

WRITE_MODES = ("upsert", "partial", "insert_if_absent")
_CPU = pa.default_cpu_memory_manager()


@dataclass
class ServedTable:
    """A MemWAL table the server writes: its `Table`, the server's writer, the `MemWalTable`
    registered under its SQL name (which reads every write the writer acknowledged), and that name."""

    name: str
    table: Table
    writer: TableWriter
    durable: bool
    reader: MemWalTable

    @property
    def schema(self) -> pa.Schema:
        return self.table.schema.schema

    @property
    def primary_key(self) -> list[str]:
        return list(self.table.schema.primary_key)


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def parameter_sets(params: pa.Table | None) -> list[dict[str, Any]]:
    """One DataFusion `param_values` dict (`{"1": scalar, ...}`) per row of bound parameters."""
    if params is None or params.num_rows == 0:
        return [{}]
    columns = params.columns
    return [{str(i + 1): col[r] for i, col in enumerate(columns)} for r in range(params.num_rows)]


def bind_rows(source: str, params: pa.Table | None) -> pa.Table | None:
    """The rows of `VALUES ($1, ..., $n)` (every value a placeholder, in order) with `params`
    bound, straight from the parameter columns: one row per parameter set, no SQL run per row.
    None when `source` is anything else."""
    if params is None:
        return None
    n = placeholder_row(source)
    if n is None:
        return None
    if n != params.num_columns:
        raise InvalidRequest(f"the statement takes {n} parameters, {params.num_columns} were bound")
    return pa.Table.from_arrays(params.columns, names=[f"column{i}" for i in range(1, n + 1)])


def placeholder_row(source: str) -> int | None:
    """n when `source` is `VALUES ($1, ..., $n)` (every value a placeholder, in order), else None."""
    toks = tokens(source)
    if len(toks) < 3 or toks[0].upper != "VALUES" or toks[1].text != "(" or toks[-1].text != ")":
        return None
    inner = toks[2:-1]
    values, commas = inner[0::2], inner[1::2]
    if any(t.text != "," for t in commas) or [t.text for t in values] != [
        f"${i}" for i in range(1, len(values) + 1)
    ]:
        return None
    return len(values)


def insert_parameter_schema(served: ServedTable, stmt: Insert) -> pa.Schema | None:
    """The types of the placeholders of `INSERT INTO served [(columns)] VALUES ($1, ..., $n)`: the
    named columns' types (or the table's columns', in order); None for any other source."""
    n = placeholder_row(stmt.source)
    names = list(stmt.columns) if stmt.columns is not None else served.schema.names
    if n != len(names) or not all(c in served.schema.names for c in names):
        return None
    return pa.schema([pa.field(f"${i}", served.schema.field(c).type) for i, c in enumerate(names, start=1)])


class Writes:
    """The served tables and the writes the server applies to them."""

    def __init__(self, ctx: datafusion.SessionContext, tables: dict[str, ServedTable]) -> None:
        self._ctx = ctx
        self.tables = tables

    def served(self, name: str) -> ServedTable | None:
        return self.tables.get(name)

    def apply(self, served: ServedTable, rows: pa.Table, mode: str | None) -> int:
        """Write `rows` in `mode`; the number of rows written, once the writer acknowledged them."""
        mode = check_mode(mode)
        if rows.num_rows == 0:
            return 0
        w = served.writer
        if mode == "upsert":
            w.put(rows)
            return rows.num_rows
        if mode == "partial":
            w.put(rows, partial=True)
            return rows.num_rows
        return w.insert_if_absent(rows).count

    def insert(self, served: ServedTable, stmt: Insert, params: pa.Table | None, mode: str | None) -> int:
        """`INSERT INTO served [(columns)] source`: the source's rows, named by the column list (or
        the table's columns in order), written in `mode`."""
        rows = bind_rows(stmt.source, params)
        if rows is None:
            sets = parameter_sets(params)
            parts = [self._ctx.sql(stmt.source, param_values=p).to_arrow_table() for p in sets]
            rows = parts[0] if len(parts) == 1 else _concat(parts)
        names = list(stmt.columns) if stmt.columns is not None else served.schema.names
        if rows.num_columns != len(names):
            target = (
                f"the column list {names}" if stmt.columns is not None else f"the table's columns {names}"
            )
            raise InvalidRequest(f"INSERT gives {rows.num_columns} values per row for {target}")
        unknown = [n for n in names if n not in served.schema.names]
        if unknown:
            raise InvalidRequest(f"INSERT names columns that table {served.name!r} lacks: {unknown}")
        rows = rows.rename_columns(names)
        if check_mode(mode) == "upsert":  # SQL: the columns an INSERT leaves out are NULL
            for f in served.schema:
                if f.name not in names:
                    rows = rows.append_column(f, pa.nulls(rows.num_rows, f.type))
        return self.apply(served, rows, mode)

    def delete(self, served: ServedTable, stmt: Delete, params: pa.Table | None) -> int:
        """`DELETE FROM served WHERE condition`: the condition may use the primary-key columns only,
        so the keys it matches do not depend on values a concurrent write may change; deletes the
        live rows it matches and returns their number."""
        pk = ", ".join(quote(c) for c in served.primary_key)
        name = quote(served.name)
        sql = f"SELECT {pk} FROM (SELECT {pk} FROM {name}) AS {name} WHERE {stmt.where}"
        keys = []
        for p in parameter_sets(params):
            try:
                keys.append(self._ctx.sql(sql, param_values=p).to_arrow_table())
            except Exception as e:  # noqa: BLE001 - DataFusion's planning errors are plain exceptions
                if "No field named" in str(e):
                    raise InvalidRequest(
                        f"DELETE's WHERE may use only the primary key {served.primary_key} of "
                        f"{served.name!r} ({str(e).splitlines()[0]})"
                    ) from None
                raise
        found = keys[0] if len(keys) == 1 else _concat(keys)
        if found.num_rows:
            served.writer.delete(found)
        return found.num_rows


def check_mode(mode: str | None) -> str:
    if mode is None or mode == "":
        return "upsert"
    if mode not in WRITE_MODES:
        raise InvalidRequest(f"unknown write mode {mode[:100]!r}: use one of {list(WRITE_MODES)}")
    return mode


def _concat(parts: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InvalidRequest(f"the parameter sets give rows of different types: {e}") from None


def read_stream(reader: Any, max_bytes: int, what: str) -> pa.Table:
    """Every batch of a DoPut stream, refused with a limit error past `max_bytes`."""
    batches, total = [], 0
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            break
        batch = chunk.data
        if batch is None:
            continue
        total += batch.nbytes
        if total > max_bytes:
            raise TooLarge(
                f"{what} is over the server's request size limit of {max_bytes} bytes: "
                "send it in smaller parts"
            )
        # Flight hands over the buffers where gRPC received them, not always aligned for their type;
        # Lance (through the writer's indexes and flushes) refuses unaligned buffers: copy once.
        batches.append(batch.copy_to(_CPU))
    return pa.Table.from_batches(batches, schema=reader.schema)
