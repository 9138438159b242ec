"""`memwal serve` through a real Flight SQL client (ADBC's driver, dbapi): ingest, INSERT and DELETE
with their row counts, read-your-writes from another connection without any flush, SQL lookups,
`vector_search` / `fts` / `memwal_explain`, prepared statements, write modes, metadata calls, a bad
query followed by a good one, and a DataFusion context of the caller's own."""

from __future__ import annotations

import time

import datafusion
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from adbc_driver_manager import dbapi
from support.serving import (
    SCHEMA,
    command,
    connect,
    count_planning,
    fetch,
    flight_client,
    ingest,
    make_table,
    prepare,
    prepared,
    query,
    rows,
    statement,
)

import memwal_df as mw
from memwal_df import serve
from memwal_df.server import Limits, queries
from memwal_df.server.protocol import pack, sql


@pytest.fixture
def served(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri, rows(list(range(100, 110)), "base"))
    with serve({"t": uri}) as server:
        yield server, uri


def test_ingest_is_read_by_another_connection_before_any_flush(served):
    server, uri = served
    with connect(server.url) as a, connect(server.url) as b:
        assert ingest(a, rows([1, 2, 3])) == 3
        got = query(b, "SELECT id, name FROM t WHERE id < 100 ORDER BY id")
        assert got.to_pylist() == [{"id": i, "name": f"r{i}"} for i in (1, 2, 3)]
        # the rows are in the server's MemTables only: a reader of the flushed levels lacks them
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(uri))
        assert mw.query(ctx, "SELECT count(*) AS n FROM t WHERE id < 100").column("n")[0].as_py() == 0
        # an upsert replaces the row for every reader at once
        assert ingest(a, rows([2], "new")) == 1
        assert query(b, "SELECT name FROM t WHERE id = 2").column(0).to_pylist() == ["new2"]
        assert query(b, "SELECT count(*) FROM t").column(0)[0].as_py() == 13


def test_sql_lookups_and_search_functions(served):
    server, _ = served
    with connect(server.url) as conn:
        ingest(conn, rows([1, 2]))
        assert query(conn, "SELECT name FROM t WHERE id IN (1, 105) ORDER BY id").column(0).to_pylist() == [
            "r1",
            "base105",
        ]
        near = query(
            conn, "SELECT id, _distance FROM vector_search('t', 'vec', [1.0, 1.0, 1.0], 2) ORDER BY _distance"
        )
        assert near.column("id").to_pylist()[0] == 1  # vec of id 1 is [1, 1, 1]
        assert near.column("_distance")[0].as_py() == pytest.approx(0.0)
        hits = query(conn, "SELECT id FROM fts('t', 'name', 'base104', 3)")
        assert hits.column("id").to_pylist() == [104]
        plan = query(conn, "SELECT * FROM memwal_explain('t', 'id = 1')")
        assert plan.num_rows > 0 and "line" in plan.column_names
        joined = query(conn, "SELECT count(*) AS n FROM t a JOIN t b ON a.id = b.id")
        assert joined.column("n")[0].as_py() == 12


