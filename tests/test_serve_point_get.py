"""Point gets through `memwal serve` (`SELECT ... FROM t WHERE pk = v / IN (...)`, answered by the
table's point lookup without DataFusion planning them): which statements take that path, and that
their answers (rows, columns, types) are DataFusion's and a dict model's, across MemTables,
flushes, merges and deletes, by a server whose reader lives through all of them."""

from __future__ import annotations

from datetime import timedelta

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.serving import connect, count_planning, make_table, query, rows

import memwal_df as mw
from memwal_df import serve
from memwal_df.server.point_get import PointGet, recognize
from memwal_df.server.statements import tokens
from memwal_df.server.status import InvalidRequest


def _values(text: str) -> tuple[str, ...]:
    get = recognize(text)
    assert get is not None, text
    return tuple(t.text for t in get.values)


@pytest.mark.parametrize(
    ("text", "table", "columns", "key", "values"),
    [
        ("SELECT * FROM t WHERE id = 5", "t", None, "id", ("5",)),
        ("select Name, ID from T where ID = -5;", "t", ("name", "id"), "id", ("-5",)),
        ('SELECT "Name" FROM "My T" WHERE "K" IN (1, $1, \'a\')', "My T", ("Name",), "K", ("1", "$1", "'a'")),
        ("SELECT * FROM t WHERE k = 'it''s'", "t", None, "k", ("'it''s'",)),
    ],
)
def test_the_point_get_shape_is_recognized(text, table, columns, key, values):
    get = recognize(text)
    assert isinstance(get, PointGet)
    assert (get.table, get.columns, get.key) == (table, columns, key)
    assert _values(text) == values


@pytest.mark.parametrize(
    "text",
    [
        "SELECT * FROM t WHERE id = 5 LIMIT 1",
        "SELECT * FROM t WHERE id = 5 AND name = 'x'",
        "SELECT * FROM t WHERE id = 5 OR id = 6",
        "SELECT * FROM t WHERE id > 5",
        "SELECT * FROM t WHERE 5 = id",
        "SELECT * FROM t WHERE id = 5.0",
        "SELECT * FROM t WHERE id = 1e3",
        "SELECT * FROM t WHERE id = NULL",
        "SELECT * FROM t WHERE id = abs(-5)",
        "SELECT * FROM t WHERE id IN (SELECT id FROM t)",
        "SELECT * FROM t WHERE id IN ()",
        "SELECT * FROM public.t WHERE id = 5",
        "SELECT * FROM t WHERE t.id = 5",
        "SELECT id AS x FROM t WHERE id = 5",
        "SELECT DISTINCT id FROM t WHERE id = 5",
        "SELECT count(*) FROM t WHERE id = 5",
        "SELECT t.* FROM t WHERE id = 5",
        "SELECT * FROM t, u WHERE id = 5",
        "SELECT * FROM t JOIN u ON true WHERE id = 5",
        "SELECT * FROM t WHERE id = - - 5",
        "WITH x AS (SELECT 1) SELECT * FROM t WHERE id = 5",
    ],
)
def test_other_statements_are_left_to_datafusion(text):
    assert tokens(text)  # they tokenize
    assert recognize(text) is None


@pytest.fixture
def both(tmp_path):
    """A server over an integer-keyed table `t` (base rows 100..109) and a string-keyed table `s`,
    with the caller's own context (for DataFusion's answers to compare with)."""
    make_table(str(tmp_path / "t"), rows(list(range(100, 110)), "base"))
    mw.create_table(
        str(tmp_path / "s"),
        pa.table({"k": ["a", "b", "it's"], "v": pa.array([1, 2, 3], pa.int32())}),
        primary_key="k",
    )
    ctx = mw.register(datafusion.SessionContext())
    with serve({"t": str(tmp_path / "t"), "s": str(tmp_path / "s")}, ctx=ctx) as server:
        yield server, ctx


@pytest.fixture
def served_tables(both):
    """The served tables of `both` by name."""
    server, _ = both
    return server.tables


