"""Integer region expressions compiled to vectorized pyarrow / numpy code.

The usual region expressions (`col0 % 8`, `murmur3(col0) % 16`, `abs(murmur3_multi(col0, col1)) %
4`) are evaluated here, without DataFusion: in a query's own callbacks, where a DataFusion call
would block on the runtime already running the query, and without a DataFusion plan per call.
`compile_int_expression` accepts: signed integer columns ``col0``, ``col1``, ... and integer
literals (int64) combined with ``+ - * / %``, unary ``-`` and parentheses; ``abs(x)``;
``murmur3(x)`` and ``murmur3_multi(x, ...)`` over columns of any type they hash or over integer
expressions. Anything else returns None (the caller evaluates it with DataFusion).

Guarantees (checked against DataFusion in tests/test_region_spec.py): the same values, NULLs and
types as DataFusion's SQL: ``+ - *`` and unary ``-`` wrap around on overflow, ``/`` truncates
toward zero, ``%`` takes the sign of the dividend, ``abs`` of the minimum value and a zero divisor
raise `RegionRoutingError`; operands are widened to the wider type (a literal is int64).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import RegionRoutingError
from memwal_df.format.murmur3 import is_hashable, murmur3_multi

__all__ = ["Evaluator", "as_array", "compile_int_expression"]

Value: TypeAlias = pa.Array | pa.Scalar
Evaluator = Callable[[Sequence[pa.Array], int], Value]  # (source columns, number of rows)

_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[-+*/%(),]))")
_SIGNED = (pa.int8(), pa.int16(), pa.int32(), pa.int64())
_I64_MAX = (1 << 63) - 1


class _Unsupported(Exception):
    """The expression is outside what this module compiles."""


def compile_int_expression(sql: str, source_types: Sequence[pa.DataType]) -> Evaluator | None:
    """An evaluator of `sql` over arrays of `source_types`, or None when `sql` is outside the subset.

    The evaluator takes the source arrays and the number of rows; it returns one value per row, or
    a scalar when the expression reads no column (`as_array` repeats it)."""
    try:
        tokens = _tokens(sql)
        parser = _Parser(tokens, list(source_types))
        fn, _ = parser.expr()
        if parser.i != len(tokens):
            return None
    except _Unsupported:
        return None
    return fn


def _tokens(sql: str) -> list[tuple[str, str]]:
    if "--" in sql or "/*" in sql:  # SQL comments
        raise _Unsupported
    out, pos = [], 0
    while sql[pos:].strip():
        m = _TOKEN.match(sql, pos)
        if m is None:
            raise _Unsupported
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _wider(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    return a if a.bit_width >= b.bit_width else b


def _modulo(a: Value, b: Value) -> Value:
    """SQL ``%`` on integers: the remainder of truncating division, with the dividend's sign (``x %
    -1`` is 0, as ``x % 1``: the quotient of the minimum value by -1 does not exist)."""
    b = pc.if_else(pc.equal(b, -1), pa.scalar(1, b.type), b)
    return pc.subtract(a, pc.multiply(pc.divide(a, b), b))


_BINARY: dict[str, Callable[[Value, Value], Value]] = {
    "+": pc.add,
    "-": pc.subtract,
    "*": pc.multiply,
    "/": pc.divide_checked,  # the minimum value / -1 overflows
    "%": _modulo,
}


class _Parser:
    """Recursive descent; each rule returns (evaluator, result type)."""

    def __init__(self, tokens: list[tuple[str, str]], types: list[pa.DataType]) -> None:
        self.tokens, self.types, self.i = tokens, types, 0

    def _next(self) -> tuple[str, str]:
        if self.i >= len(self.tokens):
            raise _Unsupported
        self.i += 1
        return self.tokens[self.i - 1]

    def _at(self, *ops: str) -> str | None:
        if self.i < len(self.tokens) and self.tokens[self.i][0] == "op" and self.tokens[self.i][1] in ops:
            self.i += 1
            return self.tokens[self.i - 1][1]
        return None

    def expr(self) -> tuple[Evaluator, pa.DataType]:
        return self._binary(self.term, "+", "-")

    def term(self) -> tuple[Evaluator, pa.DataType]:
        return self._binary(self.unary, "*", "/", "%")

    def _binary(
        self, operand: Callable[[], tuple[Evaluator, pa.DataType]], *ops: str
    ) -> tuple[Evaluator, pa.DataType]:
        left, left_type = operand()
        while (op := self._at(*ops)) is not None:
            right, right_type = operand()
            if left_type not in _SIGNED or right_type not in _SIGNED:
                raise _Unsupported
            left, left_type = _apply2(_BINARY[op], left, right), _wider(left_type, right_type)
        return left, left_type

    def unary(self) -> tuple[Evaluator, pa.DataType]:
        if self._at("-") is None:
            return self.primary()
        fn, t = self.unary()
        if t not in _SIGNED:
            raise _Unsupported
        return (lambda cols, n: pc.negate(fn(cols, n))), t

    def primary(self) -> tuple[Evaluator, pa.DataType]:
        kind, text = self._next()
        if kind == "int":
            if int(text) > _I64_MAX:
                raise _Unsupported
            value = pa.scalar(int(text), pa.int64())
            return (lambda cols, n: value), pa.int64()
        if kind == "op":
            if text != "(":
                raise _Unsupported
            inner = self.expr()
            if self._at(")") is None:
                raise _Unsupported
            return inner
        name = text.lower()
        if self._at("(") is not None:
            return self._call(name)
        m = re.fullmatch(r"col(\d+)", name)
        if m is None or int(m.group(1)) >= len(self.types):
            raise _Unsupported
        index = int(m.group(1))
        return (lambda cols, n: cols[index]), self.types[index]

    def _call(self, name: str) -> tuple[Evaluator, pa.DataType]:
        args = [self.expr()]
        while self._at(",") is not None:
            args.append(self.expr())
        if self._at(")") is None:
            raise _Unsupported
        fns = [fn for fn, _ in args]
        if name == "abs" and len(args) == 1 and args[0][1] in _SIGNED:
            return (lambda cols, n: _checked_abs(fns[0](cols, n))), args[0][1]
        if name in ("murmur3", "murmur3_multi") and (name == "murmur3_multi" or len(args) == 1):
            if not all(is_hashable(t) for _, t in args):
                raise _Unsupported
            return (lambda cols, n: murmur3_multi([as_array(f(cols, n), n) for f in fns])), pa.int32()
        raise _Unsupported


def _apply2(op: Callable[[Value, Value], Value], left: Evaluator, right: Evaluator) -> Evaluator:
    def fn(cols: Sequence[pa.Array], n: int) -> Value:
        try:
            return op(left(cols, n), right(cols, n))
        except pa.ArrowInvalid as e:  # a zero divisor, a quotient that overflows
            raise RegionRoutingError(f"region expression failed: {e}") from None

    return fn


def _checked_abs(v: Value) -> Value:
    try:
        return pc.abs_checked(v)
    except pa.ArrowInvalid as e:
        raise RegionRoutingError(f"region expression failed: abs overflows: {e}") from None


def as_array(v: Value, n: int) -> pa.Array:
    """`v` as `n` values (a scalar repeated)."""
    if isinstance(v, pa.Scalar):
        return pa.array(np.full(n, v.as_py()), v.type) if v.is_valid else pa.nulls(n, v.type)
    return v
