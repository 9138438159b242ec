"""memwal_df.read.expr.expression_tree, .predicate and .lance_filter: decoding pushed pyarrow Expressions, key
lookups, pruning, Lance filters.

DATAFUSION_CASES records, for DataFusion 54.1 (datafusion-python's DatasetExec), the filter a
`pyarrow.dataset.Dataset` receives in `get_fragments(filter)` for a SQL WHERE clause (None: nothing
pushed, DataFusion filters itself). `test_datafusion_pushed_forms` re-runs them.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import struct
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pytest
from datafusion import SessionContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwal_df.format import regions as rs
from memwal_df.format.regions.predicates import Eq, In, Range
from memwal_df.read.expr import expression_tree as T
from memwal_df.read.expr import lance_filter as L
from memwal_df.read.expr import predicate as P

NAN = float("nan")
NEG_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]
INF = float("inf")
F = pc.field
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=150)

DATAFUSION_CASES: list[tuple[str, str | None]] = [
    ("id = 5", "(id == 5)"),
    ("5 = id", "(id == 5)"),
    ("id <> 5", "(id != 5)"),
    ("id < 3", "(id < 3)"),
    ("id <= 3", "(id <= 3)"),
    ("id > 3", "(id > 3)"),
    ("id >= 3", "(id >= 3)"),
    ("3 > id", "(id < 3)"),
    ("id = -5", "(id == -5)"),
    ("id BETWEEN 2 AND 4", "((id >= 2) and (id <= 4))"),
    ("id NOT BETWEEN 2 AND 4", "((id < 2) or (id > 4))"),
    ("id IN (1, 2, 3)", "(((id == 1) or (id == 2)) or (id == 3))"),
    (
        "id IN (1, 2, 3, 4)",
        "is_in(id, {value_set=int64:[\n  1,\n  2,\n  3,\n  4\n], null_matching_behavior=MATCH})",
    ),
    ("id NOT IN (1, 2)", "((id != 1) and (id != 2))"),
    (
        "id NOT IN (1, 2, 3, 4)",
        "invert(is_in(id, {value_set=int64:[\n  1,\n  2,\n  3,\n  4\n], null_matching_behavior=MATCH}))",
    ),
    ("id IN (1, NULL)", "((id == 1) or null[bool])"),
    ("id = 1 OR id = 2", "((id == 1) or (id == 2))"),
    ("id = 1 OR s = 'a'", '((id == 1) or (s == "a"))'),
    ("NOT (id = 1)", "(id != 1)"),
    ("NOT (id > 1 AND s = 'a')", '((id <= 1) or (s != "a"))'),
    ("b", "b"),
    ("NOT b", "invert(b)"),
    ("b = true", "b"),
    ("b IS NOT NULL AND b", "(is_valid(b) and b)"),
    ("id IS NULL", "is_null(id, {nan_is_null=false})"),
    ("s IS NOT NULL", "is_valid(s)"),
    ("id > 1 OR id IS NULL", "((id > 1) or is_null(id, {nan_is_null=false}))"),
    ("s = 'b''c'", '(s == "b\'c")'),
    ("s = 'it''s \" : ) ('", '(s == "it\'s \\" : ) (")'),
    ("s IN ('a', 'x')", '((s == "a") or (s == "x"))'),
    (
        "s IN ('a', 'b''c', 'ü', '')",
        'is_in(s, {value_set=string:[\n  "a",\n  "b\'c",\n  "ü",\n  ""\n], null_matching_behavior=MATCH})',
    ),
    ("ls = 'a'", '(ls == "a")'),
    ("bin = X'61'", '(bin == "61")'),
    ("i32 = 5", "(i32 == 5)"),
    ("i32 IN (1, 5)", "((i32 == 1) or (i32 == 5))"),
    (
        "i32 IN (1, 2, 3, 4)",
        "is_in(i32, {value_set=int64:[\n  1,\n  2,\n  3,\n  4\n], null_matching_behavior=MATCH})",
    ),
    ("i32 BETWEEN 1 AND 3", "((i32 >= 1) and (i32 <= 3))"),
    ("u64 = 5", "(u64 == 5)"),
    (
        "u64 IN (1, 2, 3, 4)",
        "is_in(u64, {value_set=int64:[\n  1,\n  2,\n  3,\n  4\n], null_matching_behavior=MATCH})",
    ),
    ("f = 1.0", "(f == 1)"),
    ("f = 1", "(f == 1)"),
    ("f > 1", "(f > 1)"),
    ("f = -0.0", "(f == -0)"),
    ("f = 'NaN'::double", "(f == nan)"),
    (
        "f IN (1.0, 2.5, 0.0, -1.0)",
        "is_in(f, {value_set=double:[\n  1,\n  2.5,\n  0,\n  -1\n], null_matching_behavior=MATCH})",
    ),
    (
        "f IN (1.0, 2.5, 3.0, -1.0)",
        "is_in(f, {value_set=double:[\n  1,\n  2.5,\n  3,\n  -1\n], null_matching_behavior=MATCH})",
    ),
    (
        "b IN (true, false, true, false)",
        "is_in(b, {value_set=bool:[\n  true,\n  false,\n  true,\n  false\n], null_matching_behavior=MATCH})",
    ),
    ("d = DATE '2020-01-02'", "(d == 2020-01-02)"),
    ("d = '2020-01-02'", "(d == 2020-01-02)"),
    ("d > '2020-01-02'", "(d > 2020-01-02)"),
    ("d BETWEEN '2020-01-01' AND '2020-01-03'", "((d >= 2020-01-01) and (d <= 2020-01-03))"),
    ("ts = TIMESTAMP '2020-01-02 00:00:00'", "(ts == 2020-01-02 00:00:00.000000)"),
    ("ts > '2020-01-02'", "(ts > 2020-01-02 00:00:00.000000)"),
    ("tsz > '2020-01-02T00:00:00Z'", "(tsz > 2020-01-02 00:00:00.000000Z)"),
    ("dec = 1.10", "(dec == 1.10)"),
    ("dec > 1", "(dec > 1.00)"),
    ('"Mixed Case" = 2', "(Mixed Case == 2)"),
    ("CAST(id AS VARCHAR) = '1'", "(id == 1)"),
    ("id = 5 AND s = 'a'", '((id == 5) and (s == "a"))'),
    ("id = 1 AND k2 = 'x'", '((id == 1) and (k2 == "x"))'),
    (
        "(id = 1 AND k2 = 'x') OR (id = 2 AND k2 = 'y')",
        '(((id == 1) and (k2 == "x")) or ((id == 2) and (k2 == "y")))',
    ),
    ("id IN (1, 2) AND k2 = 'x'", '(((id == 1) or (id == 2)) and (k2 == "x"))'),
    (
        "id IN (1, 2, 3, 4) AND k2 IN ('x', 'y', 'z', 'w')",
        "(is_in(id, {value_set=int64:[\n  1,\n  2,\n  3,\n  4\n], null_matching_behavior=MATCH}) and "
        'is_in(k2, {value_set=string:[\n  "x",\n  "y",\n  "z",\n  "w"\n], null_matching_behavior=MATCH}))',
    ),
    ("id > 1 AND id < 4 AND s IS NOT NULL", "(((id > 1) and (id < 4)) and is_valid(s))"),
    ("id = 1 OR NOT (s = 'a' AND i32 > 3)", '((id == 1) or ((s != "a") or (i32 <= 3)))'),
    ("id = 1 AND random() < 2", "(id == 1)"),  # the unsupported conjunct stays in DataFusion
    ("s LIKE 'a%'", None),
    ("i32 = 5000000000", None),  # keeps a cast
    ("id + 1 = 3", None),
    ("ls IN ('a', 'b', 'c', 'd')", None),  # only int/uint/float/bool/utf8 IN lists convert
    ("d IN ('2020-01-01', '2020-01-02', '2020-01-03', '2020-01-04')", None),
    ("id IN (1, 2, 3, 4, NULL)", None),
]

# ----------------------------------------------------------------------------------------------
# A table with awkward values, for DataFusion and Lance


def _call(node: T.Node) -> T.Call:
    assert isinstance(node, T.Call), node
    return node


def _rows_table() -> pa.Table:
    n = 16
    strings = [
        "a",
        "b'c",
        None,
        'x"y',
        "",
        "a%",
        "ü",
        "it's",
        "\\",
        "a b",
        "(",
        "and",
        "a\nb",
        "nul\x00",
        "b",
        None,
    ]
    return pa.table(
        {
            "id": pa.array(range(1, n + 1), pa.int64()),
            "k2": pa.array(["x", "y", "z", "w"] * 4),
            "i": pa.array(
                [1, 2, None, 5, -5, 0, 3, 4, 2**63 - 1, -(2**63), 1, 2, None, 5, 0, -1], pa.int64()
            ),
            "i32": pa.array([1, 2, None, 5, -7, 0, 3, 4, 1, 2, None, -5, 5, 0, 3, 4], pa.int32()),
            "u64": pa.array([1, 2, None, 5, 2**64 - 1, 0, 3, 4, 2**63, 1, 2, 3, 4, 5, None, 7], pa.uint64()),
            "f": pa.array(
                [1.0, NAN, None, 2.5, 0.0, -0.0, -1.0, INF, -INF, NEG_NAN, 1.5, -2.0, 1e300, None, 0.0, 5.0]
            ),
            "f32": pa.array(
                [1.0, NAN, None, 2.5, 0.0, -0.0, -1.0, INF, 0.1, 1, 1.5, -2.0, 3, None, 0, 5], pa.float32()
            ),
            "s": pa.array(strings),
            "ls": pa.array(strings, pa.large_string()),
            "bin": pa.array([None if s is None else s.encode() for s in strings]),
            "d": pa.array(
                [None if k == 5 else dt.date(2019, 12, 28) + dt.timedelta(days=k) for k in range(n)]
            ),
            "ts": pa.array([dt.datetime(2020, 1, 1 + k % 5, k) for k in range(n)], pa.timestamp("us")),
            "tsz": pa.array([dt.datetime(2020, 1, 1 + k % 5) for k in range(n)], pa.timestamp("us", "UTC")),
            "tsn": pa.array([1577836800000000000 + k * 1_000_000_007 for k in range(n)], pa.timestamp("ns")),
            "dec": pa.array(
                [None if k % 7 == 3 else decimal.Decimal(k * 55 - 300).scaleb(-2) for k in range(n)],
                pa.decimal128(10, 2),
            ),
            "b": pa.array([True, False, None, True, False, True, None, False] * 2),
            "Mixed Case": pa.array(range(n), pa.int64()),
        }
    )


TABLE = _rows_table()


def _mask(table: pa.Table, expr: pc.Expression) -> list[bool | None]:
    """`expr` evaluated on every row (pyarrow's semantics)."""
    return pds.dataset(table).to_table(columns={"m": expr})["m"].to_pylist()


def _ids(table: pa.Table, expr: pc.Expression) -> list[int]:
    """The ids of the rows pyarrow's own filtering keeps."""
    return sorted(pds.dataset(table).to_table(filter=expr, columns=["id"])["id"].to_pylist())


@pytest.fixture(scope="module")
def lance_ds(tmp_path_factory: pytest.TempPathFactory) -> lance.LanceDataset:
    return lance.write_dataset(TABLE, str(tmp_path_factory.mktemp("pred") / "t.lance"))


def _lance_ids(ds: lance.LanceDataset, sql: str) -> list[int]:
    return sorted(ds.to_table(filter=sql, columns=["id"])["id"].to_pylist())


# ----------------------------------------------------------------------------------------------
# DataFusion: what it pushes


class _Fragment:
    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def scanner(self, schema=None, columns=None, filter=None, batch_size=None, **kwargs):  # noqa: A002
        return pds.dataset(self.table).scanner(columns=columns, filter=filter)


class _CaptureDataset(pds.Dataset):
    """The smallest Dataset DataFusion accepts; records the filters `get_fragments` receives."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.filters: list[pc.Expression | None] = []

    @property
    def schema(self) -> pa.Schema:
        return self.table.schema

    def scanner(self, columns=None, filter=None, **kwargs):  # noqa: A002
        return pds.dataset(self.table).scanner(columns=columns, filter=filter)

    def get_fragments(self, filter=None):  # noqa: A002
        self.filters.append(filter)
        return [_Fragment(self.table)]


@pytest.fixture(scope="module")
def pushed() -> dict[str, tuple[pc.Expression | None, list[int]]]:
    """Per DATAFUSION_CASES clause: the pushed filter and the ids DataFusion returned."""
    ctx = SessionContext()
    capture = _CaptureDataset(TABLE)
    ctx.register_table("t", capture)
    out = {}
    for where, _ in DATAFUSION_CASES:
        capture.filters.clear()
        ids = ctx.sql(f"SELECT id FROM t WHERE {where}").to_arrow_table()["id"].to_pylist()
        assert len(capture.filters) == 1, where
        out[where] = (capture.filters[0], sorted(ids))
    return out


@pytest.mark.parametrize(("where", "expected"), DATAFUSION_CASES, ids=[c[0] for c in DATAFUSION_CASES])
def test_datafusion_pushed_forms(pushed, lance_ds, where: str, expected: str | None) -> None:
    expr, df_ids = pushed[where]
    assert (None if expr is None else str(expr)) == expected
    if expr is None:
        return
    node = T.decode(expr)
    assert T.to_expression(node).equals(expr)
    assert _ids(TABLE, expr) == df_ids or "random()" in where  # DataFusion applied the rest itself
    assert P.referenced_columns(expr) <= set(TABLE.column_names)
    sql = L.to_lance_filter(expr, TABLE.schema)
    if where == "f IN (1.0, 2.5, 0.0, -1.0)":
        assert sql is None  # pyarrow's is_in tells 0.0 from -0.0, Lance cannot
        return
    assert sql is not None, where
    assert L.to_lance_filter(expr) == sql  # DataFusion's literals carry the column types
    assert _lance_ids(lance_ds, sql) == _ids(TABLE, expr), sql


def test_datafusion_forms_decode_to_expected_trees(pushed) -> None:
    expr, _ = pushed["id IN (1, 2, 3, 4)"]
    node = T.decode(expr)
    assert node == T.Call(
        "is_in", (T.Field("id"),), {"value_set": pa.array([1, 2, 3, 4]), "null_matching_behavior": 0}
    )
    assert T.decode(pushed["id IN (1, NULL)"][0]) == T.Call(
        "or_kleene",
        (T.Call("equal", (T.Field("id"), T.Literal(1, pa.int64())), {}), T.Literal(None, pa.bool_())),
        {},
    )
    assert T.decode(pushed["id IS NULL"][0]) == T.Call("is_null", (T.Field("id"),), {"nan_is_null": False})
    assert T.decode(pushed["NOT b"][0]) == T.Call("invert", (T.Field("b"),), {})
    assert T.decode(pushed["b"][0]) == T.Field("b")
    lit = _call(T.decode(pushed["tsz > '2020-01-02T00:00:00Z'"][0])).args[1]
    assert isinstance(lit, T.Literal)
    assert lit.type == pa.timestamp("us", "UTC") and lit.value == dt.datetime(2020, 1, 2, tzinfo=dt.UTC)
    assert _call(T.decode(pushed["i32 = 5"][0])).args[1] == T.Literal(5, pa.int32())
    lit = _call(T.decode(pushed["s = 'it''s \" : ) ('"][0])).args[1]
    assert isinstance(lit, T.Literal) and lit.value == "it's \" : ) ("
    assert _call(T.decode(pushed["dec = 1.10"][0])).args[1] == T.Literal(
        decimal.Decimal("1.10"), pa.decimal128(10, 2)
    )


def test_datafusion_forms_key_lookups_and_predicates(pushed) -> None:
    def keys(where: str, pk: list[str]) -> Any:
        return P.key_lookups(pushed[where][0], pk)

    assert keys("id = 5", ["id"]) == [(5,)]
    assert keys("5 = id", ["id"]) == [(5,)]
    assert keys("id IN (1, 2, 3)", ["id"]) == [(1,), (2,), (3,)]
    assert keys("id IN (1, 2, 3, 4)", ["id"]) == [(1,), (2,), (3,), (4,)]
    assert keys("id IN (1, NULL)", ["id"]) == [(1,)]
    assert keys("id = 5 AND s = 'a'", ["id"]) == [(5,)]
    assert keys("id = 1 AND k2 = 'x'", ["id", "k2"]) == [(1, "x")]
    assert keys("(id = 1 AND k2 = 'x') OR (id = 2 AND k2 = 'y')", ["id", "k2"]) == [(1, "x"), (2, "y")]
    assert keys("id IN (1, 2) AND k2 = 'x'", ["id", "k2"]) == [(1, "x"), (2, "x")]
    assert len(keys("id IN (1, 2, 3, 4) AND k2 IN ('x', 'y', 'z', 'w')", ["id", "k2"])) == 16
    assert keys("id = 1 AND k2 = 'x'", ["k2", "id"]) == [("x", 1)]
    for where in ("id <> 5", "id < 3", "id = 1 OR s = 'a'", "id NOT IN (1, 2, 3, 4)", "id BETWEEN 2 AND 4"):
        assert keys(where, ["id"]) is None, where
    assert keys("id = 5", ["id", "k2"]) is None

    def preds(where: str) -> dict:
        return P.column_predicates(pushed[where][0])

    assert preds("id = 5") == {"id": [Eq(5)]}
    assert preds("id BETWEEN 2 AND 4") == {"id": [Range(2, True, 4, True)]}
    assert preds("id IN (1, 2, 3)") == {"id": [In([1, 2, 3])]}
    assert preds("id IN (1, NULL)") == {"id": [Eq(1)]}
    assert (
        preds("id NOT BETWEEN 2 AND 4") == {"id": [Range(None, True, None, True)]}
        or preds("id NOT BETWEEN 2 AND 4") == {}
    )
    assert preds("d BETWEEN '2020-01-01' AND '2020-01-03'") == {
        "d": [Range(dt.date(2020, 1, 1), True, dt.date(2020, 1, 3), True)]
    }
    assert preds("b") == {"b": [Eq(True)]} and preds("NOT b") == {"b": [Eq(False)]}
    assert preds("f = 'NaN'::double") == {"f": [In([])]}
    assert preds("id > 1 AND id < 4 AND s IS NOT NULL") == {"id": [Range(1, False, 4, False)]}
    assert preds("(id = 1 AND k2 = 'x') OR (id = 2 AND k2 = 'y')") == {
        "id": [In([1, 2])],
        "k2": [In(["x", "y"])],
    }
    assert preds("id <> 5") == {} and preds("id IS NULL") == {}


# ----------------------------------------------------------------------------------------------
# The serialized layout


def test_ordered_metadata_keeps_duplicates_in_order() -> None:
    expr = ((F("a") == 5) & F("b").isin(["x", None])) | ~(F("c", "d") > pc.scalar(2.5))
    _, (buf,) = expr.__reduce__()
    items = T._ordered_metadata(buf)
    assert items == [
        ("call", "or_kleene"),
        ("call", "and_kleene"),
        ("call", "equal"),
        ("field_ref", "a"),
        ("literal", "0"),
        ("end", "equal"),
        ("call", "is_in"),
        ("field_ref", "b"),
        ("options", "1"),
        ("end", "is_in"),
        ("end", "and_kleene"),
        ("call", "invert"),
        ("call", "greater"),
        ("nested_field_ref", "2"),
        ("field_ref", "c"),
        ("field_ref", "d"),
        ("literal", "2"),
        ("end", "greater"),
        ("end", "invert"),
        ("end", "or_kleene"),
    ]
    # pyarrow's own view agrees, but folds the repeated keys into a dict
    schema = pa.ipc.open_file(buf).schema
    listed = schema.to_string(show_schema_metadata=True, truncate_metadata=False).split(
        "-- schema metadata --\n"
    )
    assert [tuple(line.split(": ", 1)) for line in listed[1].splitlines()] == [
        (k, f"'{v}'") for k, v in items
    ]
    assert len(schema.metadata) < len(items)


def test_decode_literals_and_options() -> None:
    weird = "a') or (\"b\" == 'c' and x\n\x00ü"
    node = T.decode(F("s") == weird)
    assert node == T.Call("equal", (T.Field("s"), T.Literal(weird, pa.string())), {})
    node = T.decode(F("st", "x", "y").is_null(nan_is_null=True))
    assert node == T.Call("is_null", (T.Field("st", ("x", "y")),), {"nan_is_null": True})
    assert P.referenced_columns(F("st", "x") == 1) == {"st"}
    call = _call(T.decode(F("a").cast(pa.int32())))
    assert call.function == "cast" and call.options["to_type"] == pa.int32()
    call = _call(T.decode(pc.match_substring(F("s"), "ab", ignore_case=True)))
    assert call.options == {"pattern": "ab", "ignore_case": True}
    assert T.decode(pc.scalar(True)) == T.Literal(True, pa.bool_())
    for expr in (
        F("st", "x").is_null(nan_is_null=True),
        F("a").cast(pa.int32()),
        pc.match_substring(F("s"), "ab", ignore_case=True),
        pc.utf8_length(F("s")) > 3,
        pc.scalar(pa.scalar(1577836800000000001, pa.timestamp("ns"))) == F("t"),
        F("x") == pa.scalar([1, 2], pa.list_(pa.int8())),
        F("m") == pa.scalar(dt.timedelta(days=1, microseconds=3)),
    ):
        assert T.to_expression(T.decode(expr)).equals(expr), expr


def test_decode_rejects_what_does_not_serialize() -> None:
    with pytest.raises(ValueError, match="non-name"):
        T.decode(F(0) == 1)
    with pytest.raises(TypeError):
        T.decode("id = 1")
    with pytest.raises(ValueError):
        T._ordered_metadata(b"not an arrow file")
    _, (buf,) = (F("a") == 1).__reduce__()
    data = bytearray(buf.to_pybytes())
    data[-10:-6] = (len(data) * 2).to_bytes(4, "little")
    with pytest.raises(ValueError):
        T._ordered_metadata(bytes(data))


def test_hand_built_calls_rebuild() -> None:
    for behavior in range(4):
        call = T.Call(
            "is_in",
            (T.Field("i"),),
            {"value_set": pa.array([1, None]), "null_matching_behavior": behavior},
        )
        expr = T.to_expression(call)
        assert T.decode(expr) == call
    assert T.to_expression(T.Call("is_null", (T.Field("f"),), {"nan_is_null": True})).equals(
        F("f").is_null(nan_is_null=True)
    )
    assert T.to_expression(T.Literal(dt.date(2020, 1, 2), pa.date32())).equals(pc.scalar(dt.date(2020, 1, 2)))


def test_conjuncts() -> None:
    a, b, c = F("a") == 1, F("b") > 2, F("c").is_valid()
    assert [str(x) for x in P.conjuncts((a & b) & c)] == [str(a), str(b), str(c)]
    assert [x.equals(y) for x, y in zip(P.conjuncts(a & (b & c)), (a, b, c), strict=True)] == [True] * 3
    non_kleene = pc.Expression._call("and", [a, b])
    assert [str(x) for x in P.conjuncts(non_kleene)] == [str(a), str(b)]
    assert P.conjuncts(a | b)[0].equals(a | b)
    assert P.conjuncts(None) == []


# ----------------------------------------------------------------------------------------------
# Hypothesis: random expressions on random tables

COLUMN_TYPES = {
    "i": pa.int64(),
    "i32": pa.int32(),
    "s": pa.string(),
    "f": pa.float64(),
    "d": pa.date32(),
    "b": pa.bool_(),
}
_VALUES = {
    "i": st.integers(-4, 6) | st.sampled_from([2**63 - 1, -(2**63)]),
    "i32": st.integers(-8, 6),
    "s": st.sampled_from(["", "a", "b", "b'c", 'x"y', "\\", "ü", "a b", "(", "and", "it's"])
    | st.text(max_size=3),
    "f": st.sampled_from([0.0, -0.0, NAN, NEG_NAN, INF, -INF, 1.5, -2.0, 2.5, 1e300])
    | st.floats(-3, 3, width=64).map(lambda x: round(x, 1)),
    "d": st.dates(dt.date(2019, 12, 26), dt.date(2020, 1, 14)),
    "b": st.booleans(),
}
_CMP = ["equal", "not_equal", "less", "less_equal", "greater", "greater_equal"]


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 12))
    cols = {"id": pa.array(range(n), pa.int64())}
    for c, t in COLUMN_TYPES.items():
        cols[c] = pa.array(draw(st.lists(st.none() | _VALUES[c], min_size=n, max_size=n)), t)
    return pa.table(cols)


def _comparison(col: str, value: Any, op: str, flip: bool) -> pc.Expression:
    lit = pc.scalar(pa.scalar(value, COLUMN_TYPES[col]))
    args = [lit, F(col)] if flip else [F(col), lit]
    return pc.Expression._call(T.SWAPPED_COMPARISON[op] if flip else op, args)


def _is_in(col: str, values: list[Any], behavior: int) -> pc.Expression:
    value_set = pa.array(values, COLUMN_TYPES[col])
    return T.to_expression(
        T.Call("is_in", (T.Field(col),), {"value_set": value_set, "null_matching_behavior": behavior})
    )


@st.composite
def comparisons(draw: st.DrawFn, columns: tuple[str, ...] = tuple(COLUMN_TYPES)) -> pc.Expression:
    col = draw(st.sampled_from(columns))
    value = draw(st.none() | _VALUES[col]) if draw(st.integers(0, 9)) == 0 else draw(_VALUES[col])
    return _comparison(col, value, draw(st.sampled_from(_CMP)), draw(st.booleans()))


@st.composite
def memberships(draw: st.DrawFn, columns: tuple[str, ...] = tuple(COLUMN_TYPES)) -> pc.Expression:
    col = draw(st.sampled_from(columns))
    values = draw(st.lists(st.none() | _VALUES[col], max_size=4))
    return _is_in(col, values, draw(st.integers(0, 3)))


def _leaves(columns: tuple[str, ...] = tuple(COLUMN_TYPES)) -> st.SearchStrategy[pc.Expression]:
    return st.one_of(
        comparisons(columns),
        comparisons(columns),
        memberships(columns),
        st.sampled_from(columns).map(lambda c: F(c).is_valid()),
        st.tuples(st.sampled_from(columns), st.booleans()).map(lambda t: F(t[0]).is_null(nan_is_null=t[1])),
        st.just(F("b")),
        st.sampled_from([True, False, None]).map(lambda v: pc.scalar(pa.scalar(v, pa.bool_()))),
    )


def _combine(children: st.SearchStrategy[pc.Expression], kleene_only: bool = False) -> st.SearchStrategy:
    pairs = st.tuples(children, children)
    ops = [
        pairs.map(lambda p: p[0] & p[1]),
        pairs.map(lambda p: p[0] | p[1]),
        children.map(lambda e: ~e),
    ]
    if not kleene_only:
        ops += [
            pairs.map(lambda p: pc.Expression._call("and", list(p))),
            pairs.map(lambda p: pc.Expression._call("or", list(p))),
        ]
    return st.one_of(*ops)


def expressions(
    kleene_only: bool = False, columns: tuple[str, ...] = tuple(COLUMN_TYPES)
) -> st.SearchStrategy:
    return st.recursive(_leaves(columns), lambda ch: _combine(ch, kleene_only), max_leaves=8)


@SETTINGS
@given(expr=expressions(), table=tables())
def test_decode_round_trip(expr: pc.Expression, table: pa.Table) -> None:
    node = T.decode(expr)
    rebuilt = T.to_expression(node)
    # Expression.equals compares is_in value sets with NaN != NaN
    assert rebuilt.equals(expr) or ("nan" in str(expr) and str(rebuilt) == str(expr))
    assert _mask(table, rebuilt) == _mask(table, expr)
    # the referenced columns are enough to evaluate it
    cols = sorted(P.referenced_columns(expr))
    assert _mask(table.select(cols), expr) == _mask(table, expr)
    # filtering by every conjunct keeps exactly the rows the whole filter keeps
    kept = set(_ids(table, expr))
    parts = P.conjuncts(expr)
    assert set.intersection(set(table["id"].to_pylist()), *(set(_ids(table, c)) for c in parts)) == kept


def _matching_rows(table: pa.Table, expr: pc.Expression) -> list[dict[str, Any]]:
    return [row for row, m in zip(table.to_pylist(), _mask(table, expr), strict=True) if m is True]


@SETTINGS
@given(expr=expressions(), table=tables())
def test_column_predicates_sound(expr: pc.Expression, table: pa.Table) -> None:
    preds = P.column_predicates(expr)
    for col, ps in preds.items():
        assert col in COLUMN_TYPES and ps
    for row in _matching_rows(table, expr):
        for col, ps in preds.items():
            for p in ps:
                assert p.test(row[col]), (col, p, row[col])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(expr=expressions(kleene_only=True), table=tables())
def test_column_predicates_prune_regions_soundly(expr: pc.Expression, table: pa.Table) -> None:
    ids = {name: i for i, name in enumerate(table.column_names)}
    spec = (
        rs.identity("s", field_id="s")
        + rs.bucket("i", 8, field_id="bi")
        + rs.month("d", field_id="m")
        + rs.identity("f", field_id="f")
        + rs.bucket("i32", 4, field_id="b32")
    ).bind(ids, table.schema, primary_key=table.column_names)
    per_row = list(zip(*(a.to_pylist() for a in spec.evaluate(table, ids)), strict=True))
    kept = spec.prune(per_row, P.column_predicates(expr))
    for m, region in zip(_mask(table, expr), per_row, strict=True):
        if m is True:
            assert region in kept


def test_column_predicates_cases() -> None:
    cp = P.column_predicates
    assert cp(None) == {}
    assert cp((F("i") >= 2) & (F("i") < 9) & (F("i") > 3)) == {"i": [Range(3, False, 9, False)]}
    assert cp((F("i") > 5) & (F("i") < 2)) == {"i": [In([])]}
    assert cp(F("i").isin([1, 2, 3]) & (F("i") >= 2)) == {"i": [In([2, 3])]}
    assert cp(F("i").isin([1, 2]) & (F("i") == 2)) == {"i": [Eq(2)]}
    assert cp(F("i").isin([1, None])) == {}  # NULL rows match too
    assert cp(_is_in("i", [1, None], 2)) == {"i": [Eq(1)]}  # EMIT_NULL: a NULL row gives NULL
    assert cp(_is_in("i", [None], 1)) == {"i": [In([])]}
    assert cp((F("i") < 2) | (F("i") > 7)) == {}
    assert cp((F("i") == 2) | (F("i") > 7)) == {"i": [Range(2, True, None, True)]}
    assert cp((F("i") >= 1) & (F("i") <= 3) | (F("i") == 9)) == {"i": [Range(1, True, 9, True)]}
    assert cp((F("i") == 1) | pc.scalar(pa.scalar(False))) == {"i": [Eq(1)]}
    assert cp((F("i") == 1) | pc.scalar(True)) == {}
    assert cp((F("i") == pa.scalar(None, pa.int64())) & (F("s") == "a")) == {"i": [In([])], "s": [In([])]}
    assert cp(F("f") > NAN) == {"f": [In([])]}
    assert cp(F("f") != NAN) == {}
    assert cp(pc.scalar(3) > F("i")) == {"i": [Range(None, True, 3, False)]}
    assert cp(F("st", "x") == 1) == {}


# ----------------------------------------------------------------------------------------------
# Primary-key lookups


def test_key_lookups_cases() -> None:
    kl = P.key_lookups
    assert kl(None, ["id"]) is None
    assert kl(F("id") == 1, ["id"]) == [(1,)]
    assert kl(pc.scalar(1) == F("id"), ["id"]) == [(1,)]
    assert kl(F("id").isin([3, None, 1, 3]), ["id"]) == [(3,), (1,)]
    assert kl(F("id").isin(pa.array([], pa.int64())), ["id"]) == []
    assert kl((F("id") == 1) | (F("id") == 2) | F("id").isin([2, 5]), ["id"]) == [(1,), (2,), (5,)]
    assert kl((F("id") == 1) & (F("v") > 3), ["id"]) == [(1,)]
    assert kl((F("id") == 1) & (F("id") == 2), ["id"]) == []
    assert kl((F("id") == 1) | (F("v") > 3), ["id"]) is None
    assert kl(F("id") != 1, ["id"]) is None
    assert kl(~(F("id") == 1), ["id"]) is None
    assert kl(F("id") == pa.scalar(None, pa.int64()), ["id"]) == []
    assert kl(pc.scalar(pa.scalar(False)), ["id"]) == []
    assert kl((F("id") == 1) | pc.scalar(pa.scalar(None, pa.bool_())), ["id"]) == [(1,)]
    assert kl(F("id") == "x'y", ["id"]) == [("x'y",)]
    assert kl(F("id") == 0.0, ["id"]) is None  # -0.0 == 0.0
    assert kl(F("id") == 1.5, ["id"]) == [(1.5,)]
    composite = ["a", "b"]
    assert kl((F("a") == 1) & (F("b") == "x"), composite) == [(1, "x")]
    assert kl((F("b") == "x") & (F("a") == 1), composite) == [(1, "x")]
    assert kl(F("a").isin([1, 2]) & (F("b") == "x") & (F("c") < 0), composite) == [(1, "x"), (2, "x")]
    assert kl(((F("a") == 1) | (F("a") == 2)) & F("b").isin(["x", "y"]), composite) == [
        (1, "x"),
        (1, "y"),
        (2, "x"),
        (2, "y"),
    ]
    assert kl(((F("a") == 1) & (F("b") == "x")) | ((F("a") == 2) & (F("b") == "y")), composite) == [
        (1, "x"),
        (2, "y"),
    ]
    assert kl(F("a") == 1, composite) is None
    assert kl(((F("a") == 1) & (F("b") == "x")) | (F("a") == 2), composite) is None
    assert kl(F("a", "z") == 1, ["a"]) is None
    with pytest.raises(ValueError):
        kl(F("a") == 1, [])
    big = F("a").isin(list(range(2000))) & F("b").isin([str(i) for i in range(1000)])
    assert kl(big, composite) is None  # past MAX_KEY_LOOKUPS


_KEY_VALUES = {"k1": st.integers(0, 4), "k2": st.sampled_from(["x", "y", "z", "w"]), "v": st.integers(0, 4)}
_KEY_TYPES = {"k1": pa.int64(), "k2": pa.string(), "v": pa.int64()}


@st.composite
def key_leaves(draw: st.DrawFn, pure: bool) -> pc.Expression:
    col = draw(st.sampled_from(["k1", "k2"] if pure else ["k1", "k2", "v"]))
    kind = draw(st.integers(0, 1 if pure else 4))
    if kind == 0:
        lit = pc.scalar(pa.scalar(draw(_KEY_VALUES[col]), _KEY_TYPES[col]))
        return (lit == F(col)) if draw(st.booleans()) else (F(col) == lit)
    if kind == 1:
        values = draw(st.lists(st.none() | _KEY_VALUES[col], max_size=4))
        value_set = pa.array(values, _KEY_TYPES[col])
        return T.to_expression(
            T.Call(
                "is_in",
                (T.Field(col),),
                {"value_set": value_set, "null_matching_behavior": draw(st.integers(0, 3))},
            )
        )
    if kind == 2:
        value = pa.scalar(draw(_KEY_VALUES[col]), _KEY_TYPES[col])
        return pc.Expression._call(draw(st.sampled_from(_CMP)), [F(col), pc.scalar(value)])
    if kind == 3:
        return pc.scalar(pa.scalar(draw(st.sampled_from([True, False, None])), pa.bool_()))
    return F(col).is_null()


def key_expressions(pure: bool) -> st.SearchStrategy[pc.Expression]:
    def combine(ch: st.SearchStrategy) -> st.SearchStrategy:
        pairs = st.tuples(ch, ch)
        ops = [pairs.map(lambda p: p[0] & p[1]), pairs.map(lambda p: p[0] | p[1])]
        if not pure:
            ops += [ch.map(lambda e: ~e), pairs.map(lambda p: pc.Expression._call("and", list(p)))]
        return st.one_of(*ops)

    return st.recursive(key_leaves(pure), combine, max_leaves=6)


# every key in a small domain, with every value of v: the brute-force reference
KEY_TABLE = pa.table(
    {
        "k1": pa.array([k1 for k1 in range(4) for _ in "xyz" for _ in range(4)], pa.int64()),
        "k2": pa.array([k2 for _ in range(4) for k2 in "xyz" for _ in range(4)]),
        "v": pa.array([v for _ in range(4) for _ in "xyz" for v in range(4)], pa.int64()),
    }
)


def _check_keys(expr: pc.Expression, pure: bool) -> None:
    matches = _matching_rows(KEY_TABLE, expr)
    for pk in (["k1", "k2"], ["k1"], ["k2", "k1"]):
        got = P.key_lookups(expr, pk)
        if got is None:
            continue
        assert len(set(got)) == len(got)
        keys = {tuple(r[c] for c in pk) for r in matches}
        assert keys <= set(got), (pk, keys, got)  # sound
        if pure and P.referenced_columns(expr) <= set(pk):
            # only key predicates: every listed key that exists matches (the set is exact)
            universe = {tuple(r[c] for c in pk) for r in KEY_TABLE.to_pylist()}
            assert set(got) & universe == keys


@SETTINGS
@given(expr=key_expressions(pure=False))
def test_key_lookups_sound(expr: pc.Expression) -> None:
    _check_keys(expr, pure=False)


@SETTINGS
@given(expr=key_expressions(pure=True))
def test_key_lookups_exact_for_key_predicates(expr: pc.Expression) -> None:
    _check_keys(expr, pure=True)


# ----------------------------------------------------------------------------------------------
# Lance filters


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(expr=expressions())
def test_to_lance_filter_matches_pyarrow(lance_ds, expr: pc.Expression) -> None:
    want = _ids(TABLE, expr)
    for schema in (TABLE.schema, None):
        sql = L.to_lance_filter(expr, schema)
        if sql is None:
            node = T.decode(expr)
            reasons = [
                n
                for n in P._walk(node)
                if isinstance(n, T.Call)
                and (
                    n.function in ("and", "or")
                    or (n.function == "is_in" and n.args[0] == T.Field("f"))
                    or (schema is None and n.function == "is_null" and n.options["nan_is_null"])
                )
            ]
            assert reasons, f"unexpected None for {expr}"
            continue
        assert _lance_ids(lance_ds, sql) == want, (str(expr), sql)


def test_to_lance_filter_cases(lance_ds) -> None:
    schema = TABLE.schema
    cases = [
        F("u64") == pa.scalar(2**64 - 1, pa.uint64()),
        F("u64") > pa.scalar(2**63 - 1, pa.uint64()),
        F("i") == pa.scalar(-(2**63), pa.int64()),
        F("f32") == pa.scalar(0.1, pa.float32()),
        F("f32") < pa.scalar(0.0, pa.float32()),
        F("f32").isin(pa.array([1.5, 3], pa.float32())),
        F("f") >= pa.scalar(-0.0),
        F("f") <= INF,
        F("f") > -INF,
        F("f") == 1e300,
        F("f").is_null(nan_is_null=True),
        pc.is_nan(F("f")),
        ~pc.is_nan(F("f")),
        F("ls") == pa.scalar("a", pa.large_string()),
        F("ls").isin(pa.array(["a", "b'c", None], pa.large_string())),
        F("bin") == b"nul\x00",
        F("bin").isin([b"a", b""]),
        F("tsn") == pa.scalar(1577836801000000007, pa.timestamp("ns")),
        F("tsn") > pa.scalar(1577836805000000000, pa.timestamp("ns")),
        F("tsz") == pa.scalar(dt.datetime(2020, 1, 2, tzinfo=dt.UTC), pa.timestamp("us", "UTC")),
        F("tsz") < pa.scalar(dt.datetime(2020, 1, 2, 5, tzinfo=dt.UTC), pa.timestamp("ms", "UTC")),
        F("ts") >= pa.scalar(dt.datetime(2020, 1, 3, 4), pa.timestamp("s")),
        F("d") == pa.scalar(dt.date(2020, 1, 1)),
        F("dec") < pa.scalar(decimal.Decimal("-0.45"), pa.decimal128(10, 2)),
        F("dec").isin(pa.array([decimal.Decimal("-3.00"), decimal.Decimal("2.50")], pa.decimal128(10, 2))),
        F("b").isin([True, None]),
        F("b") == pa.scalar(False),
        F("i") == F("i32"),
        F("i32") < F("i"),
        F("s") == F("ls"),
        F("Mixed Case") == 3,
        (F("id") > 3) & (F("s") != "and") | F("b"),
    ]
    for expr in cases:
        sql = L.to_lance_filter(expr, schema)
        assert sql is not None, expr
        assert _lance_ids(lance_ds, sql) == _ids(TABLE, expr), (str(expr), sql)


def test_to_lance_filter_other_types(tmp_path) -> None:
    table = pa.table(
        {
            "id": [1, 2, 3],
            "t64": pa.array([dt.time(1), dt.time(2, 0, 0, 5), None], pa.time64("us")),
            "t32": pa.array([dt.time(1), dt.time(2), None], pa.time32("ms")),
            "dur": pa.array([dt.timedelta(1), dt.timedelta(2, microseconds=1), None], pa.duration("us")),
            "d64": pa.array([dt.date(2020, 1, 1), dt.date(2020, 1, 2), None], pa.date64()),
            "fsb": pa.array([b"ab", b"cd", None], pa.binary(2)),
            "tsz": pa.array([1, 2, None], pa.timestamp("s", "+05:00")),
        }
    )
    ds = lance.write_dataset(table, str(tmp_path / "other.lance"))
    cases = [
        F("t64") == pa.scalar(dt.time(2, 0, 0, 5), pa.time64("us")),
        F("t32") < pa.scalar(dt.time(2), pa.time32("ms")),
        F("dur") >= pa.scalar(dt.timedelta(2, microseconds=1), pa.duration("us")),
        F("d64") == pa.scalar(dt.date(2020, 1, 2), pa.date64()),
        F("fsb") == pa.scalar(b"cd", pa.binary(2)),
        F("tsz") > pa.scalar(1, pa.timestamp("s", "+05:00")),
    ]
    for expr in cases:
        sql = L.to_lance_filter(expr, table.schema)
        assert sql is not None and L.to_lance_filter(expr) == sql, expr
        assert _lance_ids(ds, sql) == _ids(table, expr), (str(expr), sql)


def test_to_lance_filter_declines() -> None:
    schema = TABLE.schema
    assert L.to_lance_filter(None) is None
    assert L.to_lance_filter(pc.Expression._call("and", [F("b"), F("b")])) is None
    assert L.to_lance_filter(F("f").isin([1.0, 0.0])) is None
    assert L.to_lance_filter(F("f").isin([NAN])) is None
    assert L.to_lance_filter(F("f").is_null(nan_is_null=True)) is None  # type unknown
    assert L.to_lance_filter(F("i") == F("i32")) is None  # types unknown
    assert L.to_lance_filter(F("f") == F("f32"), schema) is None
    assert L.to_lance_filter(pc.utf8_length(F("s")) > 1) is None
    assert L.to_lance_filter(F("x") == pa.scalar(decimal.Decimal("1"), pa.decimal256(40, 0))) is None
    assert L.to_lance_filter(F("nope") == 1, schema) is None
    assert L.to_lance_filter(F("s") == 1, schema) is None  # type families differ
    assert L.to_lance_filter(F("a`b") == 1) is None
    assert L.to_lance_filter(F("i") + 1 == 2) is None


def test_lance_expression_route_is_not_enough(lance_ds, tmp_path) -> None:
    """Why to_lance_filter writes SQL: the pc.Expression route answers differently or fails."""
    expr = F("f") > 1.0
    assert sorted(lance_ds.to_table(filter=expr, columns=["id"])["id"].to_pylist()) != _ids(TABLE, expr)
    expr = ~F("i32").isin([1, 2, 3, 4])
    assert sorted(lance_ds.to_table(filter=expr, columns=["id"])["id"].to_pylist()) != _ids(TABLE, expr)
    with_duration = lance.write_dataset(
        pa.table({"id": [1, 2], "dur": pa.array([1, 2], pa.duration("us"))}), str(tmp_path / "dur.lance")
    )
    with pytest.raises(Exception, match="substrait"):
        with_duration.to_table(filter=F("id") == 1)
    assert with_duration.to_table(filter=L.to_lance_filter(F("id") == 1))["id"].to_pylist() == [1]


def test_literal_sql_is_exact_for_floats() -> None:
    for v in (0.1, 1e-310, 1e300, -2.5, 1 / 3, INF, -INF):
        sql = L._literal_sql(pa.scalar(v))
        inner = sql.split("'")[1]
        assert float(inner) == v or (math.isnan(v) and math.isnan(float(inner)))
    assert np.float32(float(L._literal_sql(pa.scalar(0.1, pa.float32())).split("'")[1])) == np.float32(0.1)
