"""Point gets: `SELECT * | c, ... FROM t WHERE pk = v` and `... WHERE pk IN (v, ...)` on a served
table whose primary key is one column, answered by the table's own point lookup
(`MemWalTable.to_table`) without DataFusion planning them: the same rows, columns and types as
DataFusion's answer, at a fraction of the cost.

`recognize` reads the shape from the SQL's tokens (unquoted names lowercased, as DataFusion does;
nothing may follow the WHERE condition); a value is an integer literal, a string literal or a
placeholder. `PointGet.lookup` turns it into a lookup once the parameters are bound; it is None
whenever anything falls outside that narrow shape: a table or column the server does not serve, a
value of another type than the key's or out of its range, a NULL or several parameter sets. DataFusion
then runs the statement like any other, and reports whatever is wrong with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.server.ingest import ServedTable
from memwal_df.server.statements import Token, tokens

__all__ = ["Lookup", "PointGet", "recognize", "shape_of"]

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Lookup:
    """A point get ready to run: its result schema, the columns it reads and its key filter."""

    served: ServedTable
    schema: pa.Schema
    columns: list[str] | None  # None: every column
    filter: pc.Expression

    def run(self) -> pa.Table:
        """The live rows of the keys (each once), read from a snapshot taken now."""
        return self.served.reader.to_table(self.columns, self.filter)


@dataclass(frozen=True)
class PointGet:
    """The shape of a point get: the table, its selected columns (None: `*`), the key column and the
    values it is compared with (number, string or `$n` placeholder tokens)."""

    table: str
    columns: tuple[str, ...] | None
    key: str
    values: tuple[Token, ...]

    def result_schema(self, served: ServedTable) -> pa.Schema | None:
        """The result's schema, None when the statement does not select known columns of `served`
        by its one-column primary key."""
        schema = served.reader.schema
        if served.primary_key != [self.key]:
            return None
        if self.columns is None:
            return schema
        if len(set(self.columns)) != len(self.columns) or not all(c in schema.names for c in self.columns):
            return None
        return pa.schema([schema.field(c) for c in self.columns])

    def parameter_schema(self, served: ServedTable) -> pa.Schema | None:
        """The types of its placeholders, `$1 ... $n` (each the key's type); None without any, when
        they are not numbered 1 to n, or when the statement is no point get of `served`."""
        numbers = {int(v.text[1:]) for v in self.values if v.kind == "param"}
        if not numbers or numbers != set(range(1, len(numbers) + 1)) or self.result_schema(served) is None:
            return None
        key_type = served.table.schema.key_schema.field(self.key).type
        return pa.schema([pa.field(f"${n}", key_type) for n in sorted(numbers)])

    def lookup(self, served: ServedTable, params: pa.Table | None) -> Lookup | None:
        """The lookup answering this statement with `params` bound (one parameter set at most); None
        when DataFusion must run it instead (see the module docstring)."""
        schema = self.result_schema(served)
        if schema is None or (params is not None and params.num_rows > 1):
            return None
        key_type = served.table.schema.key_schema.field(self.key).type
        keys = [_key_value(v, key_type, params) for v in self.values]
        if any(k is None for k in keys):
            return None
        try:
            scalars = [pa.scalar(k, key_type) for k in keys]
        except (pa.ArrowInvalid, OverflowError):
            return None  # out of the key type's range
        field = pc.field(self.key)
        condition = field == scalars[0] if len(scalars) == 1 else field.isin(pa.array(keys, key_type))
        columns = None if self.columns is None else list(self.columns)
        return Lookup(served, schema, columns, condition)


def _key_value(token: Token, key_type: pa.DataType, params: pa.Table | None) -> Any:
    """The Python value `token` gives a key of `key_type`; None when it is not one of that type."""
    integer_key = pa.types.is_integer(key_type)
    string_key = pa.types.is_string(key_type) or pa.types.is_large_string(key_type)
    if token.kind == "number":
        return int(token.text) if integer_key else None
    if token.kind == "string":
        return token.text[1:-1].replace("''", "'") if string_key else None
    # A `$n` placeholder: the bound value, when it has the key's kind of type.
    position = int(token.text[1:]) - 1
    if params is None or params.num_rows != 1 or not 0 <= position < params.num_columns:
        return None
    value = params.column(position)[0]
    if not value.is_valid:
        return None
    if integer_key and pa.types.is_integer(value.type):
        return value.as_py()
    if string_key and (pa.types.is_string(value.type) or pa.types.is_large_string(value.type)):
        return value.as_py()
    return None


def recognize(sql: str) -> PointGet | None:
    """The point get `sql` is (placeholders numbered `$n`), None for any other statement."""
    return shape_of(tokens(sql))


def shape_of(statement_tokens: list[Token]) -> PointGet | None:
    """`recognize` for a statement already tokenized (the list is not changed)."""
    toks = list(statement_tokens)
    while toks and toks[-1].text == ";":
        toks.pop()
    if len(toks) < 8 or toks[0].upper != "SELECT":
        return None
    at = _At(toks, 1)
    columns: tuple[str, ...] | None = None
    if at.text() == "*":
        at.i += 1
    else:
        names = [at.identifier()]
        while at.text() == ",":
            at.i += 1
            names.append(at.identifier())
        if None in names:
            return None
        columns = tuple(n for n in names if n is not None)
    if at.word() != "FROM":
        return None
    table = at.identifier()
    if at.word() != "WHERE":
        return None
    key = at.identifier()
    if table is None or key is None or at.text() == ".":
        return None
    if at.text() == "=":
        at.i += 1
        values = [at.value()]
    elif at.word() == "IN" and at.text() == "(":
        at.i += 1
        values = [at.value()]
        while at.text() == ",":
            at.i += 1
            values.append(at.value())
        if at.text() != ")":
            return None
        at.i += 1
    else:
        return None
    if at.i != len(toks) or None in values:
        return None
    return PointGet(table, columns, key, tuple(v for v in values if v is not None))


def _is_integer(token: Token) -> bool:
    return token.kind == "number" and _INTEGER.fullmatch(token.text) is not None


class _At:
    """A cursor over the tokens: each method reads one item and moves past it."""

    def __init__(self, toks: list[Token], i: int) -> None:
        self.toks = toks
        self.i = i

    def text(self) -> str | None:
        return self.toks[self.i].text if self.i < len(self.toks) else None

    def word(self) -> str | None:
        """The keyword here (upper case), moving past it; None when it is not a word."""
        if self.i >= len(self.toks) or self.toks[self.i].kind != "word":
            return None
        self.i += 1
        return self.toks[self.i - 1].upper

    def identifier(self) -> str | None:
        if self.i >= len(self.toks) or self.toks[self.i].kind not in ("word", "quoted"):
            return None
        self.i += 1
        return self.toks[self.i - 1].name

    def value(self) -> Token | None:
        """An integer or string literal or a `$n` placeholder; a leading `-` folds into the integer."""
        if self.i >= len(self.toks):
            return None
        t = self.toks[self.i]
        if t.text == "-" and self.i + 1 < len(self.toks) and _is_integer(self.toks[self.i + 1]):
            n = self.toks[self.i + 1]
            self.i += 2
            return Token("number", "-" + n.text, t.start, n.end)
        if _is_integer(t) or t.kind == "string" or (t.kind == "param" and t.text.startswith("$")):
            self.i += 1
            return t
        return None