def test_insert_and_delete_report_affected_rows(served):
    server, _ = served
    with connect(server.url) as writer, connect(server.url) as reader:
        with writer.cursor() as cur:
            cur.execute("INSERT INTO t VALUES (1, 'one', [1.0, 0.0, 0.0]), (2, 'two', [0.0, 1.0, 0.0])")
            assert cur.rowcount == 2
            cur.execute("INSERT INTO t (vec, id) VALUES ([0.5, 0.5, 0.5], 3)")  # name left out: NULL
            assert cur.rowcount == 1
            cur.executemany(
                "INSERT INTO t VALUES (?, ?, ?)", [(4, "four", [4.0, 0.0, 0.0]), (5, "five", [5.0, 0.0, 0.0])]
            )
            assert cur.rowcount == 2
        got = query(reader, "SELECT id, name FROM t WHERE id < 100 ORDER BY id").to_pylist()
        assert got == [
            {"id": 1, "name": "one"},
            {"id": 2, "name": "two"},
            {"id": 3, "name": None},
            {"id": 4, "name": "four"},
            {"id": 5, "name": "five"},
        ]
        assert query(reader, "SELECT vec FROM t WHERE id = 4").column(0).to_pylist() == [[4.0, 0.0, 0.0]]
        with writer.cursor() as cur:
            cur.execute("DELETE FROM t WHERE id IN (1, 2, 99, 105)")  # 99 does not exist
            assert cur.rowcount == 3
            cur.execute("DELETE FROM t WHERE id = ?", (3,))
            assert cur.rowcount == 1
            cur.execute("DELETE FROM t WHERE id = 3")
            assert cur.rowcount == 0
            with pytest.raises(dbapi.ProgrammingError, match="only the primary key"):
                cur.execute("DELETE FROM t WHERE name = 'four'")
            with pytest.raises(dbapi.Error, match="UPDATE is not supported"):
                cur.execute("UPDATE t SET name = 'x' WHERE id = 4")
        ids = query(reader, "SELECT id FROM t ORDER BY id").column(0).to_pylist()
        assert ids == [4, 5, *[i for i in range(100, 110) if i != 105]]


def test_prepared_statements_bind_parameters(served):
    server, _ = served
    with connect(server.url) as conn:
        ingest(conn, rows([1, 2, 3]))
        with conn.cursor() as cur:
            for key in (1, 3, 2):
                cur.execute("SELECT name FROM t WHERE id = ?", (key,))
                assert cur.fetchall() == [(f"r{key}",)]
            cur.execute("SELECT id FROM vector_search('t', 'vec', [1.0, 1.0, 1.0], 1) WHERE id > $1", (0,))
            assert cur.fetchall() == [(1,)]
            cur.executemany(
                "INSERT INTO t (id, name, vec) SELECT ?, upper(?), [0.0, 0.0, 0.0]", [(7, "x"), (8, "y")]
            )
            assert cur.rowcount == 2
        assert query(conn, "SELECT name FROM t WHERE id IN (7, 8) ORDER BY id").column(0).to_pylist() == [
            "X",
            "Y",
        ]


def test_prepared_statements_report_the_parameter_types_the_server_knows(served):
    server, _ = served
    with connect(server.url) as conn, conn.cursor() as cur:
        # a point get's placeholders take the key's type, an INSERT's the columns' types
        key = pa.schema([("$1", pa.int64()), ("$2", pa.int64())])
        assert cur.adbc_prepare("SELECT name FROM t WHERE id IN (?, ?)") == key
        insert = cur.adbc_prepare("INSERT INTO t (name, id) VALUES (?, ?)")
        assert insert == pa.schema([("$1", pa.string()), ("$2", pa.int64())])
        assert cur.adbc_prepare("INSERT INTO t VALUES (?, ?, ?)") == pa.schema(
            [("$1", pa.int64()), ("$2", pa.string()), ("$3", SCHEMA.field("vec").type)]
        )
        # where DataFusion would have to infer them, none is sent
        assert cur.adbc_prepare("SELECT count(*) FROM t WHERE id > ?") is None
        assert cur.adbc_prepare("INSERT INTO t (id, name) SELECT ?, upper(?)") is None
        # parameters bound in the reported types run
        cur.execute("INSERT INTO t (name, id) VALUES (?, ?)", ("typed", 41))
        cur.execute("SELECT name FROM t WHERE id IN (?, ?)", (41, 100))
        assert sorted(cur.fetchall()) == [("base100",), ("typed",)]


