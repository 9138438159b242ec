"""Lance SQL filters from pushed pyarrow filters: `to_lance_filter` and `split_for_lance`.

A filter pushed by DataFusion (a pyarrow Expression, read as a `memwal_df.read.expr.expression_tree`
tree) is compiled to Lance SQL text that keeps exactly the rows pyarrow's own filtering keeps, NULL
results included. What does not compile exactly is left to pyarrow (`split_for_lance`).
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.read.expr.expression_tree import (
    SWAPPED_COMPARISON,
    Call,
    Field,
    Literal,
    Node,
    NullMatching,
    decode,
    value_set,
)
from memwal_df.read.expr.predicate import conjuncts

__all__ = ["split_for_lance", "to_lance_filter"]


class _Unsupported(Exception):
    pass


_UNITS = {"s": "Second", "ms": "Millisecond", "us": "Microsecond", "ns": "Nanosecond"}
_NULL_BOOL = "CAST(NULL AS BOOLEAN)"
_SQL_OP = {
    "equal": "=",
    "not_equal": "<>",
    "less": "<",
    "less_equal": "<=",
    "greater": ">",
    "greater_equal": ">=",
}


def _family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return "binary"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp-tz" if t.tz else "timestamp"
    if pa.types.is_time(t):
        return "time"
    if pa.types.is_duration(t):
        return "duration"
    if pa.types.is_decimal(t):
        return "decimal"
    return f"other:{t}"


def _int_of(scalar: pa.Scalar) -> int:
    """The integer storage value of a temporal scalar."""
    width = scalar.type.bit_width
    return pa.array([scalar], scalar.type).view(pa.int32() if width == 32 else pa.int64())[0].as_py()


def _float_sql(v: float, t: pa.DataType) -> str:
    return f"CAST('{v!r}' AS {'FLOAT' if pa.types.is_float32(t) else 'DOUBLE'})"


def _literal_sql(scalar: pa.Scalar) -> str:
    """A Lance (DataFusion) SQL literal equal to a valid scalar."""
    t = scalar.type
    if pa.types.is_boolean(t):
        return "TRUE" if scalar.as_py() else "FALSE"
    if pa.types.is_integer(t):
        v = scalar.as_py()
        if -(1 << 63) < v < (1 << 63):
            return str(v) if v >= 0 else f"({v})"
        return f"arrow_cast('{v}', '{'UInt64' if v > 0 else 'Int64'}')"
    if pa.types.is_float32(t) or pa.types.is_float64(t):
        return _float_sql(scalar.as_py(), t)
    if _family(t) == "string":
        return "'" + scalar.as_py().replace("'", "''") + "'"
    if _family(t) == "binary":
        return f"X'{scalar.as_py().hex()}'"
    if pa.types.is_decimal128(t):
        return f"arrow_cast('{scalar.as_py():f}', 'Decimal128({t.precision}, {t.scale})')"
    if pa.types.is_date32(t):
        return f"arrow_cast({_int_of(scalar)}, 'Date32')"
    if pa.types.is_date64(t):
        return f"arrow_cast({_int_of(scalar)}, 'Date64')"
    if pa.types.is_timestamp(t):
        if t.tz is not None and ('"' in t.tz or "'" in t.tz):
            raise _Unsupported
        tz = f'Some("{t.tz}")' if t.tz is not None else "None"
        return f"arrow_cast({_int_of(scalar)}, 'Timestamp({_UNITS[t.unit]}, {tz})')"
    if pa.types.is_time32(t) or pa.types.is_time64(t):
        return f"arrow_cast({_int_of(scalar)}, 'Time{t.bit_width}({_UNITS[t.unit]})')"
    if pa.types.is_duration(t):
        return f"arrow_cast({_int_of(scalar)}, 'Duration({_UNITS[t.unit]})')"
    raise _Unsupported


class _LanceSql:
    """Boolean nodes to Lance SQL with pyarrow's semantics, NULL results included.

    Lance evaluates with DataFusion: float comparisons use the IEEE total order (NaN equals NaN and
    sorts above +inf, or below -inf when negative) and ``IN`` follows SQL NULL rules. Both are
    rewritten so that every SQL piece is NULL exactly where pyarrow's result is NULL.
    """

    def __init__(self, schema: pa.Schema | None) -> None:
        self.schema = schema

    def ident(self, f: Field) -> str:
        names = [f.name, *f.path]
        if any("`" in n for n in names):
            raise _Unsupported
        return ".".join(f"`{n}`" for n in names)

    def field_type(self, f: Field) -> pa.DataType | None:
        if self.schema is None:
            return None
        if self.schema.get_field_index(f.name) < 0:
            raise _Unsupported
        t = self.schema.field(f.name).type
        for name in f.path:
            if not pa.types.is_struct(t) or t.get_field_index(name) < 0:
                raise _Unsupported
            t = t.field(name).type
        return t

    def boolean(self, node: Node) -> str:
        if isinstance(node, Literal):
            if pa.types.is_null(node.type) or (pa.types.is_boolean(node.type) and node.value is None):
                return _NULL_BOOL
            if pa.types.is_boolean(node.type):
                return "TRUE" if node.value else "FALSE"
            raise _Unsupported
        if isinstance(node, Field):
            t = self.field_type(node)
            if t is not None and not pa.types.is_boolean(t):
                raise _Unsupported
            return self.ident(node)
        fn, args = node.function, node.args
        if fn in ("and_kleene", "or_kleene") and len(args) == 2:
            op = " AND " if fn == "and_kleene" else " OR "
            return "(" + op.join(self.boolean(a) for a in args) + ")"
        if fn == "invert" and len(args) == 1:
            return f"(NOT {self.boolean(args[0])})"
        if fn == "is_valid" and len(args) == 1:
            return f"({self.value(args[0])[0]} IS NOT NULL)"
        if fn == "is_null" and len(args) == 1:
            sql, t = self.value(args[0])
            if not node.options.get("nan_is_null", False) or (t is not None and not pa.types.is_floating(t)):
                return f"({sql} IS NULL)"
            if t is not None:
                return f"({sql} IS NULL OR isnan({sql}))"
            raise _Unsupported
        if fn == "is_nan" and len(args) == 1:
            sql, t = self.value(args[0])
            if t is None or not pa.types.is_floating(t):
                raise _Unsupported
            return f"isnan({sql})"
        if fn in _SQL_OP and len(args) == 2:
            return self.compare(fn, args[0], args[1])
        if fn == "is_in" and len(args) == 1:
            return self.is_in(node)
        raise _Unsupported

    def value(self, node: Node) -> tuple[str, pa.DataType | None]:
        """SQL for a column-like operand and its type (None: unknown)."""
        if isinstance(node, Field):
            return self.ident(node), self.field_type(node)
        if isinstance(node, Call):
            return self.boolean(node), pa.bool_()
        raise _Unsupported

    def compare(self, fn: str, a: Node, b: Node) -> str:
        if isinstance(a, Literal) and not isinstance(b, Literal):
            fn, a, b = SWAPPED_COMPARISON[fn], b, a
        if isinstance(a, Literal):
            raise _Unsupported
        col, col_type = self.value(a)
        if isinstance(b, Literal):
            if b.is_null:
                return _NULL_BOOL
            scalar = b.to_scalar()
            if col_type is not None and _family(col_type) != _family(scalar.type):
                raise _Unsupported
            t = col_type if col_type is not None else scalar.type
            if pa.types.is_floating(t):
                if not (pa.types.is_float32(scalar.type) or pa.types.is_float64(scalar.type)):
                    raise _Unsupported
                return self._float_compare(fn, col, scalar.as_py(), scalar.type)
            return f"({col} {_SQL_OP[fn]} {_literal_sql(scalar)})"
        other, other_type = self.value(b)
        if col_type is None or other_type is None or _family(col_type) != _family(other_type):
            raise _Unsupported
        if pa.types.is_floating(col_type) or _family(col_type).startswith("other"):
            raise _Unsupported
        return f"({col} {_SQL_OP[fn]} {other})"

    @staticmethod
    def _float_compare(fn: str, col: str, v: float, t: pa.DataType) -> str:
        if math.isnan(v):
            # IEEE: NaN compares false (not_equal: true) with everything; NULL stays NULL
            if fn == "not_equal":
                return f"({col} IS NOT NULL OR {_NULL_BOOL})"
            return f"({col} IS NULL AND {_NULL_BOOL})"
        not_nan = f"NOT isnan({col})"
        if v == 0.0:
            pos, neg = _float_sql(0.0, t), _float_sql(-0.0, t)
            return {
                "equal": f"({col} = {pos} OR {col} = {neg})",
                "not_equal": f"({col} <> {pos} AND {col} <> {neg})",
                "less": f"({col} < {neg} AND {not_nan})",
                "less_equal": f"({col} <= {pos} AND {not_nan})",
                "greater": f"({col} > {pos} AND {not_nan})",
                "greater_equal": f"({col} >= {neg} AND {not_nan})",
            }[fn]
        lit = _float_sql(v, t)
        if fn in ("equal", "not_equal"):
            return f"({col} {_SQL_OP[fn]} {lit})"
        return f"({col} {_SQL_OP[fn]} {lit} AND {not_nan})"

    def is_in(self, node: Call) -> str:
        in_set = value_set(node)
        if in_set is None:
            raise _Unsupported
        col, col_type = self.value(node.args[0])
        values_array = node.options["value_set"]
        if col_type is not None and _family(col_type) != _family(values_array.type):
            raise _Unsupported
        t = col_type if col_type is not None else values_array.type
        values, has_null, behavior = in_set
        if pa.types.is_floating(t) and any(v != v or v == 0.0 for v in values):
            raise _Unsupported  # pyarrow matches NaN / -0.0 / 0.0 bitwise, Lance does not
        if pa.types.is_floating(t) and not pa.types.is_floating(values_array.type):
            raise _Unsupported
        items = [s for s in values_array if s.is_valid]
        if items:
            member = f"({col} IN ({', '.join(_literal_sql(s) for s in items)}))"
        else:
            member = f"({col} IS NULL AND {_NULL_BOOL})"
        if behavior == NullMatching.MATCH:
            return f"({col} IS NULL OR {member})" if has_null else f"({col} IS NOT NULL AND {member})"
        if behavior == NullMatching.SKIP:
            return f"({col} IS NOT NULL AND {member})"
        if behavior == NullMatching.EMIT_NULL:
            return member
        if behavior == NullMatching.INCONCLUSIVE:
            return f"({member} OR {_NULL_BOOL})" if has_null else member
        raise _Unsupported


def to_lance_filter(expr: pc.Expression | None, schema: pa.Schema | None = None) -> str | None:
    """A Lance SQL filter keeping exactly the rows pyarrow's own filtering of `expr` keeps, or None.

    Always a SQL string, never the Expression itself: pylance accepts a pc.Expression but converts it
    through pyarrow's Substrait serializer and DataFusion, which (a) fails for the whole filter when
    the dataset has a column Substrait cannot type (duration, decimal256, ...) and for filters on
    unsigned, large_string, large_binary, date64, timestamp[ns], time and dictionary columns, (b)
    has no ``and``/``or`` (non-Kleene), and (c) gives other answers for floats (IEEE total order: NaN
    == NaN, NaN > inf) and for NULLs in ``is_in``. The SQL here rewrites those cases exactly.

    `schema` (the table's Arrow schema) gives column types; without it, each compared column is
    assumed to have its literal's type (true of everything DataFusion pushes) and column-to-column
    comparisons are not converted. None means "not convertible" (e.g. non-Kleene and/or, other
    functions, float IN-lists holding NaN or zero, decimal256): filter with pyarrow instead, or
    convert `conjuncts(expr)` one by one and apply the rest afterwards.
    """
    if expr is None:
        return None
    try:
        return _LanceSql(schema).boolean(decode(expr))
    except (_Unsupported, ValueError, KeyError):
        return None


def split_for_lance(
    expr: pc.Expression | None, schema: pa.Schema | None = None
) -> tuple[str | None, pc.Expression | None]:
    """(Lance SQL filter, residual pyarrow filter) that together keep exactly the rows `expr` keeps.

    The whole filter goes to Lance when it converts; otherwise each top-level conjunct that converts
    does, and the rest is left for pyarrow to apply to the scanned rows."""
    if expr is None:
        return None, None
    whole = to_lance_filter(expr, schema)
    if isinstance(whole, str):
        return whole, None
    pushed: list[str] = []
    rest: list[pc.Expression] = []
    for part in conjuncts(expr):
        sql = to_lance_filter(part, schema)
        if isinstance(sql, str):
            pushed.append(f"({sql})")
        else:
            rest.append(part)
    residual = None
    for part in rest:
        residual = part if residual is None else residual & part
    return (" AND ".join(pushed) or None), residual
