"""`serve(...)`: a Flight SQL server over MemWAL tables, started in the background, and the `Server`
that stops it.

For each served table the server opens the table, recovers it (a region whose WAL holds entries no
generation covers, left by a crashed writer or server, is replayed and flushed, so every write any
earlier server acknowledged is visible again), opens one `TableWriter` and registers
`MemWalTable(table, writer=writer)` in the `SessionContext`: every query reads every write the
writer acknowledged, whichever connection sent it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa

from memwal_df import errors
from memwal_df.errors import InvalidConfigError
from memwal_df.read.dataset import MemWalTable
from memwal_df.read.sql import register
from memwal_df.server import catalog
from memwal_df.server.auth import Auth
from memwal_df.server.ingest import ServedTable, Writes
from memwal_df.server.limits import Limits
from memwal_df.server.protocol import sql
from memwal_df.server.queries import Engine
from memwal_df.server.server import FlightSqlServer
from memwal_df.table import Table, open_table

__all__ = ["Server", "is_loopback", "serve"]

log = logging.getLogger("memwal_df.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Server:
    """A running server: `url`, `wait()` until `close()`, usable as a context manager."""

    def __init__(
        self,
        flight_server: FlightSqlServer,
        url: str,
        served: dict[str, ServedTable],
        maintainers: list[tuple[threading.Thread, threading.Event]],
    ) -> None:
        self._flight = flight_server
        self.url = url
        self.tables = served
        self._maintainers = maintainers
        self._closed = threading.Event()
        self._close_lock = threading.Lock()

    @property
    def port(self) -> int:
        port: int = self._flight.port
        return port

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is closed (or `timeout` seconds pass); whether it is closed."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        """Stop taking calls (those running finish), stop the maintain loops, then close the
        writers (their MemTables are flushed). Closing twice is a no-op."""
        with self._close_lock:
            if self._closed.is_set():
                return
            try:
                self._flight.shutdown()
            finally:
                for _, stop in self._maintainers:
                    stop.set()
                for thread, _ in self._maintainers:
                    thread.join()
                failures = []
                for served in self.tables.values():
                    try:
                        served.writer.close()
                    except Exception as e:  # noqa: BLE001 - close every writer, then report
                        failures.append(e)
                self._closed.set()
            if failures:
                raise failures[0]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    tables: Mapping[str, str | Table] | None = None,
    *,
    ctx: datafusion.SessionContext | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    auth_tokens: Sequence[str] = (),
    read_only_tokens: Sequence[str] = (),
    tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
    durable: bool | Mapping[str, bool] = True,
    writer_settings: Mapping[str, Any] | None = None,
    storage_options: dict[str, str] | None = None,
    limits: Limits | None = None,
    maintain_interval: float | None = None,
    allow_ddl: bool = False,
) -> Server:
    """Serve `tables` (SQL name -> table URI or `Table`) and every other table of `ctx` over Arrow
    Flight SQL on `host:port` (port 0: any free port; `Server.url` says which); returns once the
    server listens.

    `ctx`: your DataFusion `SessionContext` (its other tables, views and functions are served too);
    a new one if None. `auth_tokens` / `read_only_tokens`: bearer tokens that may read and write /
    only read; without any, every caller may read and write, which is refused unless `host` is a
    loopback address. `tls`: (certificate chain file, private key file), PEM. `durable`: whether a
    write is acknowledged after its WAL commit (default) or once in the MemTable, for all tables or
    per table name. `writer_settings`: `WriterConfig` settings of the writers (e.g.
    `max_memtable_rows`; docs/writing.md). `maintain_interval`: run each table's maintain loop
    (merge, index upkeep, compaction, GC) in the server every that many seconds. `allow_ddl`: let
    read-write callers run DataFusion DDL, DML on DataFusion tables and SET (refused by default).
    """
    tables = dict(tables or {})
    if not is_loopback(host) and not (auth_tokens or read_only_tokens):
        raise InvalidConfigError(
            f"refusing to listen on {host!r} without authentication: give auth tokens "
            "(--auth-token-file), or listen on a loopback address"
        )
    limits = limits or Limits()
    auth = Auth(list(auth_tokens), list(read_only_tokens))
    tls_pair = _read_tls(tls)
    ctx = ctx if ctx is not None else datafusion.SessionContext()
    register(ctx)
    served = _open_tables(ctx, tables, durable, dict(writer_settings or {}), storage_options)
    try:
        primary_keys = {catalog.locate(ctx, name): s.primary_key for name, s in served.items()}
        writes = Writes(ctx, served)
        engine = Engine(ctx, writes, limits, primary_keys, _sql_info(), allow_ddl)
        scheme = "grpc+tls" if tls_pair else "grpc+tcp"
        bind_host = f"[{host}]" if ":" in host else host
        flight_server = FlightSqlServer(
            f"{scheme}://{bind_host}:{port}",
            engine=engine,
            writes=writes,
            auth=auth,
            limits=limits,
            tls_certificates=[tls_pair] if tls_pair else None,
        )
    except BaseException:
        for s in served.values():
            s.writer.close()
        raise
    url = f"{'grpc+tls' if tls_pair else 'grpc'}://{bind_host}:{flight_server.port}"
    maintainers = (
        [_maintainer(s, maintain_interval, storage_options) for s in served.values()]
        if maintain_interval
        else []
    )
    log.info("serving %s on %s", sorted(served), url)
    return Server(flight_server, url, served, maintainers)


def _read_tls(
    tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None,
) -> tuple[bytes, bytes] | None:
    if tls is None:
        return None
    cert, key = tls
    try:
        return Path(cert).read_bytes(), Path(key).read_bytes()
    except OSError as e:
        raise InvalidConfigError(f"cannot read the TLS certificate or key: {e}") from None


def _open_tables(
    ctx: datafusion.SessionContext,
    tables: dict[str, str | Table],
    durable: bool | Mapping[str, bool],
    settings: dict[str, Any],
    storage_options: dict[str, str] | None,
) -> dict[str, ServedTable]:
    unknown = set(durable) - set(tables) if isinstance(durable, Mapping) else set()
    if unknown:
        raise InvalidConfigError(f"durable= names tables that are not served: {sorted(unknown)}")
    served: dict[str, ServedTable] = {}
    try:
        for name, source in tables.items():
            table = open_table(source, storage_options) if isinstance(source, str) else source
            recovered = table.recover()  # acknowledged writes of an earlier server become readable
            if recovered:
                log.info("table %s: replayed the WAL of %d regions", name, len(recovered))
            d = durable.get(name, True) if isinstance(durable, Mapping) else durable
            writer = table.writer(durable=d, **settings)
            reader = MemWalTable(table, writer=writer)
            served[name] = ServedTable(name, table, writer, d, reader)
            ctx.register_table(name, reader)
    except BaseException:
        for s in served.values():
            s.writer.close()
        raise
    return served


def _maintainer(
    served: ServedTable, interval: float, storage_options: dict[str, str] | None
) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    table = open_table(served.table.uri, storage_options)

    def run() -> None:
        try:
            table.maintain(interval=interval, stop=stop)
        except errors.MemWalError:
            log.exception("the maintain loop of table %s stopped", served.name)

    thread = threading.Thread(target=run, name=f"memwal-maintain-{served.name}", daemon=True)
    thread.start()
    return thread, stop


def _sql_info() -> dict[int, object]:
    info = sql.SqlInfo
    return {
        info.FLIGHT_SQL_SERVER_NAME: "memwal_df",
        info.FLIGHT_SQL_SERVER_VERSION: _version(),
        info.FLIGHT_SQL_SERVER_ARROW_VERSION: pa.__version__,
        info.FLIGHT_SQL_SERVER_READ_ONLY: False,
        info.FLIGHT_SQL_SERVER_SQL: True,
        info.FLIGHT_SQL_SERVER_SUBSTRAIT: False,
        info.FLIGHT_SQL_SERVER_TRANSACTION: sql.SQL_SUPPORTED_TRANSACTION_NONE,
        info.FLIGHT_SQL_SERVER_CANCEL: False,
        info.FLIGHT_SQL_SERVER_BULK_INGESTION: True,
        info.FLIGHT_SQL_SERVER_INGEST_TRANSACTIONS_SUPPORTED: False,
        info.SQL_DDL_CATALOG: False,
        info.SQL_DDL_SCHEMA: False,
        info.SQL_DDL_TABLE: False,
        info.SQL_IDENTIFIER_CASE: sql.SQL_CASE_SENSITIVITY_LOWERCASE,
        info.SQL_IDENTIFIER_QUOTE_CHAR: '"',
        info.SQL_QUOTED_IDENTIFIER_CASE: sql.SQL_CASE_SENSITIVITY_CASE_INSENSITIVE,
        info.SQL_TRANSACTIONS_SUPPORTED: False,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memwal_df")
    except PackageNotFoundError:
        return "unknown"