def test_a_prepared_query_runs_its_plan_once_and_not_after_a_write(served, monkeypatch):
    server, _ = served
    planned = count_planning(server)
    client, options = flight_client(server.url)
    near = "SELECT id FROM vector_search('t', 'vec', [7.0, 2.0, 1.0], 1)"  # the search runs when planned
    handle = prepare(client, options, near)
    assert len(planned) == 1
    first = fetch(client, options, prepared(handle))  # its first run: the plan made when prepared
    assert len(planned) == 1 and first.column("id").to_pylist() == [100]
    assert fetch(client, options, prepared(handle)).equals(first)  # a second run plans again
    assert len(planned) == 2
    # a write acknowledged after the statement was prepared: its first run plans again, sees the write
    handle = prepare(client, options, near)
    with connect(server.url) as other:
        ingest(other, rows([7]))
    assert fetch(client, options, prepared(handle)).column("id").to_pylist() == [7]
    assert len(planned) == 4
    # so does a statement run in between (here DDL, refused: still counted, whatever it changed)
    handle = prepare(client, options, near)
    with pytest.raises(pa.ArrowException, match="--allow-ddl"):
        fetch(client, options, statement("CREATE VIEW v AS SELECT id FROM t"))
    assert fetch(client, options, prepared(handle)).column("id").to_pylist() == [7]
    assert len(planned) == 7
    # so does a write an embedding program makes through the server's writer (7 moves away, 8 is nearest)
    handle = prepare(client, options, near)
    far = pa.array([[9.0, 9.0, 9.0]], SCHEMA.field("vec").type)
    moved = pa.table({"id": [7], "name": ["r7"], "vec": far})
    server.tables["t"].writer.put(pa.concat_tables([moved, rows([8])]))
    assert fetch(client, options, prepared(handle)).column("id").to_pylist() == [8]
    assert len(planned) == 9
    # a closed statement's plan is dropped with it; an unused plan expires
    engine = server._flight.engine
    handle = prepare(client, options, near)
    assert len(engine._plans) == 1
    close = pack(sql.ActionClosePreparedStatementRequest(prepared_statement_handle=handle))
    list(client.do_action(flight.Action("ClosePreparedStatement", close), options))
    assert len(engine._plans) == 0
    client.close()


