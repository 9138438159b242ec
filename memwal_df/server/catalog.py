"""The Flight SQL metadata commands, answered from the DataFusion context: `CommandGetSqlInfo`,
`GetCatalogs`, `GetDbSchemas`, `GetTables` (with each table's Arrow schema), `GetTableTypes`,
`GetPrimaryKeys` (the served MemWAL tables' keys), and empty answers for the foreign-key and XDBC
type commands. Each function returns an Arrow table in the schema the Flight SQL spec gives.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import datafusion
import pyarrow as pa
from google.protobuf.message import Message

from memwal_df.server.protocol import schema_bytes, sql
from memwal_df.server.status import log

__all__ = ["SCHEMAS", "PrimaryKeys", "answer", "locate", "schema_of"]

PrimaryKeys = dict[tuple[str, str, str], list[str]]  # (catalog, schema, table) -> key columns

_TABLE_TYPE = "TABLE"
_VIEW_TYPE = "VIEW"

CATALOGS = pa.schema([pa.field("catalog_name", pa.utf8(), nullable=False)])
DB_SCHEMAS = pa.schema([("catalog_name", pa.utf8()), pa.field("db_schema_name", pa.utf8(), nullable=False)])
_TABLES_FIELDS = [
    ("catalog_name", pa.utf8()),
    ("db_schema_name", pa.utf8()),
    pa.field("table_name", pa.utf8(), nullable=False),
    pa.field("table_type", pa.utf8(), nullable=False),
]
TABLES = pa.schema(_TABLES_FIELDS)
TABLES_WITH_SCHEMA = pa.schema([*_TABLES_FIELDS, pa.field("table_schema", pa.binary(), nullable=False)])
TABLE_TYPES = pa.schema([pa.field("table_type", pa.utf8(), nullable=False)])
PRIMARY_KEYS = pa.schema(
    [
        ("catalog_name", pa.utf8()),
        ("db_schema_name", pa.utf8()),
        pa.field("table_name", pa.utf8(), nullable=False),
        pa.field("column_name", pa.utf8(), nullable=False),
        ("key_name", pa.utf8()),
        pa.field("key_sequence", pa.int32(), nullable=False),
    ]
)
_KEY_FIELDS = [
    ("pk_catalog_name", pa.utf8()),
    ("pk_db_schema_name", pa.utf8()),
    pa.field("pk_table_name", pa.utf8(), nullable=False),
    pa.field("pk_column_name", pa.utf8(), nullable=False),
    ("fk_catalog_name", pa.utf8()),
    ("fk_db_schema_name", pa.utf8()),
    pa.field("fk_table_name", pa.utf8(), nullable=False),
    pa.field("fk_column_name", pa.utf8(), nullable=False),
    pa.field("key_sequence", pa.int32(), nullable=False),
    ("fk_key_name", pa.utf8()),
    ("pk_key_name", pa.utf8()),
    pa.field("update_rule", pa.uint8(), nullable=False),
    pa.field("delete_rule", pa.uint8(), nullable=False),
]
FOREIGN_KEYS = pa.schema(_KEY_FIELDS)
XDBC_TYPE_INFO = pa.schema(
    [
        pa.field("type_name", pa.utf8(), nullable=False),
        pa.field("data_type", pa.int32(), nullable=False),
        ("column_size", pa.int32()),
        ("literal_prefix", pa.utf8()),
        ("literal_suffix", pa.utf8()),
        ("create_params", pa.list_(pa.field("item", pa.utf8(), nullable=False))),
        pa.field("nullable", pa.int32(), nullable=False),
        pa.field("case_sensitive", pa.bool_(), nullable=False),
        pa.field("searchable", pa.int32(), nullable=False),
        ("unsigned_attribute", pa.bool_()),
        pa.field("fixed_prec_scale", pa.bool_(), nullable=False),
        ("auto_increment", pa.bool_()),
        ("local_type_name", pa.utf8()),
        ("minimum_scale", pa.int32()),
        ("maximum_scale", pa.int32()),
        pa.field("sql_data_type", pa.int32(), nullable=False),
        ("datetime_subcode", pa.int32()),
        ("num_prec_radix", pa.int32()),
        ("interval_precision", pa.int32()),
    ]
)
_SQL_INFO_VALUE = pa.dense_union(
    [
        pa.field("string_value", pa.utf8()),
        pa.field("bool_value", pa.bool_()),
        pa.field("bigint_value", pa.int64()),
        pa.field("int32_bitmask", pa.int32()),
        pa.field("string_list", pa.list_(pa.field("item", pa.utf8()))),
        pa.field(
            "int32_to_int32_list_map",
            pa.map_(pa.int32(), pa.list_(pa.field("item", pa.int32()))),
        ),
    ]
)
SQL_INFO = pa.schema(
    [pa.field("info_name", pa.uint32(), nullable=False), pa.field("value", _SQL_INFO_VALUE, nullable=False)]
)

SCHEMAS: dict[type[Message], pa.Schema] = {
    sql.CommandGetSqlInfo: SQL_INFO,
    sql.CommandGetCatalogs: CATALOGS,
    sql.CommandGetDbSchemas: DB_SCHEMAS,
    sql.CommandGetTableTypes: TABLE_TYPES,
    sql.CommandGetPrimaryKeys: PRIMARY_KEYS,
    sql.CommandGetExportedKeys: FOREIGN_KEYS,
    sql.CommandGetImportedKeys: FOREIGN_KEYS,
    sql.CommandGetCrossReference: FOREIGN_KEYS,
    sql.CommandGetXdbcTypeInfo: XDBC_TYPE_INFO,
}


def schema_of(command: Message) -> pa.Schema:
    if isinstance(command, sql.CommandGetTables):
        return TABLES_WITH_SCHEMA if command.include_schema else TABLES
    return SCHEMAS[type(command)]


def _pattern(pattern: str | None) -> Callable[[str], bool]:
    """A SQL LIKE pattern (`%`, `_`; `\\` escapes) as a predicate; None matches everything."""
    if pattern is None:
        return lambda _: True
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if c == "%" else "." if c == "_" else re.escape(c))
        i += 1
    regex = re.compile("".join(out), re.DOTALL)
    return lambda name: regex.fullmatch(name) is not None


def _optional(command: Message, field: str) -> str | None:
    return getattr(command, field) if command.HasField(field) else None


def _tables(ctx: datafusion.SessionContext) -> Iterator[tuple[str, str, str]]:
    """(catalog, schema, table) of every table of the context, sorted."""
    for catalog in sorted(ctx.catalog_names()):
        c = ctx.catalog(catalog)
        for schema in sorted(c.schema_names()):
            for table in sorted(c.schema(schema).table_names()):
                yield catalog, schema, table


def _table_schema(ctx: datafusion.SessionContext, catalog: str, schema: str, table: str) -> pa.Schema:
    try:
        result: pa.Schema = ctx.catalog(catalog).schema(schema).table(table).schema
        return result
    except Exception as e:  # noqa: BLE001 - a provider that cannot say its schema: list it without one
        log.warning("cannot read the schema of table %s.%s.%s: %s", catalog, schema, table, e)
        return pa.schema([])


def answer(
    command: Message,
    ctx: datafusion.SessionContext,
    primary_keys: PrimaryKeys,
    sql_info: dict[int, object],
) -> pa.Table:
    """The result of the metadata `command`."""
    if isinstance(command, sql.CommandGetSqlInfo):
        return _sql_info(sql_info, list(command.info))
    if isinstance(command, sql.CommandGetCatalogs):
        return pa.table({"catalog_name": sorted(ctx.catalog_names())}, schema=CATALOGS)
    if isinstance(command, sql.CommandGetDbSchemas):
        want_catalog = _optional(command, "catalog")
        match = _pattern(_optional(command, "db_schema_filter_pattern"))
        rows = [
            (c, s)
            for c in sorted(ctx.catalog_names())
            if want_catalog is None or want_catalog == c
            for s in sorted(ctx.catalog(c).schema_names())
            if match(s)
        ]
        return pa.table(
            {"catalog_name": [r[0] for r in rows], "db_schema_name": [r[1] for r in rows]}, schema=DB_SCHEMAS
        )
    if isinstance(command, sql.CommandGetTables):
        return _get_tables(command, ctx)
    if isinstance(command, sql.CommandGetTableTypes):
        return pa.table({"table_type": [_TABLE_TYPE, _VIEW_TYPE]}, schema=TABLE_TYPES)
    if isinstance(command, sql.CommandGetPrimaryKeys):
        return _primary_keys(command, ctx, primary_keys)
    return schema_of(command).empty_table()


def _get_tables(command: sql.CommandGetTables, ctx: datafusion.SessionContext) -> pa.Table:
    want_catalog = _optional(command, "catalog")
    schema_match = _pattern(_optional(command, "db_schema_filter_pattern"))
    table_match = _pattern(_optional(command, "table_name_filter_pattern"))
    types = set(command.table_types)
    cols: dict[str, list[object]] = {f.name: [] for f in schema_of(command)}
    for catalog, schema, table in _tables(ctx):
        if want_catalog is not None and want_catalog != catalog:
            continue
        if not (schema_match(schema) and table_match(table)):
            continue
        kind = _VIEW_TYPE if _is_view(ctx, catalog, schema, table) else _TABLE_TYPE
        if types and kind not in types:
            continue
        cols["catalog_name"].append(catalog)
        cols["db_schema_name"].append(schema)
        cols["table_name"].append(table)
        cols["table_type"].append(kind)
        if command.include_schema:
            cols["table_schema"].append(schema_bytes(_table_schema(ctx, catalog, schema, table)))
    return pa.table(cols, schema=schema_of(command))


def _is_view(ctx: datafusion.SessionContext, catalog: str, schema: str, table: str) -> bool:
    try:
        return str(ctx.catalog(catalog).schema(schema).table(table).kind).lower() == "view"
    except Exception:  # noqa: BLE001
        return False


def _primary_keys(
    command: sql.CommandGetPrimaryKeys, ctx: datafusion.SessionContext, primary_keys: PrimaryKeys
) -> pa.Table:
    want_catalog = _optional(command, "catalog")
    want_schema = _optional(command, "db_schema")
    rows: list[tuple[str, str, str, str, int]] = []
    for (catalog, schema, table), columns in sorted(primary_keys.items()):
        if table != command.table:
            continue
        if (want_catalog is not None and want_catalog != catalog) or (
            want_schema is not None and want_schema != schema
        ):
            continue
        rows += [(catalog, schema, table, column, i + 1) for i, column in enumerate(columns)]
    return pa.table(
        {
            "catalog_name": [r[0] for r in rows],
            "db_schema_name": [r[1] for r in rows],
            "table_name": [r[2] for r in rows],
            "column_name": [r[3] for r in rows],
            "key_name": [None] * len(rows),
            "key_sequence": [r[4] for r in rows],
        },
        schema=PRIMARY_KEYS,
    )


def locate(ctx: datafusion.SessionContext, table: str) -> tuple[str, str, str]:
    """(catalog, schema, table) of a table `ctx.register_table` registered under `table`."""
    for where in _tables(ctx):
        if where[2] == table:
            return where
    raise KeyError(table)


def _sql_info(info: dict[int, object], wanted: list[int]) -> pa.Table:
    """`CommandGetSqlInfo`: the requested entries the server has (all of them if none requested)."""
    ids = [i for i in (wanted or sorted(info)) if i in info]
    type_codes, offsets, names = [], [], []
    children: list[list[object]] = [[] for _ in range(6)]
    for i in ids:
        value = info[i]
        code = (
            1
            if isinstance(value, bool)
            else 2
            if isinstance(value, int)
            else 4
            if isinstance(value, list)
            else 0
        )
        type_codes.append(code)
        offsets.append(len(children[code]))
        children[code].append(value)
        names.append(i)
    arrays = [pa.array(children[k], type=_SQL_INFO_VALUE.field(k).type) for k in range(6)]
    value = pa.UnionArray.from_dense(
        pa.array(type_codes, pa.int8()),
        pa.array(offsets, pa.int32()),
        arrays,
        [f.name for f in _SQL_INFO_VALUE],
    )
    return pa.Table.from_arrays([pa.array(names, pa.uint32()), value], schema=SQL_INFO)
