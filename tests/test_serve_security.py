"""`memwal serve` refuses callers without a token, read-only tokens cannot write or run DDL, TLS,
a non-loopback address needs tokens, the limits answer with clear errors, and no malformed request
(fuzzed messages, bad schemas, oversized batches) harms the server or the data it acknowledged."""

from __future__ import annotations

import datetime
import ipaddress
import random
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from adbc_driver_manager import dbapi
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf import any_pb2
from support.serving import (
    command,
    connect,
    fetch,
    flight_client,
    ingest,
    make_table,
    query,
    rows,
    statement,
    token_file,
)

from memwal_df.errors import InvalidConfigError
from memwal_df.server import Limits, serve
from memwal_df.server.auth import read_token_file
from memwal_df.server.protocol import pack, sql

WRITE = "write-token-0123456789abcdef"
READ = "read-token-0123456789abcdef"


@pytest.fixture
def secured(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    with serve({"t": uri}, auth_tokens=[WRITE], read_only_tokens=[READ]) as server:
        yield server


def test_callers_without_a_valid_token_are_refused(secured):
    for token in (None, "wrong-token-0123456789abcdef", WRITE + "x", WRITE[:-1]):
        with pytest.raises(dbapi.Error, match="UNAUTHENTICATED"):
            with connect(secured.url, token) as conn:
                query(conn, "SELECT 1")
    client, options = flight_client(secured.url)  # raw calls: DoGet, DoAction, DoPut alike
    with pytest.raises(flight.FlightUnauthenticatedError):
        fetch(client, options, sql.CommandGetCatalogs())
    with pytest.raises(flight.FlightUnauthenticatedError):
        list(client.do_action(flight.Action("ClosePreparedStatement", b""), options))
    basic = flight.FlightCallOptions(headers=[(b"authorization", f"Basic {WRITE}".encode())])
    with pytest.raises(flight.FlightUnauthenticatedError):
        client.get_flight_info(command(statement("SELECT 1")), basic)
    with connect(secured.url, WRITE) as conn:
        assert ingest(conn, rows([1])) == 1
        assert query(conn, "SELECT name FROM t").column(0).to_pylist() == ["r1"]


def test_a_read_only_token_reads_but_cannot_write_or_run_ddl(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    with serve({"t": uri}, auth_tokens=[WRITE], read_only_tokens=[READ], allow_ddl=True) as server:
        with connect(server.url, WRITE) as writer:
            ingest(writer, rows([1, 2]))
        with connect(server.url, READ) as reader, reader.cursor() as cur:
            assert query(reader, "SELECT count(*) FROM t").column(0)[0].as_py() == 2
            refused = [
                lambda: cur.adbc_ingest("t", rows([3]), mode="append"),
                lambda: cur.execute("INSERT INTO t VALUES (3, 'x', [0.0, 0.0, 0.0])"),
                lambda: cur.executemany("INSERT INTO t VALUES (?, ?, ?)", [(3, "x", [0.0, 0.0, 0.0])]),
                lambda: cur.execute("DELETE FROM t WHERE id = 1"),
                lambda: cur.execute("CREATE VIEW v AS SELECT 1"),
                lambda: cur.execute("SET datafusion.execution.batch_size = 1"),
                lambda: cur.execute("COPY t TO '/tmp/never-written.parquet'"),
            ]
            for call in refused:
                with pytest.raises(dbapi.Error, match="UNAUTHORIZED|read-only"):
                    call()
        with connect(server.url, WRITE) as writer:
            assert query(writer, "SELECT id FROM t ORDER BY id").column(0).to_pylist() == [1, 2]


def test_a_non_loopback_address_needs_tokens(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    with pytest.raises(InvalidConfigError, match="without authentication"):
        serve({"t": uri}, host="0.0.0.0")
    with serve({"t": uri}, host="0.0.0.0", auth_tokens=[WRITE]) as server:
        with connect(server.url.replace("0.0.0.0", "127.0.0.1"), WRITE) as conn:
            assert query(conn, "SELECT 1 AS x").column(0).to_pylist() == [1]


def test_token_files(tmp_path):
    assert read_token_file(token_file(tmp_path, "ok", WRITE)) == WRITE
    with pytest.raises(InvalidConfigError, match="at least 16"):
        read_token_file(token_file(tmp_path, "short", "abc"))
    with pytest.raises(InvalidConfigError, match="cannot read"):
        read_token_file(tmp_path / "missing")


def _certificate(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    cert, key = _certificate(tmp_path)
    with serve({"t": uri}, tls=(cert, key), auth_tokens=[WRITE]) as server:
        assert server.url.startswith("grpc+tls://")
        roots = {"adbc.flight.sql.client_option.tls_root_certs": cert.read_text()}
        with connect(server.url, WRITE, **roots) as conn:
            assert ingest(conn, rows([1])) == 1
            assert query(conn, "SELECT id FROM t").column(0).to_pylist() == [1]
        with pytest.raises(dbapi.Error):  # a client that does not trust the certificate
            with connect(server.url, WRITE) as conn:
                query(conn, "SELECT 1")
        with pytest.raises(dbapi.Error):  # plaintext to a TLS port
            with connect(server.url.replace("grpc+tls", "grpc"), WRITE) as conn:
                query(conn, "SELECT 1")


def test_limits_answer_with_clear_errors(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    limits = Limits(
        max_result_bytes=100_000, max_request_bytes=50_000, max_concurrent_queries=1, queue_timeout_s=0.2
    )
    with serve({"t": uri}, limits=limits) as server, connect(server.url) as conn:
        with pytest.raises(dbapi.Error, match="result size limit of 100000 bytes"):
            query(conn, "SELECT * FROM generate_series(1, 1000000)")
        with pytest.raises(dbapi.Error, match="request size limit of 50000 bytes"):
            ingest(conn, rows(list(range(5000))))
        assert ingest(conn, rows([1, 2])) == 2
    limits = Limits(max_concurrent_queries=1, queue_timeout_s=0.2)
    with serve({"t": uri}, limits=limits) as server, connect(server.url) as conn:
        # one query slot: a stream the client does not read holds it, the next query waits, then is refused
        client, options = flight_client(server.url)
        info = client.get_flight_info(
            command(statement("SELECT * FROM generate_series(1, 100000000)")), options
        )
        held = client.do_get(info.endpoints[0].ticket, options)
        held.read_chunk()
        with pytest.raises(dbapi.Error, match="server busy: all 1 query slots"):
            query(conn, "SELECT 1")
        held.cancel()
        client.close()
        deadline = time.monotonic() + 60  # the cancelled stream gives its slot back
        while True:
            try:
                assert query(conn, "SELECT count(*) FROM t").column(0)[0].as_py() == 2
                break
            except dbapi.Error as e:
                assert "server busy" in str(e) and time.monotonic() < deadline
    with serve({"t": uri}, limits=Limits(query_timeout_s=1e-9)) as server, connect(server.url) as conn:
        with pytest.raises(dbapi.Error, match="query timeout"):
            query(conn, "SELECT * FROM t")


def _fuzzed(rng: random.Random) -> list[bytes]:
    """Command / ticket / action bodies: random bytes, an Any with a foreign or unknown type, known
    types with garbage values, truncated valid messages."""
    valid = [
        pack(statement("SELECT 1")),
        pack(sql.CommandStatementIngest(table="t")),
        pack(sql.CommandGetTables(include_schema=True)),
        pack(sql.TicketStatementQuery(statement_handle=b"x" * 16)),
        pack(sql.CommandPreparedStatementQuery(prepared_statement_handle=b"nope")),
    ]
    out = [b"", b"\x00", b"\xff" * 64]
    for _ in range(40):
        out.append(rng.randbytes(rng.randrange(1, 200)))
    for name in (
        "google.protobuf.Empty",
        "arrow.flight.protocol.sql.CommandNope",
        "arrow.flight.protocol.sql.CommandStatementQuery",
    ):
        out.append(
            any_pb2.Any(type_url=f"type.googleapis.com/{name}", value=rng.randbytes(30)).SerializeToString()
        )
    for v in valid:
        out.append(v[: rng.randrange(1, len(v))])
        flipped = bytearray(v)
        flipped[rng.randrange(len(v))] ^= 0xFF
        out.append(bytes(flipped))
    return out


def test_fuzzed_and_malformed_requests_get_statuses_and_harm_nothing(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    rng = random.Random(7)
    with serve({"t": uri}, limits=Limits(max_request_bytes=200_000)) as server:
        with connect(server.url) as conn:
            assert ingest(conn, rows([1, 2, 3])) == 3
        client, options = flight_client(server.url)
        for body in _fuzzed(rng):
            for call in (
                lambda body=body: client.get_flight_info(flight.FlightDescriptor.for_command(body), options),
                lambda body=body: client.get_schema(flight.FlightDescriptor.for_command(body), options),
                lambda body=body: client.do_get(flight.Ticket(body), options).read_all(),
                lambda body=body: list(
                    client.do_action(flight.Action("CreatePreparedStatement", body), options)
                ),
                lambda body=body: list(
                    client.do_action(flight.Action("ClosePreparedStatement", body), options)
                ),
            ):
                with pytest.raises((pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowKeyError)):
                    call()
        with pytest.raises(pa.ArrowInvalid, match="command descriptors"):
            client.get_flight_info(flight.FlightDescriptor.for_path("t"), options)
        with pytest.raises(pa.ArrowNotImplementedError, match="unknown action"):
            list(client.do_action(flight.Action("DropEverything", b""), options))
        with pytest.raises(pa.ArrowNotImplementedError, match="transactions are not supported"):
            list(client.do_action(flight.Action("BeginTransaction", b""), options))

        def put(table, message):
            writer, reader = client.do_put(command(message), table.schema, options)
            writer.write_table(table)
            writer.done_writing()
            buf = reader.read()
            writer.close()
            return sql.DoPutUpdateResult.FromString(buf.to_pybytes()).record_count

        target = sql.CommandStatementIngest(table="t")
        bad_inputs = [
            (pa.table({"id": ["a"], "name": ["x"], "vec": [[1.0, 2.0, 3.0]]}), pa.ArrowInvalid, "type"),
            (pa.table({"id": [9], "name": ["x"]}), pa.ArrowInvalid, "lacks the columns"),
            (
                pa.table({"id": [None], "name": ["x"], "vec": [[1.0, 2.0, 3.0]]}, schema=rows([1]).schema),
                pa.ArrowInvalid,
                "NULL",
            ),
            (pa.table({"id": [9], "name": ["x"], "vec": [[1.0, 2.0]]}), pa.ArrowInvalid, "dimension"),
            (
                pa.table({"id": [9], "name": ["x"], "vec": [[1.0, 2.0, 3.0]], "extra": [1]}),
                pa.ArrowInvalid,
                "not in the table",
            ),
            (rows(list(range(10_000, 20_000))), flight.FlightUnavailableError, "request size limit"),
        ]
        for table, error, message in bad_inputs:
            with pytest.raises(error, match=message):
                put(table, target)
        with pytest.raises(pa.ArrowInvalid, match="not a DoPut command"):
            put(rows([5]), sql.CommandGetCatalogs())
        # concurrent garbage does not disturb a concurrent writer
        errors: list[BaseException] = []

        def garbage():
            c, o = flight_client(server.url)
            for body in _fuzzed(random.Random(11)):
                try:
                    c.get_flight_info(flight.FlightDescriptor.for_command(body), o)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowKeyError):
                    pass
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
            c.close()

        threads = [threading.Thread(target=garbage) for _ in range(3)]
        for t in threads:
            t.start()
        assert put(rows([4]), target) == 1
        for t in threads:
            t.join()
        assert errors == []
        assert fetch(client, options, statement("SELECT id FROM t ORDER BY id")).column(0).to_pylist() == [
            1,
            2,
            3,
            4,
        ]
        client.close()