def _datafusion(ctx: datafusion.SessionContext, text: str, params: tuple[object, ...] = ()) -> pa.Table:
    """DataFusion's answer to `text` with its `?` replaced by the literals of `params`."""
    for p in params:
        literal = "NULL" if p is None else "'" + p.replace("'", "''") + "'" if isinstance(p, str) else str(p)
        text = text.replace("?", literal, 1)
    return ctx.sql(text).to_arrow_table()


def _same(got: pa.Table, expected: pa.Table) -> None:
    assert got.schema.equals(expected.schema), (got.schema, expected.schema)
    assert sorted(got.to_pylist(), key=repr) == sorted(expected.to_pylist(), key=repr)


POINT_GETS: list[tuple[str, tuple[object, ...]]] = [
    ("SELECT * FROM t WHERE id = 101", ()),  # base
    ("SELECT * FROM t WHERE id = 1", ()),  # MemTable
    ("SELECT * FROM t WHERE id = 2", ()),  # deleted in the MemTable
    ("SELECT * FROM t WHERE id = 102", ()),  # base row deleted
    ("SELECT * FROM t WHERE id = 3", ()),  # flushed generation
    ("SELECT * FROM t WHERE id = 999", ()),  # absent
    ("SELECT * FROM t WHERE id = -7", ()),
    ("SELECT vec, id FROM t WHERE id IN (1, 101, 101, 3, 2, 999)", ()),
    ("select NAME from T where ID = 105;", ()),
    ('SELECT "name" FROM "t" WHERE "id" = 104', ()),
    ("SELECT * FROM t WHERE id = ?", (103,)),
    ("SELECT name FROM t WHERE id IN (?, ?)", (1, 104)),
    ("SELECT * FROM s WHERE k = 'it''s'", ()),
    ("SELECT v, k FROM s WHERE k IN ('a', 'zz', ?)", ("b",)),
]

FALLBACKS: list[tuple[str, tuple[object, ...]]] = [
    ("SELECT * FROM t WHERE id = 9223372036854775808", ()),  # beyond int64: DataFusion decides
    ("SELECT * FROM s WHERE k = 1", ()),  # a number for a string key
    ("SELECT * FROM t WHERE id = ?", ("101",)),  # a string bound for an integer key
    ("SELECT * FROM t WHERE id = ?", (None,)),  # NULL matches nothing
    ("SELECT id FROM t WHERE id = 1 AND name = 'r1'", ()),
]


def _prepare_state(server: mw.Server) -> None:
    writer = server.tables["t"].writer
    writer.put(rows([3], "gen"))
    writer.flush()
    writer.put(rows([1, 2], "mem"))
    writer.delete(pa.table({"id": [2, 102]}))


def test_point_gets_answer_as_datafusion_does_without_planning(both):
    server, ctx = both
    _prepare_state(server)
    planned = count_planning(server)
    with connect(server.url) as conn:
        for text, params in POINT_GETS:
            _same(query(conn, text, params or None), _datafusion(ctx, text, params))
        assert planned == []  # none of them went through DataFusion
        for text, params in FALLBACKS:
            try:
                expected = _datafusion(ctx, text, params)
            except Exception:  # noqa: BLE001 - the server must refuse it too
                with pytest.raises(Exception):  # noqa: B017, PT011
                    query(conn, text, params or None)
                continue
            _same(query(conn, text, params or None), expected)
        assert len(planned) >= len(FALLBACKS)


