"""SQL region expressions (spec "Region Expression"): a DataFusion SQL expression over ``col0``,
``col1``, ... as a region transform.

Owns the `Expression` transform, its compiled form (a DataFusion plan with type-exact murmur3 UDFs),
the SQL text helpers that check and rewrite it, and the one thread that runs every DataFusion call of
region expressions. Integer expressions skip DataFusion: `intexpr` evaluates them with pyarrow.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

from memwal_df.errors import InvalidRegionSpecError, RegionRoutingError
from memwal_df.format.murmur3 import murmur3_32_spark, murmur3_multi
from memwal_df.format.regions.intexpr import Evaluator, as_array, compile_int_expression
from memwal_df.format.regions.transforms import Transform
from memwal_df.pools import shared_pool

__all__ = ["CompiledExpression", "Expression"]

_VOLATILE = re.compile(
    r"\b(random|uuid|now|current_date|current_time|current_timestamp|localtime|localtimestamp)\b",
    re.IGNORECASE,
)
_HASH_FUNCS = ("murmur3", "murmur3_multi")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _skip_quoted(sql: str, i: int) -> int:
    """Index after the quoted literal or identifier starting at ``sql[i]``."""
    q = sql[i]
    i += 1
    while i < len(sql):
        if sql[i] == q:
            if i + 1 < len(sql) and sql[i + 1] == q:  # doubled quote
                i += 2
                continue
            return i + 1
        i += 1
    raise InvalidRegionSpecError(f"unterminated quote in region expression: {sql!r}")


def _close_paren(sql: str, i: int) -> int:
    """Index of the ')' matching the '(' at ``sql[i]``."""
    depth = 0
    while i < len(sql):
        c = sql[i]
        if c in "'\"":
            i = _skip_quoted(sql, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InvalidRegionSpecError(f"unbalanced parentheses in region expression: {sql!r}")


def _split_args(text: str) -> list[str]:
    """Split a call's argument text at top-level commas."""
    args, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in "'\"":
            i = _skip_quoted(text, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    args.append(text[start:].strip())
    return [] if args == [""] else args


def _unquoted(sql: str) -> str:
    """`sql` with quoted literals and identifiers blanked out."""
    out, i = [], 0
    while i < len(sql):
        if sql[i] in "'\"":
            j = _skip_quoted(sql, i)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(sql[i])
            i += 1
    return "".join(out)


_EXPRESSION_THREAD = "region-expressions"


def _on_expression_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run on the one thread that does every DataFusion call of region expressions.

    A DataFusion call blocks on DataFusion's runtime, which panics on a thread that is already
    driving it: a scan or table-function callback of a SQL query that prunes regions. The dedicated
    thread never drives that runtime, so region expressions evaluate the same way (and give the
    same region values) inside and outside a query.
    """
    if threading.current_thread().name.startswith(f"memwal-{_EXPRESSION_THREAD}"):
        return fn(*args)
    return shared_pool(_EXPRESSION_THREAD, 1).submit(fn, *args).result()


class CompiledExpression:
    """A region expression planned for one input schema, with type-exact murmur3 UDFs.

    DataFusion Python UDFs have one exact signature and DataFusion silently widens arguments to
    it (an int32 column reaches an int64 UDF as int64, changing its hash). So each
    ``murmur3(...)`` / ``murmur3_multi(...)`` call is rewritten to a UDF registered for the exact
    types of its arguments. Build and evaluate it through `_on_expression_thread`.
    """

    def __init__(self, sql: str, schema: pa.Schema) -> None:
        from datafusion import SessionConfig, SessionContext

        # one partition: the plan runs inline in the calling thread, with no task of its own to
        # schedule on DataFusion's runtime
        self.ctx = SessionContext(SessionConfig().with_target_partitions(1))
        self.schema = schema
        self._udfs: dict[tuple[str, tuple[pa.DataType, ...]], str] = {}
        self._empty = pa.RecordBatch.from_pylist([], schema=schema)
        self.sql = self._rewrite(sql)
        self.out_type = self._type_of(self.sql)

    def _frame(self, batch: pa.RecordBatch) -> Any:
        return self.ctx.create_dataframe([[batch]], schema=self.schema)

    def _type_of(self, sql: str) -> pa.DataType:
        return self._frame(self._empty).select_exprs(f"{sql} AS __v").schema().field(0).type

    def _rewrite(self, sql: str) -> str:
        out, i, pos = [], 0, 0
        while i < len(sql):
            c = sql[i]
            if c in "'\"":
                i = _skip_quoted(sql, i)
                continue
            m = _IDENT.match(sql, i) if (c.isalpha() or c == "_") else None
            if m is None:
                i += 1
                continue
            name, j = m.group(0).lower(), m.end()
            while j < len(sql) and sql[j].isspace():
                j += 1
            prev = sql[i - 1] if i else ""
            if name not in _HASH_FUNCS or j >= len(sql) or sql[j] != "(" or prev == ".":
                i = m.end()
                continue
            close = _close_paren(sql, j)
            args = [self._rewrite(a) for a in _split_args(sql[j + 1 : close])]
            if not args or (name == "murmur3" and len(args) != 1):
                need = "one argument" if name == "murmur3" else "arguments"
                raise InvalidRegionSpecError(f"{name} takes {need}")
            udf_name = self._udf(name, tuple(self._type_of(a) for a in args))
            out.append(sql[pos:i])
            out.append(f"{udf_name}({', '.join(args)})")
            i = pos = close + 1
        out.append(sql[pos:])
        return "".join(out)

    def _udf(self, name: str, types: tuple[pa.DataType, ...]) -> str:
        from datafusion import udf

        key = (name, types)
        if key not in self._udfs:
            udf_name = f"__memwal_{name}_{len(self._udfs)}"
            if name == "murmur3":
                fn: Callable[..., pa.Array] = murmur3_32_spark
            else:

                def fn(*arrays: pa.Array) -> pa.Array:
                    return murmur3_multi(arrays)

            self.ctx.register_udf(udf(fn, list(types), pa.int32(), "immutable", udf_name))
            self._udfs[key] = udf_name
        return self._udfs[key]

    def evaluate(self, batch: pa.RecordBatch) -> pa.Array:
        try:
            out = self._frame(batch).select_exprs(f"{self.sql} AS __v").to_arrow_table().column(0)
        except Exception as e:  # DataFusion raises plain Exception
            raise RegionRoutingError(f"region expression failed: {e}") from e
        arr = out.combine_chunks() if out.num_chunks != 1 else out.chunk(0)
        if len(arr) != batch.num_rows:
            raise RegionRoutingError("region expression changed the number of rows")
        return arr


@dataclass(frozen=True)
class Expression(Transform):
    """A DataFusion SQL expression over ``col0``, ``col1``, ... (spec "Region Expression").

    ``murmur3(x)`` and ``murmur3_multi(x, y, ...)`` are available and hash exactly like the bucket
    transforms (NULL in, NULL out). Volatile functions (now(), random(), ...) are rejected. Integer
    arithmetic and hashes (`memwal_df.format.regions.intexpr`) are evaluated with pyarrow, the rest
    by DataFusion on its own thread: both give DataFusion's values, inside a query's callbacks as
    outside.
    """

    sql: str
    name: ClassVar[str] = "expression"
    arity: ClassVar[int | None] = None
    _cache: dict[tuple[pa.DataType, ...], CompiledExpression] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _fast: dict[tuple[pa.DataType, ...], Evaluator | None] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sql, str) or not self.sql.strip():
            raise InvalidRegionSpecError("a region expression needs SQL text")
        m = _VOLATILE.search(_unquoted(self.sql))
        if m:
            raise InvalidRegionSpecError(f"region expressions must be deterministic; {m.group(1)}() is not")

    def compile(self, source_types: Sequence[pa.DataType]) -> CompiledExpression:
        """The expression planned for these source types (cached); InvalidRegionSpecError if it fails."""
        key = tuple(source_types)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                schema = pa.schema([(f"col{i}", t) for i, t in enumerate(key)])
                try:
                    hit = _on_expression_thread(CompiledExpression, self.sql, schema)
                except InvalidRegionSpecError:
                    raise
                except Exception as e:  # DataFusion reports planning errors as plain Exception
                    raise InvalidRegionSpecError(f"bad region expression {self.sql!r}: {e}") from e
                self._cache[key] = hit
            return hit

    def can_transform(self, source_types: Sequence[pa.DataType]) -> bool:
        try:
            self.compile(source_types)
        except InvalidRegionSpecError:
            return False
        return True

    def result_type(self, source_types: Sequence[pa.DataType]) -> pa.DataType:
        return self.compile(source_types).out_type

    def vectorized(self, source_types: Sequence[pa.DataType]) -> Evaluator | None:
        """The expression compiled to pyarrow for these source types (cached), None when it is
        outside `memwal_df.format.regions.intexpr`'s subset and DataFusion evaluates it."""
        key = tuple(source_types)
        with self._lock:
            if key not in self._fast:
                self._fast[key] = compile_int_expression(self.sql, key)
            return self._fast[key]

    def apply(self, arrays: Sequence[pa.Array], num_rows: int | None = None) -> pa.Array:
        cols = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
        fast = self.vectorized([a.type for a in cols])
        if fast is not None:
            n = len(cols[0]) if cols else num_rows or 0
            return as_array(fast(cols, n), n)
        compiled = self.compile([a.type for a in cols])
        batch = pa.RecordBatch.from_arrays(cols, schema=compiled.schema)
        return _on_expression_thread(compiled.evaluate, batch)

    def __str__(self) -> str:
        return f"expression[{self.sql}]"