def test_an_unused_prepared_plan_expires(tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    make_table(uri, rows(list(range(100, 110)), "base"))
    monkeypatch.setattr(queries, "_PLAN_TTL_S", 0.2)
    with serve({"t": uri}) as server:
        planned = count_planning(server)
        client, options = flight_client(server.url)
        handle = prepare(client, options, "SELECT count(*) AS n FROM t")
        time.sleep(0.5)
        assert fetch(client, options, prepared(handle)).column("n").to_pylist() == [10]
        assert len(planned) == 2  # planned again: the plan made when preparing had expired
        client.close()


def test_a_ticket_is_fetched_once_and_expires(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri, rows(list(range(100, 110)), "base"))
    with serve({"t": uri}, limits=Limits(statement_ttl_s=0.3)) as server:
        client, options = flight_client(server.url)
        info = client.get_flight_info(command(statement("SELECT count(*) AS n FROM t")), options)
        ticket = info.endpoints[0].ticket
        assert client.do_get(ticket, options).read_all().column("n").to_pylist() == [10]
        with pytest.raises(pa.ArrowException, match="no such query ticket"):
            client.do_get(ticket, options).read_all()
        info = client.get_flight_info(command(statement("SELECT count(*) AS n FROM t")), options)
        time.sleep(0.6)
        with pytest.raises(pa.ArrowException, match="no such query ticket"):
            client.do_get(info.endpoints[0].ticket, options).read_all()
        client.close()


def test_a_write_between_a_querys_flight_info_and_its_fetch(served):
    server, _ = served
    client, options = flight_client(server.url)
    scan = command(statement("SELECT id FROM t WHERE id < 100 ORDER BY id"))
    near = command(statement("SELECT id FROM vector_search('t', 'vec', [4.0, 4.0, 1.0], 1)"))
    with connect(server.url) as other:
        ingest(other, rows([1, 2, 3]))
        scan_info = client.get_flight_info(scan, options)
        near_info = client.get_flight_info(near, options)
        ingest(other, rows([4]))  # acknowledged after both queries started, before they are fetched
        got = client.do_get(scan_info.endpoints[0].ticket, options).read_all().column("id").to_pylist()
        nearest = client.do_get(near_info.endpoints[0].ticket, options).read_all().column("id").to_pylist()
    # every write acknowledged before a query started is in its result, the later one whole or not at all
    assert got in ([1, 2, 3], [1, 2, 3, 4])
    assert nearest in ([3], [4])  # vec of 3 is [3, 3, 1], of 4 [4, 4, 1]
    # a query started after the acknowledgement sees it
    assert fetch(client, options, statement("SELECT id FROM t WHERE id < 100 ORDER BY id")).column(
        "id"
    ).to_pylist() == [1, 2, 3, 4]
    assert fetch(
        client, options, statement("SELECT id FROM vector_search('t', 'vec', [4.0, 4.0, 1.0], 1)")
    ).column("id").to_pylist() == [4]
    client.close()


def test_small_results_come_whole_and_larger_ones_stream(served, monkeypatch):
    server, _ = served
    monkeypatch.setattr(queries, "SMALL_RESULT_BATCHES", 2)
    client, options = flight_client(server.url)
    info = client.get_flight_info(command(statement("SELECT value FROM generate_series(1, 100000)")), options)
    reader = client.do_get(info.endpoints[0].ticket, options)
    batches = []
    while True:
        try:
            batches.append(reader.read_chunk().data)
        except StopIteration:
            break
    assert len(batches) > 2 and sum(b.num_rows for b in batches) == 100_000
    assert pa.Table.from_batches(batches).column("value").to_pylist() == list(range(1, 100_001))
    small = fetch(client, options, statement("SELECT id FROM t ORDER BY id LIMIT 3"))
    assert small.column("id").to_pylist() == [100, 101, 102]
    client.close()


def test_write_modes_partial_and_insert_if_absent(served):
    server, _ = served
    header = "adbc.flight.sql.rpc.call_header.x-memwal-write-mode"
    with connect(server.url) as conn, connect(server.url, **{header: "partial"}) as partial:
        with connect(server.url, **{header: "insert_if_absent"}) as absent:
            ingest(conn, rows([1, 2]))
            # partial: only the given columns change
            assert ingest(partial, pa.table({"id": [1], "name": ["renamed"]})) == 1
            assert query(conn, "SELECT name, vec FROM t WHERE id = 1").to_pylist() == [
                {"name": "renamed", "vec": [1.0, 1.0, 1.0]}
            ]
            # insert_if_absent: existing keys are kept, the count is the rows inserted
            assert ingest(absent, rows([2, 3], "absent")) == 1
            with absent.cursor() as cur:
                cur.execute(
                    "INSERT INTO t VALUES (3, 'again', [0.0, 0.0, 0.0]), (4, 'four', [0.0, 0.0, 0.0])"
                )
                assert cur.rowcount == 1
        got = query(conn, "SELECT id, name FROM t WHERE id < 100 ORDER BY id").to_pylist()
        assert got == [
            {"id": 1, "name": "renamed"},
            {"id": 2, "name": "r2"},
            {"id": 3, "name": "absent3"},
            {"id": 4, "name": "four"},
        ]
    with (
        connect(server.url, **{header: "sideways"}) as bad,
        pytest.raises(dbapi.ProgrammingError, match="unknown write mode"),
    ):
        ingest(bad, rows([9]))


def test_metadata_calls(served):
    server, _ = served
    with connect(server.url) as conn:
        objects = conn.adbc_get_objects(depth="all").read_all().to_pylist()
        tables = [t for c in objects for s in c["catalog_db_schemas"] for t in s["db_schema_tables"]]
        assert [(t["table_name"], t["table_type"]) for t in tables] == [("t", "TABLE")]
        assert [c["column_name"] for c in tables[0]["table_columns"]] == ["id", "name", "vec"]
        schema = conn.adbc_get_table_schema("t")
        assert schema.names == SCHEMA.names and schema.field("vec").type == SCHEMA.field("vec").type
        assert conn.adbc_get_table_types() == ["TABLE", "VIEW"]
        info = conn.adbc_get_info()
        assert info["vendor_name"] == "memwal_df"
    client, options = flight_client(server.url)
    keys = fetch(client, options, sql.CommandGetPrimaryKeys(table="t"))
    assert keys.select(["table_name", "column_name", "key_sequence"]).to_pylist() == [
        {"table_name": "t", "column_name": "id", "key_sequence": 1}
    ]
    assert fetch(client, options, sql.CommandGetCatalogs()).column(0).to_pylist() == ["datafusion"]
    assert fetch(client, options, sql.CommandGetDbSchemas(db_schema_filter_pattern="pub%")).num_rows == 1
    assert fetch(client, options, sql.CommandGetTables(table_name_filter_pattern="x%")).num_rows == 0
    with_schema = fetch(client, options, sql.CommandGetTables(include_schema=True))
    assert (
        pa.ipc.read_schema(pa.py_buffer(with_schema.column("table_schema")[0].as_py())).names == SCHEMA.names
    )
    client.close()


def test_a_bad_query_is_answered_with_its_error_and_the_next_one_runs(served):
    server, _ = served
    with connect(server.url) as conn, conn.cursor() as cur:
        with pytest.raises(dbapi.ProgrammingError, match="INVALID_ARGUMENT.*SELEC"):
            cur.execute("SELEC 1")
        with pytest.raises(dbapi.ProgrammingError, match="nope"):
            cur.execute("SELECT nope FROM t")
        with pytest.raises(dbapi.Error, match="not found"):
            cur.execute("SELECT * FROM missing")
        with pytest.raises(
            dbapi.ProgrammingError, match="InvalidConfigError: vector_search: the query needs 3"
        ):
            cur.execute("SELECT * FROM vector_search('t', 'vec', [1.0, 2.0], 1)")
        with pytest.raises(dbapi.ProgrammingError, match="lacks the columns"):
            cur.adbc_ingest("t", pa.table({"id": [1]}), mode="append")
        with pytest.raises(dbapi.ProgrammingError, match="no served table"):
            cur.adbc_ingest("elsewhere", rows([1]), mode="append")
        with pytest.raises(dbapi.Error, match="replace"):
            cur.adbc_ingest("t", rows([1]), mode="replace")
        cur.execute("SELECT 41 + 1 AS answer")
        assert cur.fetchall() == [(42,)]


def test_ddl_is_refused_unless_allowed(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    with serve({"t": uri}) as server, connect(server.url) as conn, conn.cursor() as cur:
        with pytest.raises(dbapi.Error, match="--allow-ddl"):
            cur.execute("CREATE VIEW v AS SELECT id FROM t")
    with serve({"t": uri}, allow_ddl=True) as server, connect(server.url) as conn, conn.cursor() as cur:
        cur.execute("CREATE VIEW v AS SELECT id FROM t")
        ingest(conn, rows([5]))
        cur.execute("SELECT id FROM v")
        assert cur.fetchall() == [(5,)]


def test_an_embedding_service_serves_its_own_context(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("labels", [[pa.record_batch({"id": [1, 2], "label": ["a", "b"]})]])
    with serve({"t": uri}, ctx=ctx, durable={"t": False}) as server, connect(server.url) as conn:
        assert not server.tables["t"].durable
        ingest(conn, rows([1, 2]))
        got = query(conn, "SELECT t.id, label FROM t JOIN labels USING (id) ORDER BY t.id")
        assert got.to_pylist() == [{"id": 1, "label": "a"}, {"id": 2, "label": "b"}]
        with pytest.raises(dbapi.Error, match="no served table"):
            ingest(conn, pa.table({"id": [3], "label": ["c"]}), name="labels")
    # closing the server flushed the non-durable writes
    ctx2 = mw.register(datafusion.SessionContext())
    ctx2.register_table("t", mw.MemWalTable(uri))
    assert mw.query(ctx2, "SELECT count(*) AS n FROM t").column("n")[0].as_py() == 2
