"""SQL integration: `register(ctx)` adds memwal_df's table functions to a DataFusion SessionContext.

The table functions need the `MemWalTable` behind a table name, and DataFusion cannot give it: it
hands a registered table back only as its own provider (`ctx.table_provider(name)`: a kind and a
schema, never the Python dataset), and a table function cannot call it anyway (it would block inside
DataFusion's own runtime and panic). So `register` keeps memwal_df's own registry: it wraps the
context's `register_table` / `deregister_table` to remember which names are `MemWalTable`s. Only
tables registered with `ctx.register_table` after `register(ctx)` are found.

Functions:
- `memwal_explain('t', 'filter')`: the operator tree a query on `t` with that filter gets, one row
  per line (column `line`).
- `vector_search('t', 'column', [query vector], k [, named_struct(...)])`: the `k` nearest live rows
  (table columns + `_distance`); options `nprobes`, `refine_factor`, `metric`, `filter` (SQL text).
- `fts('t', 'column', 'query', k [, named_struct('filter', ...)])`: the `k` best live rows by BM25
  over the deduplicated table (table columns + `_score`).
- `memwal_explain_search('vector_search' | 'fts', 't', 'column', query, k [, options])`: the search's
  operator tree after it ran (what each operator did), one row per line.

Search results are computed when DataFusion plans the query (table functions are evaluated then)
and are ordinary relations: they can be filtered, joined and ordered.

Errors: DataFusion hands an exception raised inside SQL (in a table function or a scan) to Python as
a plain error whose text names the original; `query(ctx, sql)` runs a query and raises the
memwal_df error with its own type (`memwal_df.errors.unwrap` does it for an error already caught).
`register` wraps the context's `sql` so that the error of a table function starts with a line of
its own (`errors.sql_error`); a scan raises its errors as `errors.raised_into_sql` gives them.

See docs/search.md.
"""

from __future__ import annotations

import uuid
from typing import Any

import datafusion
import pyarrow as pa
import pyarrow.dataset as pds
from datafusion import Expr, Table, udtf

from memwal_df.errors import InvalidConfigError, TableNotRegisteredError, sql_error, unwrap
from memwal_df.pools import shared_pool
from memwal_df.read.dataset import MemWalTable
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.expr.sql_text import parse_filter
from memwal_df.read.search.planner import plan_fts, plan_vector_search

_REGISTRY_ATTR = "_memwal_tables"


def register(ctx: datafusion.SessionContext) -> datafusion.SessionContext:
    """Install memwal_df's SQL functions and table registry on `ctx` (idempotent); returns `ctx`."""
    if hasattr(ctx, _REGISTRY_ATTR):
        return ctx
    tables: dict[str, MemWalTable] = {}
    setattr(ctx, _REGISTRY_ATTR, tables)
    register_table, deregister_table, sql = ctx.register_table, ctx.deregister_table, ctx.sql

    def register_table_and_remember(name: str, table: Any) -> None:
        register_table(name, table)
        if isinstance(table, MemWalTable):
            tables[name] = table
        else:
            tables.pop(name, None)

    def deregister_table_and_forget(name: str) -> None:
        deregister_table(name)
        tables.pop(name, None)

    def sql_with_headline(query: str, *args: Any, **kwargs: Any) -> datafusion.DataFrame:
        try:
            return sql(query, *args, **kwargs)
        except Exception as e:  # DataFusion raises plain ValueError / Exception
            headed = sql_error(e)
            if headed is e:
                raise
            raise headed from None  # (its text holds DataFusion's; `__cause__` is `e`)

    ctx.register_table = register_table_and_remember  # type: ignore[method-assign]
    ctx.deregister_table = deregister_table_and_forget  # type: ignore[method-assign]
    ctx.sql = sql_with_headline  # type: ignore[method-assign]
    ctx.register_udtf(udtf(lambda *args: _explain(tables, args), "memwal_explain"))
    ctx.register_udtf(udtf(lambda *args: _search(tables, "vector_search", args), "vector_search"))
    ctx.register_udtf(udtf(lambda *args: _search(tables, "fts", args), "fts"))
    ctx.register_udtf(udtf(lambda *args: _explain_search(tables, args), "memwal_explain_search"))
    return ctx


def query(ctx: datafusion.SessionContext, sql: str) -> pa.Table:
    """The result of `sql` on `ctx` as an Arrow table. A memwal_df error raised inside the query
    (a table function's bad argument, a scan that fails) is raised with its own type, e.g.
    `InvalidConfigError`; DataFusion's own errors are raised as DataFusion raises them."""
    try:
        return ctx.sql(sql).to_arrow_table()
    except Exception as e:  # DataFusion raises plain ValueError / Exception
        typed = unwrap(e)
        if typed is e:
            raise
        raise typed from e