def test_an_unknown_column_or_table_gets_datafusions_error(both):
    server, _ = both
    with connect(server.url) as conn:
        with pytest.raises(Exception, match="nope"):  # noqa: PT011 - ADBC's error classes vary
            query(conn, "SELECT nope FROM t WHERE id = 1")
        with pytest.raises(Exception, match="(?i)nope"):  # noqa: PT011
            query(conn, "SELECT * FROM nope WHERE id = 1")
        assert query(conn, "SELECT id FROM t WHERE id = 101").column(0).to_pylist() == [101]


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"), st.lists(st.integers(0, 30), min_size=1, max_size=6), st.text("ab", max_size=2)
        ),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 30), min_size=1, max_size=4), st.just("")),
        st.tuples(st.just("flush"), st.just([]), st.just("")),
        st.tuples(st.just("merge"), st.just([]), st.just("")),
        st.tuples(st.just("get"), st.lists(st.integers(-2, 32), min_size=1, max_size=5), st.just("")),
    ),
    max_size=25,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_point_gets_follow_a_model_across_flushes_and_merges(tmp_path_factory, ops):
    uri = str(tmp_path_factory.mktemp("pg") / "t")
    make_table(uri, rows(list(range(0, 10)), "base"))
    model = {i: f"base{i}" for i in range(10)}
    table = mw.open_table(uri)
    with serve({"t": uri}) as server, connect(server.url) as conn:
        writer = server.tables["t"].writer
        for op, keys, tag in ops:
            if op == "put":
                keys = list(dict.fromkeys(keys))
                writer.put(rows(keys, "p" + tag))
                model.update({k: f"p{tag}{k}" for k in keys})
            elif op == "delete":
                writer.delete(pa.table({"id": pa.array(keys, pa.int64())}))
                for k in keys:
                    model.pop(k, None)
            elif op == "flush":
                writer.flush()
            elif op == "merge":
                writer.flush()
                table.merge()
                table.gc(grace=timedelta(0))
            else:
                listed = ", ".join(str(k) for k in keys)
                text = (
                    f"SELECT id, name FROM t WHERE id = {keys[0]}"
                    if len(keys) == 1
                    else (f"SELECT id, name FROM t WHERE id IN ({listed})")
                )
                got = query(conn, text).sort_by("id").to_pylist()
                expected = [{"id": k, "name": model[k]} for k in sorted(set(keys)) if k in model]
                assert got == expected, (text, got, expected)


VALUES = st.sampled_from(
    ["5", "-5", "101", "9223372036854775808", "'a'", "'it''s'", "''", "$1", "$2", "1.5", "NULL"]
)
SHAPED = st.builds(
    lambda cols, where, values, use_in, tail: (
        f"SELECT {cols} FROM {where[0]} WHERE {where[1]} "
        + (f"IN ({', '.join(values)})" if use_in else f"= {values[0]}")
        + tail
    ),
    st.sampled_from(["*", "*", "id", "name, id", "k", "v, k", '"id"', "id, id", "nope"]),
    st.sampled_from([("t", "id"), ("s", "k"), ("T", "ID"), ('"t"', '"id"'), ("t", "k"), ("nope", "id")]),
    st.lists(VALUES, min_size=1, max_size=4),
    st.booleans(),
    st.sampled_from(["", "", ";", " LIMIT 1"]),
)
SOUP = st.lists(
    st.sampled_from(
        ["SELECT", "*", "id", ",", "FROM", "t", "WHERE", "=", "IN", "(", ")", "-", "5", "'a", "$1", "?"]
    ),
    max_size=12,
).map(" ".join)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.one_of(SHAPED, SOUP),
    value=st.one_of(
        st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=3), st.floats(allow_nan=False)
    ),
)
def test_any_text_is_a_point_get_or_not_and_never_an_error(served_tables, text, value):
    """`recognize` and `lookup` on statements near the shape and on token soup: a shape or None, a
    lookup or None, and a lookup runs; the tokenizer's refusal of an unterminated literal is the only
    error."""
    try:
        get = recognize(text)
    except InvalidRequest:
        return
    if get is None:
        return
    params = None if value is None else pa.table({"1": [value]})
    for served in served_tables.values():
        lookup = get.lookup(served, params)
        event("answered by a lookup" if lookup is not None else "left to DataFusion")
        if lookup is not None:
            assert lookup.schema.names == (list(get.columns) if get.columns else served.reader.schema.names)
            assert lookup.run().schema.equals(lookup.schema)
