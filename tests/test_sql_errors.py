"""Errors raised inside SQL reach Python with their memwal_df type: through `memwal_df.query` and
through `memwal_df.errors.unwrap` of the error DataFusion raises, for every documented error of the
SQL functions and for a scan that fails while it runs."""

from __future__ import annotations

from pathlib import Path

import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support.optional import not_none

import memwal_df as mw
from memwal_df import errors
from memwal_df.errors import (
    CorruptManifestError,
    InvalidConfigError,
    InvalidFilterError,
    MissingGenerationError,
    TableNotRegisteredError,
)
from memwal_df.format import layout

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("category", pa.string()),
        ("text", pa.string()),
        ("vec", pa.list_(pa.float32(), 2)),
    ]
)
VS = "vector_search('t', 'vec', [1.0, 2.0], 3"


def _rows(ids: range) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {"id": i, "category": "ab"[i % 2], "text": f"word{i % 3} text", "vec": [float(i), 2.0]}
            for i in ids
        ],
        schema=SCHEMA,
    )


@pytest.fixture
def table(tmp_path: Path) -> mw.Table:
    return _make_table(str(tmp_path / "t"), None)


def _make_table(uri: str, storage_options: dict[str, str] | None) -> mw.Table:
    t = mw.create_table(uri, SCHEMA, "id", region_spec=mw.bucket("id", 2), storage_options=storage_options)
    with t.writer() as w:
        w.put(_rows(range(20)))
        w.flush()
        t.merge()
        w.put(_rows(range(10, 30)))
        w.flush()
    return t


@pytest.fixture
def ctx(table: mw.Table) -> datafusion.SessionContext:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table))
    return ctx


