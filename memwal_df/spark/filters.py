"""Spark's pushed filters as a pyarrow expression with the same meaning, or left to Spark.

Only filters whose meaning is identical in Spark and Arrow are taken: comparisons, IN, IS [NOT]
NULL and NOT over one top-level column of an integer, string, boolean or date type, with a literal
that converts exactly to the column's type. (Floats are left to Spark: Spark orders NaN above every
number and NaN = NaN, Arrow does neither; timestamps are left to Spark's session time zone.)
Both sides use SQL's three-valued logic, and a row is kept only when the filter is true.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
    Not,
)

_COMPARISONS: dict[type[Filter], Callable[[Any, Any], pc.Expression]] = {
    EqualTo: operator.eq,
    GreaterThan: operator.gt,
    GreaterThanOrEqual: operator.ge,
    LessThan: operator.lt,
    LessThanOrEqual: operator.le,
}


def _pushable_type(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
    )


def _column(f: Filter, schema: pa.Schema) -> tuple[pc.Expression, pa.DataType] | None:
    attribute = getattr(f, "attribute", None)
    if attribute is None or len(attribute) != 1 or attribute[0] not in schema.names:
        return None
    t = schema.field(attribute[0]).type
    return (pc.field(attribute[0]), t) if _pushable_type(t) else None


def _literal(value: Any, t: pa.DataType) -> pa.Scalar | None:
    """`value` as a scalar of `t` when it converts exactly (no NULL, no overflow, same type family)."""
    if value is None or isinstance(value, float):
        return None
    if pa.types.is_boolean(t) != isinstance(value, bool):
        return None
    try:
        return pa.scalar(value, type=t)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None


def to_expression(f: Filter, schema: pa.Schema) -> pc.Expression | None:
    """The pyarrow expression equal to `f` over a table of `schema`, or None (Spark applies it)."""
    if isinstance(f, Not):
        child = to_expression(f.child, schema)
        return None if child is None else ~child
    column = _column(f, schema)
    if column is None:
        return None
    field, t = column
    if isinstance(f, IsNull):
        return field.is_null()
    if isinstance(f, IsNotNull):
        return field.is_valid()
    if isinstance(f, In):
        literals = [_literal(v, t) for v in f.value]
        scalars = [s for s in literals if s is not None]
        if not scalars or len(scalars) < len(literals):
            return None
        return field.isin(pa.array([s.as_py() for s in scalars], type=t))
    compare = _COMPARISONS.get(type(f))
    if compare is None:
        return None
    literal = _literal(f.value, t)  # type: ignore[attr-defined]
    return None if literal is None else compare(field, literal)


def conjunction(expressions: list[pc.Expression]) -> pc.Expression | None:
    """The AND of `expressions` (None for none)."""
    return reduce(operator.and_, expressions) if expressions else None
