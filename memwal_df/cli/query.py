"""`memwal sql` (one query, or an interactive shell when no query is given) and `memwal explain`.

Tables are registered as `MemWalTable`s in one DataFusion context prepared by `memwal_df.register`,
so `vector_search`, `fts`, `memwal_explain` and `memwal_explain_search` work in the SQL.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from typing import Any

import datafusion
import pyarrow as pa

from memwal_df import errors
from memwal_df.cli import common as c
from memwal_df.errors import InvalidArgumentError
from memwal_df.read.dataset import MemWalTable
from memwal_df.read.expr.sql_text import parse_filter
from memwal_df.read.sql import register as register_functions
from memwal_df.table import open_table

CONSISTENCY = ("latest", "snapshot")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sql",
        help="run SQL over tables (an interactive shell without a query)",
        description="Run one SQL query over MemWAL tables, or start an interactive SQL shell when no "
        "query is given (statements end with ';'; \\q quits, \\d lists tables, \\? shows help). "
        "vector_search(...), fts(...) and memwal_explain(...) are available.",
        epilog='example: memwal sql -t events=./events "SELECT count(*) FROM events"',
    )
    p.add_argument("query", nargs="?", help="the SQL query (omit for the shell)")
    p.add_argument(
        "-t",
        "--table",
        action="append",
        required=True,
        metavar="NAME=URI",
        help="register a table (repeat); a bare URI is registered as 't'",
    )
    c.add_storage_options(p)
    p.add_argument("--consistency", choices=CONSISTENCY, default="latest", help="read mode (docs/reading.md)")
    p.add_argument("--max-rows", type=int, default=100, help="rows printed as a table (default 100)")
    c.add_json(p)
    p.set_defaults(run=run_sql)

    e = sub.add_parser(
        "explain",
        help="show the operator tree of a query with a filter",
        description="The operator tree memwal_df plans for a scan of the table with FILTER (SQL text, "
        'e.g. "id = 5" or "category = \'a\' AND value < 0.1"); no filter: a full scan.',
    )
    c.add_table(e)
    e.add_argument("filter", nargs="?", help="a SQL filter (default: none)")
    e.add_argument("--columns", help="comma-separated projection (default: every column)")
    e.add_argument("--consistency", choices=CONSISTENCY, default="latest")
    c.add_json(e)
    e.set_defaults(run=run_explain)


# ------------------------------------------------------------------------------------------- context


def table_specs(items: list[str]) -> dict[str, str]:
    """`-t` values as name -> URI; a bare URI is named `t` (only when it is the only table)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, uri = item.partition("=")
        if not sep:
            if len(items) > 1:
                raise InvalidArgumentError(f"name every table when there are several: -t NAME={item}")
            name, uri = "t", item
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not uri:
            raise InvalidArgumentError(f"-t takes NAME=URI with NAME an SQL identifier, got {item!r}")
        if name in out:
            raise InvalidArgumentError(f"table name {name!r} given twice")
        out[name] = uri
    return out


def context(tables: dict[str, str], options: dict[str, str] | None, consistency: str) -> Any:
    """A DataFusion context with memwal_df's functions and each table registered as a MemWalTable."""
    config = datafusion.SessionConfig().with_information_schema(True)
    ctx = register_functions(datafusion.SessionContext(config))
    for name, uri in tables.items():
        ctx.register_table(name, MemWalTable(open_table(uri, options), consistency=consistency))
    return ctx


def run_query(ctx: Any, sql: str) -> pa.Table:
    """The query's result; `SqlError` (exit code 6) with DataFusion's message when it fails."""
    try:
        return ctx.sql(sql).to_arrow_table()
    except Exception as e:  # noqa: BLE001 - DataFusion raises plain ValueError/Exception
        raise sql_error(e) from e


def sql_error(e: BaseException) -> c.SqlError:
    """DataFusion's error as a `SqlError`: the memwal_df error it carries with its type and message,
    a wrapped Python error as `Type: message`, else DataFusion's first line."""
    typed = errors.unwrap(e)
    if typed is not e:
        return c.SqlError(str(typed), type(typed).__name__)
    text = str(e)
    m = re.search(r"PyErr \{ type: <class '([\w.]+)'>, value: \w+\((.*?)\), traceback", text, flags=re.S)
    if m:
        return c.SqlError(m.group(2).strip(chr(34) + chr(39)), m.group(1).rsplit(".", 1)[-1])
    return c.SqlError(text.strip().splitlines()[0] if text.strip() else type(e).__name__)


def render(result: pa.Table, max_rows: int) -> str:
    """A result as an aligned text table of at most `max_rows` rows, with the row count."""
    shown = result.slice(0, max_rows)
    rows = [list(r.values()) for r in shown.to_pylist()]
    footer = f"({c.count(result.num_rows, 'row')}"
    footer += f", first {max_rows} shown)" if result.num_rows > max_rows else ")"
    return c.text_table(result.column_names, rows) + "\n" + footer


def print_result(args: argparse.Namespace, result: pa.Table) -> None:
    """The rows with `--json` as one JSON document on one line (a list of row objects, all of them),
    else as a text table of `--max-rows` rows."""
    if args.json:
        print(json.dumps(c.plain(result.to_pylist())), flush=True)
    else:
        print(render(result, args.max_rows))


# ------------------------------------------------------------------------------------------ commands


