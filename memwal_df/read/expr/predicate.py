"""What the read path asks of a pushed filter: its top-level conjuncts, the columns it reads, whether
it is a condition on a table's rows, the primary-key point set it pins, and per-column region-pruning
predicates.

The filter is a pyarrow Expression as DataFusion pushes it (or as `memwal_df.read.expr.sql_text` parses
SQL text), read through its `memwal_df.read.expr.expression_tree` tree; every answer follows pyarrow's
semantics (see there). Compiling a filter to Lance SQL is `memwal_df.read.expr.lance_filter`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from memwal_df.errors import InvalidFilterError
from memwal_df.format.regions.predicates import Eq, In, Predicate, Range
from memwal_df.read.expr.expression_tree import (
    SWAPPED_COMPARISON,
    Call,
    Field,
    Literal,
    Node,
    NullMatching,
    decode,
    to_expression,
    tree_of,
    value_set,
)

__all__ = [
    "MAX_KEY_LOOKUPS",
    "check_filter",
    "column_predicates",
    "conjuncts",
    "key_lookups",
    "referenced_columns",
]

MAX_KEY_LOOKUPS = 1 << 20  # key_lookups gives up (None) past this many key tuples

_AND = frozenset({"and_kleene", "and"})
_OR = frozenset({"or_kleene", "or"})


# ----------------------------------------------------------------------------------------------
# Conjuncts and columns


def _split_and(node: Node) -> list[Node]:
    if isinstance(node, Call) and node.function in _AND and len(node.args) == 2:
        return _split_and(node.args[0]) + _split_and(node.args[1])
    return [node]


def conjuncts(expr: pc.Expression | None) -> list[pc.Expression]:
    """The top-level AND (``and_kleene`` / ``and``) operands of `expr`, flattened; ``[expr]`` when it
    is not an AND (or does not decode), ``[]`` for None. Filtering by all of them keeps exactly the
    rows `expr` keeps."""
    if expr is None:
        return []
    try:
        parts = _split_and(decode(expr))
    except ValueError:
        return [expr]
    if len(parts) == 1:
        return [expr]
    return [to_expression(p) for p in parts]


def _walk(node: Node) -> Iterable[Node]:
    yield node
    if isinstance(node, Call):
        for a in node.args:
            yield from _walk(a)


def referenced_columns(expr: pc.Expression | Node | None) -> set[str]:
    """The top-level column names `expr` (an Expression or its tree) reads (a nested ref counts as
    its top-level column).

    ValueError when `expr` does not decode.
    """
    if expr is None:
        return set()
    return {n.name for n in _walk(tree_of(expr)) if isinstance(n, Field)}


def _field_literal(call: Call) -> tuple[str, Field, Literal] | None:
    """``(function, field, literal)`` for a comparison of a column with a literal, column first."""
    if call.function not in SWAPPED_COMPARISON or len(call.args) != 2:
        return None
    a, b = call.args
    if isinstance(a, Field) and isinstance(b, Literal):
        return call.function, a, b
    if isinstance(a, Literal) and isinstance(b, Field):
        return SWAPPED_COMPARISON[call.function], b, a
    return None


_BIND_ERRORS = (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError)


@functools.lru_cache(maxsize=64)
def _empty_dataset(schema: pa.Schema) -> pds.Dataset:
    return pds.dataset(schema.empty_table())


def _binds(expr: pc.Expression, schema: pa.Schema) -> BaseException | None:
    """Why `expr` is not a condition on rows of `schema` (Arrow's error), or None. Bound as the
    projection of a scan of an empty dataset, which resolves columns, kernels and the result type
    without running anything (an order of magnitude cheaper than filtering an empty table)."""
    try:
        scanner = _empty_dataset(schema).scanner(columns={"condition": expr})
    except _BIND_ERRORS as e:
        return e
    result = scanner.projected_schema.field(0).type
    if result != pa.bool_():
        return pa.ArrowTypeError(f"Filter expression must evaluate to bool, but {expr} evaluates to {result}")
    return None


def check_filter(expr: pc.Expression | None, schema: pa.Schema, text: str | None = None) -> None:
    """Return when `expr` is a condition on rows of `schema`; else raise `InvalidFilterError` naming
    the column the table lacks, or the column and the value of another type it is compared with.
    `text`: the filter as the user wrote it (shown instead of the expression)."""
    if expr is None or (error := _binds(expr, schema)) is None:
        return
    shown = repr(text) if text is not None else str(expr)
    try:
        nodes = list(_walk(decode(expr)))
    except ValueError:  # an expression the decoder does not know: Arrow's message only
        nodes = []
    unknown = sorted({n.name for n in nodes if isinstance(n, Field)} - set(schema.names))
    if unknown:
        raise InvalidFilterError(
            f"filter {shown} names column {', '.join(map(repr, unknown))}, which the table does not "
            f"have (columns: {', '.join(schema.names)})"
        )
    for node in nodes:
        if not isinstance(node, Call):
            continue
        found = _field_literal(node)
        column, value = (found[1], found[2].value) if found else (None, None)
        if found is None and (in_set := value_set(node)) is not None and isinstance(node.args[0], Field):
            column, value = node.args[0], in_set.values
        if column is not None and _binds(to_expression(node), schema) is not None:
            column_type = schema.field(column.name).type
            raise InvalidFilterError(
                f"filter {shown} compares column {column.name!r} ({column_type}) with {value!r}, which "
                f"is not of the column's type: compare it with a value of type {column_type}"
            )
    raise InvalidFilterError(f"filter {shown} is not a condition on the table's rows: {error}")


# ----------------------------------------------------------------------------------------------
# Primary-key point lookups


def _float_doubt(v: Any) -> bool:
    """Float keys that compare in surprising ways (NaN never equal, -0.0 == 0.0)."""
    return isinstance(v, float) and (math.isnan(v) or v == 0.0)


def _keys(node: Node, pk: frozenset[str]) -> list[dict[str, Any]] | None:
    """Partial key assignments, one per disjunct, covering every matching row; None: unconstrained."""
    if isinstance(node, Literal):
        if pa.types.is_boolean(node.type) or pa.types.is_null(node.type):
            return None if node.value is True else []
        return None
    if not isinstance(node, Call):
        return None
    if node.function in _AND and len(node.args) == 2:
        left, right = (_keys(a, pk) for a in node.args)
        if left is None or right is None:
            return right if left is None else left
        out: list[dict[str, Any]] = []
        for p in left:
            for q in right:
                if all(p[c] == q[c] for c in p.keys() & q.keys()):
                    out.append({**p, **q})
                    if len(out) > MAX_KEY_LOOKUPS:
                        raise _TooMany
        return out
    if node.function in _OR and len(node.args) == 2:
        left, right = (_keys(a, pk) for a in node.args)
        if left is None or right is None:
            return None
        if len(left) + len(right) > MAX_KEY_LOOKUPS:
            raise _TooMany
        return left + right
    if node.function == "equal":
        fl = _field_literal(node)
        if fl is None:
            return None
        lit = fl[2]
        if lit.is_null:
            return []  # NULL == anything is NULL
        if fl[1].path or fl[1].name not in pk or isinstance(lit.value, pa.Scalar) or _float_doubt(lit.value):
            return None
        return [{fl[1].name: lit.value}]
    if node.function == "is_in":
        arg = node.args[0] if node.args else None
        sv = value_set(node)
        if sv is None or not isinstance(arg, Field):
            return None
        values, has_null, behavior = sv
        if arg.path or arg.name not in pk:
            return [] if not values and not (has_null and behavior == NullMatching.MATCH) else None
        if any(_float_doubt(v) for v in values):  # key columns are non-NULL: NULLs never match
            return None
        return [{arg.name: v} for v in values]
    return None


class _TooMany(Exception):
    pass


def key_lookups(
    expr: pc.Expression | Node | None, primary_key: Sequence[str]
) -> list[tuple[Any, ...]] | None:
    """The finite set of primary-key tuples (in `primary_key` order, deduplicated) that rows matching
    `expr` (an Expression, or its `decode`d tree) can have, or None when the filter does not pin the
    key down.

    Understands ``pk == x`` / ``x == pk``, ``is_in(pk, ...)`` (NULLs dropped: key columns are
    non-NULL), AND (intersection, so a composite key may be pinned by equalities and IN lists on its
    columns) and OR (union). Other predicates under an AND only shrink the result further: the caller
    still applies the whole filter. Returns None on any doubt (a float key that is NaN or zero, more
    than MAX_KEY_LOOKUPS tuples, an unserializable expression).
    """
    if expr is None:
        return None
    pk = list(primary_key)
    if not pk or len(set(pk)) != len(pk):
        raise ValueError(f"bad primary key {primary_key!r}")
    try:
        parts = _keys(tree_of(expr), frozenset(pk))
    except (ValueError, _TooMany):
        return None
    if parts is None or any(len(p) != len(pk) for p in parts):
        return None
    try:
        return list(dict.fromkeys(tuple(p[c] for c in pk) for p in parts))
    except TypeError:
        return None


# ----------------------------------------------------------------------------------------------
# Per-column pruning predicates


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


class _Nothing:
    """Marker: the node matches no row."""


_NOTHING = _Nothing()
_Facts = dict[str, list[Predicate]]


def _facts(node: Node) -> _Facts | _Nothing:
    """Predicates per column that every row matching `node` satisfies (or _NOTHING)."""
    if isinstance(node, Literal):
        if pa.types.is_boolean(node.type) or pa.types.is_null(node.type):
            return {} if node.value is True else _NOTHING
        return {}
    if isinstance(node, Field):
        return {node.name: [Eq(True)]} if not node.path else {}
    if node.function in _AND and len(node.args) == 2:
        left, right = (_facts(a) for a in node.args)
        if isinstance(left, _Nothing) or isinstance(right, _Nothing):
            return _NOTHING
        merged = {c: list(ps) for c, ps in left.items()}
        for c, ps in right.items():
            merged.setdefault(c, []).extend(ps)
        return merged
    if node.function in _OR and len(node.args) == 2:
        left, right = (_facts(a) for a in node.args)
        if isinstance(left, _Nothing) or isinstance(right, _Nothing):
            return right if isinstance(left, _Nothing) else left
        out = {}
        for c in left.keys() & right.keys():
            hull = _hull(_summary(left[c]), _summary(right[c]))
            if hull is not None:
                out[c] = [hull]
        return out
    if node.function == "invert" and len(node.args) == 1:
        arg = node.args[0]
        return {arg.name: [Eq(False)]} if isinstance(arg, Field) and not arg.path else {}
    if node.function == "is_in":
        operand = node.args[0] if node.args else None
        sv = value_set(node)
        if sv is None or not isinstance(operand, Field) or operand.path:
            return {}
        values, has_null, behavior = sv
        if has_null and behavior == NullMatching.MATCH:
            return {}  # NULL rows match too
        if not values:
            return _NOTHING
        return {operand.name: [_point_predicate(values)]}
    fl = _field_literal(node)
    if fl is None or fl[1].path:
        return {}
    fn, col, lit = fl
    v = lit.value
    if isinstance(v, pa.Scalar):
        return {}
    if lit.is_null or (fn != "not_equal" and _is_nan(v)):
        return _NOTHING  # NULL compares to NULL; NaN compares false
    comparisons: dict[str, Callable[[], Predicate]] = {
        "equal": lambda: Eq(v),
        "less": lambda: Range(hi=v, hi_inclusive=False),
        "less_equal": lambda: Range(hi=v, hi_inclusive=True),
        "greater": lambda: Range(lo=v, lo_inclusive=False),
        "greater_equal": lambda: Range(lo=v, lo_inclusive=True),
    }
    pred = comparisons.get(fn)
    return {col.name: [pred()]} if pred is not None else {}


def _point_predicate(values: Iterable[Any]) -> Predicate:
    """Eq for one distinct value, else In (duplicates dropped, NaN equal to NaN)."""
    distinct: list[Any] = []
    for x in values:
        if not any(_same(x, y) and type(x) is type(y) for y in distinct):
            distinct.append(x)
    return Eq(distinct[0]) if len(distinct) == 1 else In(distinct)


def _intersect(ranges: Sequence[Range]) -> Range | None:
    """The intersection of `ranges` (None when empty); TypeError if bounds do not compare."""
    lo, lo_inc, hi, hi_inc = None, True, None, True
    for r in ranges:
        if r.lo is not None:
            if lo is None or r.lo > lo:
                lo, lo_inc = r.lo, r.lo_inclusive
            elif r.lo == lo:
                lo_inc = lo_inc and r.lo_inclusive
        if r.hi is not None:
            if hi is None or r.hi < hi:
                hi, hi_inc = r.hi, r.hi_inclusive
            elif r.hi == hi:
                hi_inc = hi_inc and r.hi_inclusive
    if lo is not None and hi is not None and (lo > hi or (lo == hi and not (lo_inc and hi_inc))):
        return None
    return Range(lo, lo_inc, hi, hi_inc)


def _summary(preds: Sequence[Predicate]) -> list[Predicate]:
    """An equivalent-or-weaker, shorter AND-list: one point predicate, or one Range, or `preds`."""
    points: list[Any] | None = None
    for p in preds:
        if isinstance(p, Eq | In):
            vals = [p.value] if isinstance(p, Eq) else list(p.values)
            points = vals if points is None else [x for x in points if any(_same(x, y) for y in vals)]
    ranges = [p for p in preds if isinstance(p, Range)]
    if points is not None:
        return [_point_predicate([x for x in points if all(r.test(x) for r in ranges)])]
    if not ranges:
        return list(preds)
    try:
        if any(_is_nan(b) for r in ranges for b in (r.lo, r.hi)):
            return list(preds)
        merged = _intersect(ranges)
    except TypeError:
        return list(preds)
    return [In(())] if merged is None else [merged]


def _hull(a: list[Predicate], b: list[Predicate]) -> Predicate | None:
    """One predicate that holds wherever summary `a` or summary `b` holds, or None."""
    if len(a) != 1 or len(b) != 1:
        return None
    pa_, pb = a[0], b[0]
    pts = [_points(p) for p in (pa_, pb)]
    if pts[0] is not None and pts[1] is not None:
        return _point_predicate(pts[0] + pts[1])
    bounds = []
    for p, ps in zip((pa_, pb), pts, strict=True):
        if ps is not None:
            if not ps:
                continue
            if any(_is_nan(x) for x in ps):
                return None
            try:
                bounds.append(Range(min(ps), True, max(ps), True))
            except TypeError:
                return None
        elif isinstance(p, Range):
            if _is_nan(p.lo) or _is_nan(p.hi):
                return None
            bounds.append(p)
        else:
            return None
    if not bounds:
        return In(())
    try:
        lo, lo_inc, hi, hi_inc = bounds[0].lo, bounds[0].lo_inclusive, bounds[0].hi, bounds[0].hi_inclusive
        for r in bounds[1:]:
            if lo is not None and (r.lo is None or r.lo < lo):
                lo, lo_inc = r.lo, r.lo_inclusive
            elif lo is not None and r.lo == lo:
                lo_inc = lo_inc or r.lo_inclusive
            if hi is not None and (r.hi is None or r.hi > hi):
                hi, hi_inc = r.hi, r.hi_inclusive
            elif hi is not None and r.hi == hi:
                hi_inc = hi_inc or r.hi_inclusive
    except TypeError:
        return None
    if lo is None and hi is None:
        return None
    return Range(lo, lo_inc if lo is not None else True, hi, hi_inc if hi is not None else True)


def _points(p: Predicate) -> list[Any] | None:
    if isinstance(p, Eq):
        return [p.value]
    if isinstance(p, In):
        return list(p.values)
    return None


def column_predicates(expr: pc.Expression | Node | None) -> dict[str, list[Predicate]]:
    """Region-pruning predicates (`Eq`, `In`, `Range`) per top-level column, AND-ed per column.

    Sound: every row matching `expr` satisfies every returned predicate. Read from the top-level
    conjuncts: comparisons of a column with a literal (either side; ``!=`` gives nothing),
    ``is_in`` (nothing when a NULL in the set matches NULL rows), a bare boolean column (and its
    ``invert``), and OR-s of those (point sets unite, ranges take their hull). Ranges on one column
    merge into one; points are intersected and filtered by the ranges. A comparison with a NULL or
    NaN literal matches nothing, giving ``In(())``. Literal values are taken as of the column's type,
    which is what DataFusion pushes (it casts literals to the column type). `expr` is an Expression
    or its tree; ``{}`` when it does not decode.
    """
    if expr is None:
        return {}
    try:
        node = tree_of(expr)
    except ValueError:
        return {}
    facts = _facts(node)
    if isinstance(facts, _Nothing):
        return {n.name: [In(())] for n in _walk(node) if isinstance(n, Field)}
    return {c: _summary(ps) for c, ps in facts.items() if ps}