# (query, error type, words the message names)
DOCUMENTED = [
    (f"SELECT * FROM {VS.replace(', 3', ', 0')})", InvalidConfigError, "k must be a positive integer"),
    ("SELECT * FROM vector_search('t', 'vec', [1.0, 2.0, 3.0], 3)", InvalidConfigError, "finite numbers"),
    ("SELECT * FROM vector_search('t', 'vec', [1.0, 'NaN'], 3)", InvalidConfigError, "finite numbers"),
    (f"SELECT * FROM {VS}, named_struct('nprobe', 3))", InvalidConfigError, "unknown option"),
    (
        f"SELECT * FROM {VS}, named_struct('metric', 'hamming'))",
        InvalidConfigError,
        "unknown metric 'hamming'",
    ),
    (f"SELECT * FROM {VS}, named_struct('nprobes', -1))", InvalidConfigError, "nprobes must be a positive"),
    (f"SELECT * FROM {VS}, named_struct('refine_factor', 0))", InvalidConfigError, "refine_factor must be"),
    (
        f"SELECT * FROM {VS}, named_struct('filter', 'id ='))",
        InvalidFilterError,
        "expected a column or a value",
    ),
    (f"SELECT * FROM {VS}, named_struct('filter', 'nope = 5'))", InvalidFilterError, "column 'nope'"),
    (
        f"SELECT * FROM {VS}, named_struct('filter', 'category = 5'))",
        InvalidFilterError,
        "'category' (string) with 5",
    ),
    ("SELECT * FROM vector_search('t', 'text', [1.0, 2.0], 3)", InvalidConfigError, "not a fixed-size list"),
    ("SELECT * FROM vector_search('t', 'nope', [1.0, 2.0], 3)", InvalidConfigError, "no column 'nope'"),
    (f"SELECT * FROM {VS}, 7)", InvalidConfigError, "options must be a named_struct"),
    ("SELECT * FROM vector_search('t', 'vec')", InvalidConfigError, "takes 4 or 5 arguments"),
    ("SELECT * FROM vector_search('u', 'vec', [1.0, 2.0], 3)", TableNotRegisteredError, "table named 'u'"),
    ("SELECT * FROM fts('t', 'text', 'word1', 0)", InvalidConfigError, "k must be a positive integer"),
    ("SELECT * FROM fts('t', 'id', 'word1', 3)", InvalidConfigError, "'id' is not a string column"),
    ("SELECT * FROM fts('t', 'text', 5, 3)", InvalidConfigError, "query must be a string"),
    (
        "SELECT * FROM fts('t', 'text', 'word1', 3, named_struct('filter', 'id = ''x'''))",
        InvalidFilterError,
        "'id' (int64) with 'x'",
    ),
    ("SELECT * FROM fts('u', 'text', 'word1', 3)", TableNotRegisteredError, "table named 'u'"),
    ("SELECT * FROM memwal_explain('t', 'nope IN (1, 2)')", InvalidFilterError, "column 'nope'"),
    (
        "SELECT * FROM memwal_explain('t', 'id BETWEEN ''a'' AND 5')",
        InvalidFilterError,
        "'id' (int64) with 'a'",
    ),
    ("SELECT * FROM memwal_explain('t', 'id = = 1')", InvalidFilterError, "expected a value at position 5"),
    ("SELECT * FROM memwal_explain('u')", TableNotRegisteredError, "table named 'u'"),
    ("SELECT * FROM memwal_explain_search('knn', 't', 'vec', [1.0, 2.0], 3)", InvalidConfigError, "'knn'"),
    # arguments that are not literals: table functions are evaluated before any row is read
    (
        f"SELECT * FROM {VS.replace(', 3', ', id')})",
        InvalidConfigError,
        "k must be a literal value, not the expression id",
    ),
    (
        "SELECT * FROM vector_search(t, 'vec', [1.0, 2.0], 3)",
        InvalidConfigError,
        "table must be a literal value",
    ),
    (
        "SELECT * FROM vector_search('t', vec, [1.0, 2.0], 3)",
        InvalidConfigError,
        "column must be a literal value",
    ),
    (
        "SELECT * FROM fts('t', 'text', text, 3)",
        InvalidConfigError,
        "fts: query must be a literal value, not the expression text",
    ),
    (
        "SELECT * FROM fts('t', 'text', 'word1', category)",
        InvalidConfigError,
        "fts: k must be a literal value",
    ),
    ("SELECT * FROM memwal_explain('t', category)", InvalidConfigError, "filter must be a literal value"),
    (
        "SELECT * FROM memwal_explain_search('fts', 't', 'text', 'word1', id)",
        InvalidConfigError,
        "fts: k must be a literal value",
    ),
    # wrong arity
    ("SELECT * FROM vector_search()", InvalidConfigError, "takes 4 or 5 arguments"),
    (f"SELECT * FROM {VS}, named_struct('nprobes', 2), 1)", InvalidConfigError, "takes 4 or 5 arguments"),
    (
        "SELECT * FROM fts('t', 'text', 'word1')",
        InvalidConfigError,
        "fts(table, column, query, k [, options])",
    ),
    ("SELECT * FROM memwal_explain()", InvalidConfigError, "memwal_explain(table [, filter]) takes 1 or 2"),
    ("SELECT * FROM memwal_explain('t', 'id = 1', 3)", InvalidConfigError, "takes 1 or 2 arguments"),
    ("SELECT * FROM memwal_explain_search()", InvalidConfigError, "takes 5 or 6 arguments"),
    ("SELECT * FROM memwal_explain_search('fts', 't', 'text', 'x')", InvalidConfigError, "takes 4 or 5"),
    # wrong types
    (
        f"SELECT * FROM {VS.replace(', 3', ', 2.5')})",
        InvalidConfigError,
        "k must be a positive integer, not 2.5",
    ),
    (
        f"SELECT * FROM {VS.replace(', 3', ', true')})",
        InvalidConfigError,
        "k must be a positive integer, not True",
    ),
    (
        "SELECT * FROM fts('t', 'text', 'word1', '3')",
        InvalidConfigError,
        "k must be a positive integer, not '3'",
    ),
    (
        "SELECT * FROM vector_search('t', 'vec', NULL, 3)",
        InvalidConfigError,
        "must be a list of numbers, not None",
    ),
    (
        "SELECT * FROM vector_search('t', 'vec', 'abc', 3)",
        InvalidConfigError,
        "must be a list of numbers, not 'abc'",
    ),
    (
        "SELECT * FROM fts('t', 'text', 'word1', 3, named_struct('filter', 5))",
        InvalidConfigError,
        "filter must be a string",
    ),
    ("SELECT * FROM memwal_explain('t', 5)", InvalidConfigError, "filter must be SQL text (a string), not 5"),
    # unknown tables and columns
    (
        "SELECT * FROM vector_search(5, 'vec', [1.0, 2.0], 3)",
        TableNotRegisteredError,
        "no MemWAL table named 5",
    ),
    ("SELECT * FROM fts('t', 'nope', 'word1', 3)", InvalidConfigError, "'nope' is not a string column"),
    (
        "SELECT * FROM memwal_explain_search('vector', 't', 'vec', [1.0, 2.0], 3)",
        InvalidConfigError,
        "no search function 'vector'; the first argument names one of ['fts', 'vector_search']",
    ),
    (
        "SELECT * FROM memwal_explain_search('fts', 'u', 'text', 'x', 3)",
        TableNotRegisteredError,
        "table named 'u'",
    ),
]


