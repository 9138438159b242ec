"""SQL text as the server needs to understand it before DataFusion sees it: which statements are
writes to a served table (`INSERT INTO t ...`, `DELETE FROM t WHERE ...`), which are queries, and
the placeholders of a prepared statement (`?` are numbered `$1`, `$2`, ... for DataFusion).

A small tokenizer (quoted identifiers, string literals, comments, placeholders) is all this needs;
everything else about the SQL is DataFusion's to parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memwal_df.server.status import InvalidRequest, Unimplemented

__all__ = ["Delete", "Insert", "Query", "Statement", "Token", "number_placeholders", "parse", "tokens"]


@dataclass(frozen=True)
class Token:
    kind: str  # word, quoted, string, number, param, punct
    text: str
    start: int
    end: int

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "word" else ""

    @property
    def name(self) -> str:
        """The identifier it names: a quoted one as written, an unquoted one lowercased (DataFusion
        normalizes unquoted identifiers)."""
        return self.text[1:-1].replace('""', '"') if self.kind == "quoted" else self.text.lower()


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_DOLLAR = re.compile(r"\$(\d+)")
_PUNCT2 = ("::", "<=", ">=", "<>", "!=", "||", "->")


def tokens(sql: str) -> list[Token]:
    """The tokens of `sql`, comments and whitespace left out."""
    out: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            if j < 0:
                raise InvalidRequest("unterminated /* comment in the SQL")
            i = j + 2
        elif c in "'\"":
            j = i + 1
            while True:
                j = sql.find(c, j)
                if j < 0:
                    what = "string literal" if c == "'" else "quoted identifier"
                    raise InvalidRequest(f"unterminated {what} starting at character {i + 1} of the SQL")
                if sql.startswith(c * 2, j):
                    j += 2
                    continue
                break
            out.append(Token("string" if c == "'" else "quoted", sql[i : j + 1], i, j + 1))
            i = j + 1
        elif c == "?":
            out.append(Token("param", "?", i, i + 1))
            i += 1
        elif c == "$" and (m := _DOLLAR.match(sql, i)):
            out.append(Token("param", m.group(0), i, m.end()))
            i = m.end()
        elif m := _WORD.match(sql, i):
            out.append(Token("word", m.group(0), i, m.end()))
            i = m.end()
        elif m := _NUMBER.match(sql, i):
            out.append(Token("number", m.group(0), i, m.end()))
            i = m.end()
        else:
            two = sql[i : i + 2]
            width = 2 if two in _PUNCT2 else 1
            out.append(Token("punct", sql[i : i + width], i, i + width))
            i += width
    return out


def number_placeholders(sql: str) -> tuple[str, int]:
    """`sql` with each `?` numbered (`$1`, `$2`, ... in order) and the number of parameters it
    takes (the highest `$n`); `?` and `$n` in one statement are refused."""
    toks = [t for t in tokens(sql) if t.kind == "param"]
    marks = [t for t in toks if t.text == "?"]
    numbered = [int(t.text[1:]) for t in toks if t.text != "?"]
    if marks and numbered:
        raise InvalidRequest("the SQL mixes `?` and `$n` placeholders: use one style")
    if not marks:
        return sql, max(numbered, default=0)
    parts, last = [], 0
    for k, t in enumerate(marks, start=1):
        parts += [sql[last : t.start], f"${k}"]
        last = t.end
    parts.append(sql[last:])
    return "".join(parts), len(marks)


@dataclass(frozen=True)
class Query:
    """Any statement DataFusion runs (SELECT, WITH, VALUES, EXPLAIN, SHOW, DDL, ...)."""

    sql: str


@dataclass(frozen=True)
class Insert:
    """`INSERT INTO table [(columns)] source`: `source` is a query (VALUES or SELECT)."""

    table: str
    columns: tuple[str, ...] | None
    source: str


@dataclass(frozen=True)
class Delete:
    """`DELETE FROM table WHERE where`."""

    table: str
    where: str


Statement = Query | Insert | Delete

_UNSUPPORTED = {
    "UPDATE": "UPDATE is not supported: write the whole new row with INSERT (an upsert by primary key)",
    "MERGE": "MERGE is not supported: INSERT upserts by primary key",
    "TRUNCATE": "TRUNCATE is not supported: DELETE rows by key",
    "REPLACE": "REPLACE is not supported: INSERT upserts by primary key",
}


def parse(sql: str) -> Statement:
    """What `sql` (one statement, an optional `;` at its end) is."""
    toks = tokens(sql)
    while toks and toks[-1].text == ";":
        toks.pop()
    if not toks:
        raise InvalidRequest("the SQL is empty")
    if any(t.text == ";" for t in toks):
        raise InvalidRequest("the SQL holds several statements: send one at a time")
    verb = toks[0].upper
    if verb in _UNSUPPORTED:
        raise Unimplemented(_UNSUPPORTED[verb])
    if verb == "INSERT":
        return _insert(sql, toks)
    if verb == "DELETE":
        return _delete(sql, toks)
    return Query(sql[toks[0].start : toks[-1].end])


def _name(toks: list[Token], i: int, what: str) -> tuple[str, int]:
    """A (possibly qualified) table name at `i`: its last part and the position after it."""
    parts: list[str] = []
    while True:
        if i >= len(toks) or toks[i].kind not in ("word", "quoted"):
            raise InvalidRequest(f"{what}: expected a table name")
        parts.append(toks[i].name)
        i += 1
        if i < len(toks) and toks[i].text == ".":
            i += 1
            continue
        return parts[-1], i


def _insert(sql: str, toks: list[Token]) -> Insert:
    if len(toks) < 2 or toks[1].upper != "INTO":
        raise Unimplemented("only INSERT INTO table [(columns)] VALUES ... / SELECT ... is supported")
    table, i = _name(toks, 2, "INSERT INTO")
    columns: tuple[str, ...] | None = None
    if i < len(toks) and toks[i].text == "(":
        names: list[str] = []
        i += 1
        while True:
            if i >= len(toks) or toks[i].kind not in ("word", "quoted"):
                raise InvalidRequest("INSERT INTO: expected a column name in the column list")
            names.append(toks[i].name)
            i += 1
            if i < len(toks) and toks[i].text == ",":
                i += 1
                continue
            if i < len(toks) and toks[i].text == ")":
                i += 1
                break
            raise InvalidRequest("INSERT INTO: the column list needs a closing `)`")
        columns = tuple(names)
    if i >= len(toks) or toks[i].upper not in ("VALUES", "SELECT", "WITH"):
        raise InvalidRequest("INSERT INTO: expected VALUES (...) or a SELECT after the table")
    return Insert(table, columns, sql[toks[i].start : toks[-1].end])


def _delete(sql: str, toks: list[Token]) -> Delete:
    if len(toks) < 2 or toks[1].upper != "FROM":
        raise InvalidRequest("expected DELETE FROM table WHERE ...")
    table, i = _name(toks, 2, "DELETE FROM")
    if i >= len(toks):
        raise InvalidRequest(
            "DELETE without WHERE is not supported: name the rows, e.g. WHERE id = 1 or WHERE id IN (1, 2)"
        )
    if toks[i].upper != "WHERE" or i + 1 >= len(toks):
        raise InvalidRequest("expected DELETE FROM table WHERE <condition on the primary key>")
    return Delete(table, sql[toks[i + 1].start : toks[-1].end])
