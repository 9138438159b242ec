"""`memwal serve`: serve MemWAL tables over Arrow Flight SQL (docs/serving.md) until SIGTERM or
Ctrl-C. Prints the URL it listens on (one line on stdout) once it accepts calls."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from memwal_df.cli import common as c
from memwal_df.cli.query import table_specs
from memwal_df.errors import InvalidArgumentError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve tables over Arrow Flight SQL (reads and writes for any client)",
        description="Serve MemWAL tables over Arrow Flight SQL: SQL queries (vector_search, fts and "
        "memwal_explain included), prepared statements, bulk ingest, INSERT and DELETE, with every "
        "acknowledged write visible to every client's next query. Listens on loopback unless --host "
        "says otherwise (then bearer tokens are required). Stops on SIGTERM or Ctrl-C. See docs/serving.md.",
        epilog="example: memwal serve -t events=./events --port 8815  "
        "(client: adbc_driver_flightsql.dbapi.connect('grpc://127.0.0.1:8815'))",
    )
    p.add_argument(
        "-t", "--table", action="append", required=True, metavar="NAME=URI", help="serve a table (repeat)"
    )
    c.add_storage_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8815, help="port (default 8815; 0: any free port)")
    p.add_argument(
        "--auth-token-file",
        action="append",
        metavar="FILE",
        help="a file holding a bearer token that may read and write (repeat for several tokens)",
    )
    p.add_argument(
        "--read-only-token-file",
        action="append",
        metavar="FILE",
        help="a file holding a bearer token that may only read (repeat)",
    )
    p.add_argument("--tls-cert", metavar="FILE", help="TLS certificate chain (PEM); needs --tls-key")
    p.add_argument("--tls-key", metavar="FILE", help="TLS private key (PEM); needs --tls-cert")
    p.add_argument(
        "--non-durable",
        action="append",
        metavar="NAME",
        help="acknowledge writes to this table once in its MemTable, before the WAL commit (repeat)",
    )
    p.add_argument(
        "--maintain",
        type=float,
        metavar="SECONDS",
        help="run each table's maintain loop (merge, index upkeep, compaction, GC) in the server, "
        "every SECONDS",
    )
    p.add_argument(
        "--allow-ddl",
        action="store_true",
        help="let read-write callers run DataFusion DDL (CREATE VIEW ...), DML on DataFusion tables and SET",
    )
    p.add_argument("--max-result-mb", type=float, help="largest query result, MiB (default 1024)")
    p.add_argument("--query-timeout", type=float, metavar="SECONDS", help="query time limit (default 300)")
    p.add_argument("--max-queries", type=int, help="queries running at once (default 16)")
    p.add_argument(
        "--max-request-mb", type=float, help="largest ingest or parameter batch, MiB (default 256)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memwal_df.server import Limits, serve
    from memwal_df.server.auth import read_token_file

    tables = table_specs(args.table)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidArgumentError("give --tls-cert and --tls-key together")
    non_durable = set(args.non_durable or ())
    unknown = non_durable - set(tables)
    if unknown:
        raise InvalidArgumentError(f"--non-durable names tables that are not served: {sorted(unknown)}")
    limits: dict[str, Any] = {}
    if args.max_result_mb is not None:
        limits["max_result_bytes"] = int(args.max_result_mb * (1 << 20))
    if args.query_timeout is not None:
        limits["query_timeout_s"] = args.query_timeout
    if args.max_queries is not None:
        limits["max_concurrent_queries"] = args.max_queries
    if args.max_request_mb is not None:
        limits["max_request_bytes"] = int(args.max_request_mb * (1 << 20))
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = serve(
            tables,
            host=args.host,
            port=args.port,
            auth_tokens=[read_token_file(f) for f in args.auth_token_file or ()],
            read_only_tokens=[read_token_file(f) for f in args.read_only_token_file or ()],
            tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
            durable={name: name not in non_durable for name in tables},
            storage_options=c.storage_options(args),
            limits=Limits(**limits),
            maintain_interval=args.maintain,
            allow_ddl=args.allow_ddl,
        )
        try:
            print(server.url, flush=True)
            print(
                f"serving {', '.join(sorted(tables))}; stop with Ctrl-C or SIGTERM",
                file=sys.stderr,
                flush=True,
            )
            while not stop.wait(0.5):
                pass
            print("stopping", file=sys.stderr, flush=True)
        finally:
            server.close()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return c.Exit.OK