@pytest.mark.parametrize(("sql", "error", "words"), DOCUMENTED)
def test_documented_errors_are_typed_through_sql(
    ctx: datafusion.SessionContext, sql: str, error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as raised:
        mw.query(ctx, sql)
    assert words in str(raised.value)
    assert "Traceback" not in str(raised.value)
    with pytest.raises(Exception) as plain:  # DataFusion's own error: the type is text only
        ctx.sql(sql).to_arrow_table()
    assert not isinstance(plain.value, error)
    typed = errors.unwrap(plain.value)
    assert type(typed) is error and str(typed) == str(raised.value)
    first = str(plain.value).splitlines()[0]  # DataFusion's text, headed by the error's own line
    assert first == f"{error.__name__}: {errors.headline(str(raised.value))}" and len(first) < 200
    assert "Traceback" not in str(plain.value)


@pytest.mark.parametrize("function", ["vector_search", "fts"])
def test_explain_search_takes_the_sql_function_names(ctx: datafusion.SessionContext, function: str) -> None:
    query = "[1.0, 2.0]" if function == "vector_search" else "'word1'"
    column = "vec" if function == "vector_search" else "text"
    lines = mw.query(
        ctx, f"SELECT line FROM memwal_explain_search('{function}', 't', '{column}', {query}, 3)"
    )
    assert lines.num_rows and ("TopKExec" if function == "vector_search" else "GlobalBM25Exec") in str(
        lines["line"][0]
    )


def test_unsupported_tokenizer_is_typed_through_sql(table: mw.Table, ctx: datafusion.SessionContext) -> None:
    lance.dataset(table.uri).create_scalar_index("text", "INVERTED", base_tokenizer="ngram")
    with pytest.raises(InvalidConfigError, match="base_tokenizer=ngram"):
        mw.query(ctx, "SELECT * FROM fts('t', 'text', 'word1', 3)")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) FROM t",
        "SELECT * FROM t WHERE id = 25",
        f"SELECT id FROM {VS})",
        "SELECT id FROM fts('t', 'text', 'word1', 3)",
    ],
)
def test_unreadable_generation_is_typed_through_sql(
    table: mw.Table, ctx: datafusion.SessionContext, sql: str
) -> None:
    """A generation that exists but cannot be read fails a scan, a lookup and a search alike, with
    Lance's reason in the message."""
    _break_generations(table)
    with pytest.raises(MissingGenerationError, match=r"(?s)cannot be read: _mem_wal/\S+ \(.*not found"):
        mw.query(ctx, sql)


def _flip_generation_bytes(table: mw.Table) -> None:
    """Change a byte of every data file of every generation: its checksum no longer matches."""
    for region in table.region_ids():
        for path in table.storage.list(f"_mem_wal/{region}"):
            if "_gen_" in path and path.endswith(".lance"):
                data = bytearray(table.storage.get(path))
                data[10] ^= 0xFF
                table.storage.put(path, bytes(data))


@pytest.mark.parametrize(
    ("damage", "error", "words"),
    [
        ("flip bytes", errors.CorruptGenerationError, "is corrupt"),
        ("delete manifests", MissingGenerationError, "cannot be read"),
    ],
)
@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) FROM t",
        "SELECT * FROM t WHERE id = 25",
        f"SELECT id FROM {VS})",
        "SELECT id FROM fts('t', 'text', 'word1', 3)",
    ],
)
def test_errors_of_a_failing_read_have_a_short_first_line_through_plain_sql(
    table: mw.Table,
    ctx: datafusion.SessionContext,
    damage: str,
    error: type[Exception],
    words: str,
    sql: str,
) -> None:
    """Through plain `ctx.sql` (scans fail while DataFusion runs the plan, searches while it plans
    the query) the first line names the error and the problem in under 200 characters; the whole
    message follows, and `unwrap` / `query` give the error with its full message."""
    (_flip_generation_bytes if damage == "flip bytes" else _break_generations)(table)
    with pytest.raises(error) as typed:
        mw.query(ctx, sql)
    assert len(str(typed.value).splitlines()[0]) > errors.HEADLINE_CHARS  # a message that needs a headline
    with pytest.raises(Exception) as plain:
        ctx.sql(sql).to_arrow_table()
    first = str(plain.value).splitlines()[0]
    assert len(first) < 200 and f"{error.__name__}: " in first and words in first, first
    assert "Traceback" not in str(plain.value) and str(typed.value) in str(plain.value)
    rebuilt = errors.unwrap(plain.value)
    assert type(rebuilt) is error and str(rebuilt) == str(typed.value)


