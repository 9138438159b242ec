"""parse_filter against DataFusion's own evaluation of the same SQL."""

from __future__ import annotations

import datetime as dt

import datafusion
import pyarrow as pa
import pytest

from memwal_df.errors import InvalidFilterError
from memwal_df.read.expr.sql_text import parse_filter

TABLE = pa.table(
    {
        "id": pa.array([1, 2, 3, 4, 5, -6, None], pa.int64()),
        "name": ["a", "b'c", "it's", None, "e", "f", "g"],
        "v": [0.5, 1.5, 2.5, None, 4.5, -1.0, 3.0],
        "flag": [True, False, None, True, False, True, False],
        "day": pa.array([dt.date(2024, 1, d) for d in (1, 2, 3, 4, 5, 6, 7)], pa.date32()),
        "odd name": [1, 2, 3, 4, 5, 6, 7],
    }
)

FILTERS = [
    "id = 3",
    "id <> 3",
    "id != 3 AND v > 1",
    "id >= 2 and id <= 4",
    "id < -5",
    "v >= 1.5 OR name = 'e'",
    "NOT (id = 1 OR id = 2)",
    "id IN (1, 3, 5)",
    "id NOT IN (1, 3, 5)",
    "id NOT IN (1, NULL)",
    "id IN (1, NULL)",
    "id BETWEEN 2 AND 4",
    "id NOT BETWEEN 2 AND 4",
    "name IS NULL",
    "name IS NOT NULL",
    "name = 'b''c'",
    "name = 'it''s' or v < 0",
    "flag = TRUE",
    "flag = false",
    "day >= DATE '2024-01-04'",
    '"odd name" > 5',
    "3 < id",
    "(id = 1 OR id = 2) AND (v < 1 OR v > 2)",
]


@pytest.mark.parametrize("sql", FILTERS)
def test_parse_filter_selects_what_datafusion_selects(sql):
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("t", [TABLE.to_batches()])
    expected = ctx.sql(f'SELECT "odd name" FROM t WHERE {sql}').to_arrow_table().column(0).to_pylist()
    got = TABLE.filter(parse_filter(sql)).column("odd name").to_pylist()
    assert sorted(got) == sorted(expected)


@pytest.mark.parametrize(
    "bad", ["", "id =", "id = 3 extra", "id IN 1, 2", "id LIKE 'a%'", "id = 'x", "(id = 1"]
)
def test_malformed_filters_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_filter(bad)


@pytest.mark.parametrize(
    "bad", ["", "id =", "id = 3 extra", "id IN 1, 2", "id LIKE 'a%'", "id = 'x", "(id = 1"]
)
def test_malformed_filters_raise_invalid_filter_error(bad):
    with pytest.raises(InvalidFilterError, match="filter"):
        parse_filter(bad, TABLE.schema)


@pytest.mark.parametrize("sql", FILTERS)
def test_every_supported_filter_passes_the_schema_check(sql):
    assert parse_filter(sql, TABLE.schema).equals(parse_filter(sql))


@pytest.mark.parametrize(
    ("sql", "words"),
    [
        ("nope = 1", "names column 'nope', which the table does not have"),
        ('"no such" IS NULL', "names column 'no such'"),
        ("id = 1 OR nope > 2", "names column 'nope'"),
        ("name = 5", "compares column 'name' (string) with 5"),
        ("5 < name", "compares column 'name' (string) with 5"),
        ("id = 'x'", "compares column 'id' (int64) with 'x'"),
        ("id IN (1, 'x')", "compares id with values of different types [1, 'x']"),
        ("id IN ('x', 'y')", "compares column 'id' (int64) with ['x', 'y']"),
        ("name NOT IN (1, 2)", "compares column 'name' (string) with [1, 2]"),
        ("name BETWEEN 1 AND 'z'", "compares column 'name' (string) with 1"),
        ("day = 3", "compares column 'day' (date32[day]) with 3"),
        ("flag = 'yes'", "compares column 'flag' (bool) with 'yes'"),
        ("id = name", "is not a condition on the table's rows"),
        ("id", "is not a condition on the table's rows"),
    ],
)
def test_filters_that_do_not_fit_the_schema_name_the_column_and_value(sql, words):
    with pytest.raises(InvalidFilterError) as raised:
        parse_filter(sql, TABLE.schema)
    assert words in str(raised.value)
    assert isinstance(raised.value, ValueError)
