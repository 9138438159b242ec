"""Helpers of the `memwal serve` tests: a small table with text and vectors, ADBC Flight SQL
connections (the real client), a raw pyarrow Flight client speaking Flight SQL messages, and the
`memwal serve` command as a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import adbc_driver_flightsql.dbapi as flightsql
import lance
import pyarrow as pa
import pyarrow.flight as flight
from google.protobuf import any_pb2

import memwal_df as mw
from memwal_df.server.protocol import pack, sql
from support.children import SOURCE_ROOT

VEC = pa.list_(pa.float32(), 3)
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("vec", VEC)])


def rows(ids: list[int], tag: str = "r") -> pa.Table:
    """Rows of `SCHEMA`: name `{tag}{id}`, a vector derived from the id."""
    vecs = [[float(i), float(i % 5), 1.0] for i in ids]
    return pa.table(
        {"id": ids, "name": [f"{tag}{i}" for i in ids], "vec": pa.array(vecs, VEC)}, schema=SCHEMA
    )


def make_table(uri: str, base: pa.Table | None = None, regions: int = 2) -> mw.Table:
    """A table of `SCHEMA` (bucket regions on `id`); with `base` rows, an inverted index on `name`."""
    table = mw.create_table(
        uri, base if base is not None else SCHEMA, primary_key="id", region_spec=mw.bucket("id", regions)
    )
    if base is not None:
        lance.dataset(uri).create_scalar_index("name", "INVERTED")
        table = mw.open_table(uri)
    return table


def connect(url: str, token: str | None = None, **db_kwargs: str) -> Any:
    """An ADBC Flight SQL dbapi connection (autocommit: the server has no transactions)."""
    if token is not None:
        db_kwargs["adbc.flight.sql.authorization_header"] = f"Bearer {token}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flightsql.connect(url, db_kwargs=db_kwargs, autocommit=True)


def query(conn: Any, text: str, params: Any = None) -> pa.Table:
    with conn.cursor() as cur:
        cur.execute(text, params)
        return cur.fetch_arrow_table()


def ingest(conn: Any, table: pa.Table, name: str = "t") -> int:
    with conn.cursor() as cur:
        return int(cur.adbc_ingest(name, table, mode="append"))


def flight_client(
    url: str, token: str | None = None, **kwargs: Any
) -> tuple[flight.FlightClient, flight.FlightCallOptions]:
    client = flight.FlightClient(url, **kwargs)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return client, flight.FlightCallOptions(headers=headers)


def command(message: Any) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(pack(message))


def fetch(client: flight.FlightClient, options: flight.FlightCallOptions, message: Any) -> pa.Table:
    """GetFlightInfo for a Flight SQL command, then DoGet of its endpoint."""
    info = client.get_flight_info(command(message), options)
    return client.do_get(info.endpoints[0].ticket, options).read_all()


def statement(text: str) -> Any:
    return sql.CommandStatementQuery(query=text)


def prepare(client: flight.FlightClient, options: flight.FlightCallOptions, text: str) -> bytes:
    """`CreatePreparedStatement` for `text`: the statement's handle."""
    body = pack(sql.ActionCreatePreparedStatementRequest(query=text))
    (answer,) = list(client.do_action(flight.Action("CreatePreparedStatement", body), options))
    envelope = any_pb2.Any()
    envelope.ParseFromString(answer.body.to_pybytes())
    result = sql.ActionCreatePreparedStatementResult()
    envelope.Unpack(result)
    return bytes(result.prepared_statement_handle)


def prepared(handle: bytes) -> Any:
    return sql.CommandPreparedStatementQuery(prepared_statement_handle=handle)


def count_planning(server: mw.Server) -> list[str]:
    """The SQL texts the server's engine hands DataFusion to plan from now on (appended as planned)."""
    engine = server._flight.engine
    planned: list[str] = []
    plan = engine._sql

    def counting(text: str, values: Any, **kwargs: Any) -> Any:
        planned.append(text)
        return plan(text, values, **kwargs)

    engine._sql = counting  # type: ignore[method-assign]
    return planned


def token_file(directory: Path, name: str, token: str) -> Path:
    path = directory / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def start_cli(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`memwal serve ARGS` as a child process; returns it and the URL it printed."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else "")}
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memwal_df", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("grpc"):
        proc.wait(timeout=30)
        raise AssertionError(
            f"memwal serve did not start (exit {proc.returncode}): {log.read_text()[-3000:]}"
        )
    return proc, url