def test_headline_cuts_a_long_first_line_at_a_separator() -> None:
    region = "r" * 36
    long = f"generation 2 of region {region} is corrupt: checksum 1 where 2 was written: " + "p/" * 60
    assert errors.headline(long) == f"generation 2 of region {region} is corrupt …"
    assert errors.headline("short: message\nsecond line") == "short: message"
    words = " ".join(["word"] * 60)
    assert errors.headline(words) == " ".join(["word"] * 20) + " …"  # 99 characters cut at a space
    assert len(errors.headline("x" * 500)) == errors.HEADLINE_CHARS + 2


def _break_generations(table: mw.Table) -> None:
    """Delete the manifests of every generation, and its checksum sidecar: without one (as in a
    generation Lance wrote) the files are not verified and the error is Lance's own."""
    for region in table.region_ids():
        for path in table.storage.list(f"_mem_wal/{region}"):
            if "_gen_" in path and ("/_versions/" in path or path.endswith(f"/{layout.CHECKSUMS_FILE}")):
                table.storage.delete(path)


def test_errors_are_typed_through_sql_on_every_backend(
    table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    table = _make_table(table_uri, table_storage_options)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table))
    with pytest.raises(InvalidFilterError, match="column 'nope'"):
        mw.query(ctx, f"SELECT * FROM {VS}, named_struct('filter', 'nope = 1'))")
    _break_generations(table)
    with pytest.raises(MissingGenerationError, match="cannot be read"):
        mw.query(ctx, "SELECT count(*) FROM t")


def test_query_returns_results_and_passes_datafusion_errors_through(ctx: datafusion.SessionContext) -> None:
    assert mw.query(ctx, "SELECT count(*) AS n FROM t").to_pylist() == [{"n": 30}]
    with pytest.raises(Exception, match="nope") as raised:  # a DataFusion error, not memwal_df's
        mw.query(ctx, "SELECT * FROM nope")
    assert not isinstance(raised.value, errors.MemWalError)
    assert errors.unwrap(raised.value) is raised.value


def test_unwrap_rebuilds_errors_with_extra_constructor_arguments() -> None:
    text = (
        "External error: PyErr { type: <class 'memwal_df.errors.CorruptWalEntryError'>, "
        "value: CorruptWalEntryError('truncated entry: _mem_wal/r/wal/1.arrow'), traceback: None }"
    )
    typed = errors.unwrap(Exception(text))
    assert isinstance(typed, errors.CorruptWalEntryError)
    assert str(typed) == "truncated entry: _mem_wal/r/wal/1.arrow"
    assert typed.path == "_mem_wal/r/wal/1.arrow"
    not_ours = "Execution error: PyErr { type: <class 'os.Error'>, value: Error('x'), traceback: None }"
    assert errors.unwrap(ValueError(not_ours)).args == (not_ours,)


@pytest.mark.parametrize(
    ("flt", "words"),
    [
        (pc.field("nope") == 1, "names column 'nope', which the table does not have"),
        (pc.field("category") == 5, "compares column 'category' (string) with 5"),
        (pc.field("id").isin(["a", "b"]), "compares column 'id' (int64) with ['a', 'b']"),
        (pc.field("id"), "is not a condition on the table's rows"),
    ],
)
def test_python_filters_get_the_same_typed_errors(table: mw.Table, flt: pc.Expression, words: str) -> None:
    """MemWalTable.to_table / explain check a pyarrow filter as SQL text filters are checked: the
    error names the unknown column, or the column and the value of another type."""
    reader = mw.MemWalTable(table)
    for call in (lambda: reader.to_table(filter=flt), lambda: reader.explain(flt)):
        with pytest.raises(InvalidFilterError) as raised:
            call()
        assert words in str(raised.value)


@pytest.mark.parametrize(
    "sql", ["SELECT * FROM t", f"SELECT id FROM {VS})", "SELECT * FROM fts('t', 'text', 'word1', 3)"]
)
def test_corrupt_region_manifest_is_typed_through_sql_with_its_path(
    table: mw.Table, ctx: datafusion.SessionContext, sql: str
) -> None:
    region = table.region_ids()[0]
    path = layout.manifest_path(region, not_none(table.region_status(region)).manifest_version)
    data = table.storage.get(path)
    table.storage.put(path, data[: len(data) // 2])
    with pytest.raises(CorruptManifestError) as raised:
        mw.query(ctx, sql)
    assert raised.value.path == path