def run_sql(args: argparse.Namespace) -> int:
    if args.max_rows < 0:
        raise InvalidArgumentError("--max-rows must be >= 0")
    ctx = context(table_specs(args.table), c.storage_options(args), args.consistency)
    if args.query is not None:
        print_result(args, run_query(ctx, args.query))
        return c.Exit.OK
    return Shell(ctx, args).run()


def run_explain(args: argparse.Namespace) -> int:
    table = MemWalTable(c.table_of(args), consistency=args.consistency)
    columns = [x.strip() for x in args.columns.split(",")] if args.columns else None
    unknown = [x for x in columns or () if x not in table.schema.names]
    if unknown:
        raise InvalidArgumentError(f"--columns: no such columns {unknown}")
    lines = table.explain(_filter(args.filter, table.schema), columns).splitlines()
    c.emit(args, {"filter": args.filter, "plan": lines}, lambda: "\n".join(lines))
    return c.Exit.OK


def _filter(text: str | None, schema: pa.Schema) -> Any:
    """The filter text as a pyarrow expression; InvalidArgumentError if it does not parse, reads a
    column the table lacks or compares a column with a value of another type."""
    if not text:
        return None
    try:
        return parse_filter(text, schema)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


class Shell:
    """The interactive SQL shell: statements end with `;` (a statement unfinished at end of input
    runs too); backslash commands take a line of their own, `\\q` quits without running an
    unfinished statement. On a terminal, Ctrl-C cancels the running statement, or drops the
    statement being typed, and returns to the prompt; Ctrl-D (end of input) or `\\q` quits. Without a
    terminal (a script on stdin) Ctrl-C ends the shell with exit code 130. The exit code is 6 when
    any statement or command failed. With `--json`, stdout holds JSON lines: one document per
    statement (its rows, or `{"error": {...}}`) and per `\\d` (the table names); other messages go
    to stderr."""

    HELP = (
        "statements end with ';' and may span lines\n"
        "\\d          list tables\n\\d NAME     describe a table\n"
        "\\timing     toggle query timing\n\\q          quit"
    )

    def __init__(self, ctx: Any, args: argparse.Namespace) -> None:
        self.ctx, self.args = ctx, args
        self.interactive = sys.stdin.isatty()
        self.timing = False
        self.failed = False

    def run(self) -> int:
        if self.interactive:
            import readline  # noqa: F401 - line editing and history for input()

            # Ctrl-C drops the statement being typed or cancels the one running, also when the shell
            # was started with SIGINT ignored (a child of a background job inherits that).
            signal.signal(signal.SIGINT, signal.default_int_handler)

            print(f"memwal SQL shell; tables: {', '.join(self.tables())}. \\? for help, \\q to quit.")
        buffer: list[str] = []
        while True:
            try:
                line = self._read("memwal> " if not buffer else "   ...> ")
                if line is None:
                    break
                if line.strip().startswith("\\"):  # a command, also inside a statement (\q drops it)
                    if not self.command(line.strip()):
                        return self._exit()
                    continue
                buffer.append(line)
                if line.rstrip().endswith(";"):
                    self.execute("\n".join(buffer))
                    buffer = []
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                print("\ncancelled" if buffer else "", file=sys.stderr)
                buffer = []
        if "".join(buffer).strip():
            self.execute("\n".join(buffer))
        return self._exit()

    def _exit(self) -> int:
        return c.Exit.SQL if self.failed else c.Exit.OK

    def _read(self, prompt: str) -> str | None:
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                print()
                return None
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    def tables(self) -> list[str]:
        return list(table_specs(self.args.table))

    def command(self, cmd: str) -> bool:
        """Run a backslash command; False to quit."""
        word, _, arg = cmd.partition(" ")
        if word in ("\\q", "\\quit"):
            return False
        if word == "\\d" and not arg:
            print(json.dumps(self.tables()) if self.args.json else "\n".join(self.tables()))
        elif word == "\\d" and arg.strip() in self.tables():
            self.execute(
                "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
                f"WHERE table_name = '{arg.strip()}' ORDER BY ordinal_position"
            )
        elif word == "\\timing":
            self.timing = not self.timing
            self._note(f"timing {'on' if self.timing else 'off'}")
        elif word in ("\\?", "\\h", "\\help"):
            self._note(self.HELP)
        else:
            self._fail(c.SqlError(f"unknown command or table: {cmd}; \\? for help"))
        return True

    def execute(self, sql: str) -> None:
        sql = sql.strip().rstrip(";").strip()
        if not sql:
            return
        t0 = time.perf_counter()
        try:
            result = run_query(self.ctx, sql)
        except c.SqlError as e:
            self._fail(e)
            return
        print_result(self.args, result)
        if self.timing:
            self._note(f"time: {(time.perf_counter() - t0) * 1e3:.1f} ms")

    def _note(self, text: str) -> None:
        """A message that is no result: on stdout, or on stderr with `--json`."""
        print(text, file=sys.stderr if self.args.json else sys.stdout)

    def _fail(self, e: c.SqlError) -> None:
        """A failed statement or command: `error: ...` on stderr, or its JSON document on stdout."""
        if self.args.json:
            print(json.dumps(c.error_document(e)), flush=True)
        else:
            print(f"error: {e}", file=sys.stderr)
        self.failed = True
