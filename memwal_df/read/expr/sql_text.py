"""A parser for the SQL predicates memwal_df's SQL functions take as text (`memwal_explain('t', 'id = 5')`).

DataFusion cannot be called from inside a table-function callback (a nested-runtime panic), so
filters given as text are parsed here into a `pyarrow.compute.Expression`. Grammar (case-insensitive
keywords): `expr := or`; `or := and (OR and)*`; `and := not (AND not)*`; `not := NOT not | predicate`;
`predicate := operand [(=|!=|<>|<|<=|>|>=) operand | [NOT] IN (literal, …) | [NOT] BETWEEN operand AND
operand | IS [NOT] NULL]`; `operand := column | literal | (expr)`. Literals: integers, decimals,
'strings' ('' escapes a quote), TRUE, FALSE, NULL, DATE 'yyyy-mm-dd', TIMESTAMP '…'. Columns: names
or "quoted names".

Guarantees: anything outside the grammar raises `InvalidFilterError` (a `ValueError`) naming the
position; a parsed filter means what DataFusion's SQL means for these forms. Given the table's
schema, a filter naming a column the table lacks, or comparing a column with a value of a type it
cannot be compared with, raises `InvalidFilterError` naming the column and the value
(`memwal_df.read.expr.predicate.check_filter`).
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidFilterError
from memwal_df.read.expr.predicate import check_filter

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>-?(?:\d+\.\d*|\.\d+|\d+))
  | (?P<str>'(?:[^']|'')*')
  | (?P<qid>"(?:[^"]|"")*")
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|<>|!=|=|<|>|\(|\)|,)
    )""",
    re.VERBOSE,
)
_COMPARE = {
    "=": pc.equal,
    "!=": pc.not_equal,
    "<>": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}


def parse_filter(text: str, schema: pa.Schema | None = None) -> pc.Expression:
    """The pyarrow expression of a SQL predicate, checked against `schema` when given."""
    expr = _Parser(text).parse()
    if schema is not None:
        check_filter(expr, schema, text)
    return expr


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise InvalidFilterError(
                    f"cannot read the filter at position {pos}: {text[pos : pos + 20]!r}"
                )
            kind = m.lastgroup or ""
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0

    # -- token helpers

    def _peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _keyword(self, *words: str) -> bool:
        """Consume the keywords if they come next."""
        for k, w in enumerate(words):
            tok = self.tokens[self.i + k] if self.i + k < len(self.tokens) else None
            if tok is None or tok[0] != "id" or tok[1].upper() != w:
                return False
        self.i += len(words)
        return True

    def _op(self, *ops: str) -> str | None:
        tok = self._peek()
        if tok is not None and tok[0] == "op" and tok[1] in ops:
            self.i += 1
            return tok[1]
        return None

    def _fail(self, what: str) -> InvalidFilterError:
        tok = self._peek()
        where = f"position {tok[2]} ({tok[1]!r})" if tok else "the end"
        return InvalidFilterError(f"expected {what} at {where} in filter {self.text!r}")

    # -- grammar

    def parse(self) -> pc.Expression:
        expr = self._or()
        if self._peek() is not None:
            raise self._fail("the end of the filter")
        return expr

    def _or(self) -> pc.Expression:
        expr = self._and()
        while self._keyword("OR"):
            expr = expr | self._and()
        return expr

    def _and(self) -> pc.Expression:
        expr = self._not()
        while self._keyword("AND"):
            expr = expr & self._not()
        return expr

    def _not(self) -> pc.Expression:
        if self._keyword("NOT"):
            return ~self._not()
        return self._predicate()

    def _predicate(self) -> pc.Expression:
        left = self._operand()
        if (op := self._op(*_COMPARE)) is not None:
            return _COMPARE[op](left, self._operand())
        negate = self._keyword("NOT")
        if self._keyword("IN"):
            if self._op("(") is None:
                raise self._fail("'('")
            values = [self._literal()]
            while self._op(","):
                values.append(self._literal())
            if self._op(")") is None:
                raise self._fail("')'")
            try:
                expr = left.isin([v for v in values if v is not None])
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise InvalidFilterError(
                    f"filter {self.text!r} compares {left} with values of different types {values}: {e}"
                ) from None
            if not negate:
                return expr
            # SQL: NULL NOT IN (...) is NULL, and x NOT IN (..., NULL) is never true
            return pc.scalar(False) if None in values else left.is_valid() & ~expr
        if self._keyword("BETWEEN"):
            lo = self._operand()
            if not self._keyword("AND"):
                raise self._fail("AND")
            expr = (left >= lo) & (left <= self._operand())
            return ~expr if negate else expr
        if negate:
            raise self._fail("IN or BETWEEN after NOT")
        if self._keyword("IS", "NOT", "NULL"):
            return left.is_valid()
        if self._keyword("IS", "NULL"):
            return left.is_null()
        if isinstance(left, pc.Expression):
            return left
        raise self._fail("a comparison")

    def _operand(self) -> Any:
        tok = self._peek()
        if tok is None:
            raise self._fail("a column or a value")
        if tok[0] == "op" and tok[1] == "(":
            self.i += 1
            expr = self._or()
            if self._op(")") is None:
                raise self._fail("')'")
            return expr
        if tok[0] == "qid":
            self.i += 1
            return pc.field(tok[1][1:-1].replace('""', '"'))
        if tok[0] == "id" and tok[1].upper() not in ("TRUE", "FALSE", "NULL", "DATE", "TIMESTAMP"):
            self.i += 1
            return pc.field(tok[1])
        return pc.scalar(self._literal())

    def _literal(self) -> Any:
        tok = self._peek()
        if tok is None:
            raise self._fail("a value")
        kind, text, _ = tok
        self.i += 1
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "str":
            return text[1:-1].replace("''", "'")
        if kind == "op":
            self.i -= 1
            raise self._fail("a value")
        word = text.upper()
        if word in ("TRUE", "FALSE"):
            return word == "TRUE"
        if word == "NULL":
            return None
        if word in ("DATE", "TIMESTAMP"):
            nxt = self._peek()
            if nxt is None or nxt[0] != "str":
                raise self._fail(f"a quoted {word.lower()}")
            self.i += 1
            raw = nxt[1][1:-1]
            return dt.date.fromisoformat(raw) if word == "DATE" else pa.scalar(dt.datetime.fromisoformat(raw))
        self.i -= 1
        raise self._fail("a value")