def _registered(tables: dict[str, MemWalTable], name: Any, function: str) -> MemWalTable:
    """The table registered as `name`; `TableNotRegisteredError` naming it otherwise."""
    if name not in tables:
        raise TableNotRegisteredError(
            f"{function}: no MemWAL table named {name!r} is registered in this context (register it "
            "with ctx.register_table(name, MemWalTable(...)) after memwal_df.register(ctx))"
        )
    return tables[name]


def _literal(arg: Any, function: str, what: str) -> Any:
    """The value of the literal argument `arg` (`what`: its name); `InvalidConfigError` naming it for
    anything else (a column, a subquery): table functions are evaluated while the query is planned,
    before any row is read."""
    expr = Expr(arg)
    try:
        value = expr.python_value()
    except TypeError:  # datafusion: "Non Expr::Literal encountered in types"
        raise InvalidConfigError(
            f"{function}: {what} must be a literal value, not the expression {expr.canonical_name()}"
        ) from None
    return value.as_py() if isinstance(value, pa.Scalar) else value


def _explain(tables: dict[str, MemWalTable], args: tuple[Any, ...]) -> Table:
    if len(args) not in (1, 2):
        raise InvalidConfigError("memwal_explain(table [, filter]) takes 1 or 2 arguments")
    name = _literal(args[0], "memwal_explain", "table")
    text = _literal(args[1], "memwal_explain", "filter") if len(args) == 2 else None
    if text is not None and not isinstance(text, str):
        raise InvalidConfigError(f"memwal_explain: filter must be SQL text (a string), not {text!r}")
    table = _registered(tables, name, "memwal_explain")
    lines = table.explain(parse_filter(text, table.schema) if text else None).splitlines()
    return Table(pds.dataset(pa.table({"line": pa.array(lines, pa.string())})))


_PLANNERS = {"vector_search": plan_vector_search, "fts": plan_fts}


_ARGUMENTS = ("table", "column", "query", "k", "options")


def _search_plan(tables: dict[str, MemWalTable], function: str, args: tuple[Any, ...]) -> ExecNode:
    if len(args) not in (4, 5):
        raise InvalidConfigError(f"{function}(table, column, query, k [, options]) takes 4 or 5 arguments")
    name, column, search_query, k, *rest = (
        _literal(a, function, w) for a, w in zip(args, _ARGUMENTS[: len(args)], strict=True)
    )
    table = _registered(tables, name, function)
    options = rest[0] if rest else None
    if options is not None and not isinstance(options, dict):
        raise InvalidConfigError(f"{function}: options must be a named_struct, not {options!r}")
    return _PLANNERS[function](table, column, search_query, k, options)


def _search(tables: dict[str, MemWalTable], function: str, args: tuple[Any, ...]) -> Table:
    plan = _search_plan(tables, function, args)
    return _relation(plan.to_table())


_RELATIONS = datafusion.SessionContext()  # builds the in-memory relations that table functions return


def _make_relation(rows: pa.Table) -> datafusion.DataFrame:
    name = f"memwal_result_{uuid.uuid4().hex}"
    df = _RELATIONS.from_arrow(rows, name)
    _RELATIONS.deregister_table(name)  # the DataFrame's plan holds the in-memory table
    return df


def _relation(rows: pa.Table) -> Table:
    """`rows` as a DataFusion in-memory table (a view of a DataFrame over a `MemTable`): scanned in
    DataFusion without calling back into Python, faster per query than a `pyarrow.dataset`. The
    DataFrame is made on a pool thread: the table function runs inside DataFusion's runtime, where
    `from_arrow` would block on it and panic."""
    return Table(shared_pool("relations", 1).submit(_make_relation, rows).result())


def _explain_search(tables: dict[str, MemWalTable], args: tuple[Any, ...]) -> Table:
    usage = "memwal_explain_search(function, table, column, query, k [, options])"
    if not args:
        raise InvalidConfigError(f"{usage} takes 5 or 6 arguments")
    function = _literal(args[0], "memwal_explain_search", "function")
    if function not in _PLANNERS:
        raise InvalidConfigError(
            f"memwal_explain_search: no search function {function!r}; the first argument names one "
            f"of {sorted(_PLANNERS)}"
        )
    plan = _search_plan(tables, function, args[1:])
    plan.to_table()  # run it: the operators then report what they did
    return Table(pds.dataset(pa.table({"line": pa.array(plan.explain(), pa.string())})))
