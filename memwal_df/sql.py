"""SQL integration: `register(ctx)` adds memwal_df's table functions to a DataFusion SessionContext.

Table functions cannot ask DataFusion for a table by name (that would block inside DataFusion's own
runtime and panic), so `register` keeps memwal_df's own registry: it wraps the context's
`register_table` / `deregister_table` to remember which names are `MemWalTable`s.

Functions:
- `memwal_explain('t', 'filter')`: the operator tree a query on `t` with that filter gets, one row
  per line (columns `partition`, `line`).
"""

from __future__ import annotations

from typing import Any

import datafusion
import pyarrow as pa
import pyarrow.dataset as pds
from datafusion import Expr, Table, udtf

from memwal_df.dataset import MemWalTable
from memwal_df.sqlexpr import parse_filter

_REGISTRY_ATTR = "_memwal_tables"


def register(ctx: datafusion.SessionContext) -> datafusion.SessionContext:
    """Install memwal_df's SQL functions and table registry on `ctx` (idempotent); returns `ctx`."""
    if hasattr(ctx, _REGISTRY_ATTR):
        return ctx
    tables: dict[str, MemWalTable] = {}
    setattr(ctx, _REGISTRY_ATTR, tables)
    register_table, deregister_table = ctx.register_table, ctx.deregister_table

    def register_table_and_remember(name: str, table: Any) -> None:
        register_table(name, table)
        if isinstance(table, MemWalTable):
            tables[name] = table
        else:
            tables.pop(name, None)

    def deregister_table_and_forget(name: str) -> None:
        deregister_table(name)
        tables.pop(name, None)

    ctx.register_table = register_table_and_remember  # type: ignore[method-assign]
    ctx.deregister_table = deregister_table_and_forget  # type: ignore[method-assign]
    ctx.register_udtf(udtf(lambda name, flt=None: _explain(tables, name, flt), "memwal_explain"))
    return ctx


def memwal_table(ctx: datafusion.SessionContext, name: str) -> MemWalTable:
    """The MemWalTable registered under `name` in a context prepared by `register`."""
    tables: dict[str, MemWalTable] = getattr(ctx, _REGISTRY_ATTR, {})
    if name not in tables:
        raise KeyError(f"no MemWAL table named {name!r} is registered (call memwal_df.register(ctx) first)")
    return tables[name]


def _literal(arg: Any) -> Any:
    value = Expr(arg).python_value()
    return value.as_py() if isinstance(value, pa.Scalar) else value


def _explain(tables: dict[str, MemWalTable], name_arg: Any, filter_arg: Any) -> Table:
    name = _literal(name_arg)
    if name not in tables:
        raise KeyError(f"memwal_explain: no MemWAL table named {name!r} is registered")
    text = _literal(filter_arg) if filter_arg is not None else None
    lines = tables[name].explain(parse_filter(text) if text else None).splitlines()
    return Table(pds.dataset(pa.table({"line": pa.array(lines, pa.string())})))
