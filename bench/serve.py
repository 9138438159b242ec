"""`memwal serve` over loopback against the same calls in-process: point lookups (new SQL text per
call, and one statement prepared per client with `?` bound per call), vector searches and durable
ingests of 1 and 1,000 rows with 1, 4 and 16 concurrent clients, and the time from an
acknowledged write to its visibility in another client's query. Nothing is asserted: the script
prints p50 / p99 latencies (ms), throughput, the served / in-process ratios, and the server process's
CPU time per call (Linux: from /proc; less sensitive to other load on the machine than latencies),
and the latencies of the same client calls against `bench/flight_floor.py`, a Flight SQL server that
does no work (with the clients' own CPU time per call): the floor that the protocol, gRPC and the
client set on this machine.

The server is a `memwal serve` child process (so clients and server do not share a GIL); the clients
are ADBC Flight SQL connections, one per client thread. In-process calls use a `TableWriter` and a
`SessionContext` with `MemWalTable(uri, writer=w)` on an identical table, from the same number of
threads.

    python bench/serve.py [--base-rows 50000] [--ops 200] [--clients 1,4,16]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adbc_driver_flightsql.dbapi as flightsql
import datafusion
import numpy as np
import pyarrow as pa
from _workload import vector_rows

import memwal_df as mw

DIM = 32
VEC = pa.list_(pa.float32(), DIM)


def data(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    return vector_rows(ids, rng, DIM)


def build(uri: str, base_rows: int) -> None:
    rng = np.random.default_rng(7)
    mw.create_table(uri, data(np.arange(base_rows), rng), primary_key="id", region_spec=mw.bucket("id", 4))


def start_server(uri: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`memwal serve` of `uri` as a child process: its URL."""
    root = str(Path(mw.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["-m", "memwal_df", "serve", "-t", f"t={uri}", "--port", "0", "--max-queries", "64"]
    return start_child(args, log, "the server", env)


def start_floor(log: Path) -> tuple[subprocess.Popen, str]:
    """`bench/flight_floor.py` as a child process: its URL."""
    return start_child([str(Path(__file__).with_name("flight_floor.py"))], log, "the floor server")


def start_child(
    args: list[str], log: Path, what: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`python args...` as a child process (stderr to `log`) and the URL it prints first."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url:
        raise SystemExit(f"{what} did not start: {log.read_text()[-2000:]}")
    return proc, url


Case = tuple[Callable[[str, int], Callable[[int], int]], Callable[[int], Callable[[int], int]]]

_OPEN: list[Any] = []  # cursors and their connections, closed (in order) before the server stops


def cursor(url: str) -> Any:
    """A cursor of a new ADBC connection."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conn = flightsql.connect(url, autocommit=True)
    cur = conn.cursor()
    _OPEN.extend([cur, conn])
    return cur


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (NaN where /proc is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(clients: int, ops: int, make: Callable[[int], Callable[[int], int]]) -> tuple[np.ndarray, float, int]:
    """`clients` threads, each calling its own `make(client)` `ops` times; latencies (s), wall time,
    rows written or read in all."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    counts = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def work(c: int) -> None:
        call = make(c)
        call(-1)  # warm-up
        barrier.wait()
        for i in range(ops):
            t0 = time.perf_counter()
            counts[c] += call(i)
            latencies[c].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return np.array([x for lat in latencies for x in lat]), time.perf_counter() - start, sum(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--base-rows", type=int, default=50_000)
    p.add_argument(
        "--ops", type=int, default=200, help="calls per client per case (ingest of 1,000 rows: a tenth)"
    )
    p.add_argument("--clients", default="1,4,16")
    args = p.parse_args(argv)
    client_counts = [int(c) for c in args.clients.split(",")]
    root = Path(tempfile.mkdtemp(prefix="memwal-serve-bench-"))
    served_uri, local_uri = str(root / "served"), str(root / "local")
    build(served_uri, args.base_rows)
    build(local_uri, args.base_rows)
    proc, url = start_server(served_uri, root / "server.log")
    floor_proc, floor_url = start_floor(root / "floor.log")
    local = mw.open_table(local_uri)
    writer = local.writer(durable=True)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(local, writer=writer))
    rng = np.random.default_rng(11)
    query_vec = ", ".join(f"{x:.4f}" for x in rng.random(DIM))
    next_key = [10**9]
    key_lock = threading.Lock()

    def new_keys(n: int) -> np.ndarray:
        with key_lock:
            start = next_key[0]
            next_key[0] += n
        return np.arange(start, start + n)

    def sql_case(text: Callable[[int, int], str]) -> Case:
        def served(at: str, c: int) -> Callable[[int], int]:
            cur = cursor(at)

            def call(i: int) -> int:
                cur.execute(text(c, i))
                return cur.fetch_arrow_table().num_rows

            return call

        def in_process(c: int) -> Callable[[int], int]:
            return lambda i: ctx.sql(text(c, i)).to_arrow_table().num_rows

        return served, in_process

    def bound_case(text: str, value: Callable[[int, int], int], literal: Callable[[int, int], str]) -> Case:
        """A statement prepared once per client (`?` bound per call) against `literal` in-process."""

        def served(at: str, c: int) -> Callable[[int], int]:
            cur = cursor(at)

            def call(i: int) -> int:
                cur.execute(text, (value(c, i),))
                return cur.fetch_arrow_table().num_rows

            return call

        def in_process(c: int) -> Callable[[int], int]:
            return lambda i: ctx.sql(literal(c, i)).to_arrow_table().num_rows

        return served, in_process

    def ingest_case(rows: int) -> Case:
        def served(at: str, c: int) -> Callable[[int], int]:
            cur = cursor(at)
            r = np.random.default_rng(c)
            return lambda i: int(cur.adbc_ingest("t", data(new_keys(rows), r), mode="append"))

        def in_process(c: int) -> Callable[[int], int]:
            r = np.random.default_rng(c)

            def call(i: int) -> int:
                writer.put(data(new_keys(rows), r))
                return rows

            return call

        return served, in_process

    lookup_rng = np.random.default_rng(3)
    keys = lookup_rng.integers(0, args.base_rows, 1_000_000)

    def key(c: int, i: int) -> int:
        return int(keys[(c * 7919 + i) % len(keys)])

    cases = {
        "point lookup": (sql_case(lambda c, i: f"SELECT * FROM t WHERE id = {key(c, i)}"), args.ops),
        "point lookup, bound ?": (
            bound_case(
                "SELECT * FROM t WHERE id = ?", key, lambda c, i: f"SELECT * FROM t WHERE id = {key(c, i)}"
            ),
            args.ops,
        ),
        "vector search k=10": (
            sql_case(lambda c, i: f"SELECT id, _distance FROM vector_search('t', 'vec', [{query_vec}], 10)"),
            max(args.ops // 4, 10),
        ),
        "ingest 1 row": (ingest_case(1), args.ops),
        "ingest 1,000 rows": (ingest_case(1000), max(args.ops // 10, 5)),
    }
    print(f"base {args.base_rows:,} rows, 4 regions, vectors of {DIM}; server {url}")
    print(
        f"{'case':<22} {'clients':>7} | {'served p50':>10} {'p99':>8} {'per s':>9} | "
        f"{'in-proc p50':>11} {'p99':>8} {'per s':>9} | {'p50 diff':>8} {'tput ratio':>10} | "
        f"{'server cpu/call':>15} | {'floor p50':>9} {'p99':>8} {'client cpu':>12}"
    )
    try:
        for name, ((served, in_process), ops) in cases.items():
            for clients in client_counts:
                cpu0 = cpu_seconds(proc.pid)
                lat_s, wall_s, n_s = run(clients, ops, functools.partial(served, url))
                cpu_s = (cpu_seconds(proc.pid) - cpu0) / (clients * (ops + 1))  # + the warm-up call
                lat_l, wall_l, n_l = run(clients, ops, in_process)
                client_cpu0 = time.process_time()  # this process: the clients (the floor does no work)
                lat_f, _, _ = run(clients, ops, functools.partial(served, floor_url))
                client_cpu = (time.process_time() - client_cpu0) / (clients * (ops + 1))
                unit = n_s if name.startswith("ingest") else clients * ops
                unit_l = n_l if name.startswith("ingest") else clients * ops
                p50s, p99s = np.percentile(lat_s, [50, 99]) * 1000
                p50l, p99l = np.percentile(lat_l, [50, 99]) * 1000
                p50f, p99f = np.percentile(lat_f, [50, 99]) * 1000
                tput_s, tput_l = unit / wall_s, unit_l / wall_l
                print(
                    f"{name:<22} {clients:>7} | {p50s:>8.2f}ms {p99s:>6.2f}ms {tput_s:>9.0f} | "
                    f"{p50l:>9.2f}ms {p99l:>6.2f}ms {tput_l:>9.0f} | "
                    f"{p50s - p50l:>+6.2f}ms {tput_s / tput_l:>10.2f} | {cpu_s * 1000:>13.2f}ms | "
                    f"{p50f:>7.2f}ms {p99f:>6.2f}ms {client_cpu * 1000:>10.2f}ms"
                )
        # acknowledged write -> another client's next query
        a, b = cursor(url), cursor(url)
        visible_first, lags = 0, []
        trials = args.ops
        for _ in range(trials):
            written = int(new_keys(1)[0])
            a.adbc_ingest("t", data(np.array([written]), rng), mode="append")
            t0 = time.perf_counter()
            b.execute(f"SELECT id FROM t WHERE id = {written}")
            found = b.fetch_arrow_table().num_rows
            lags.append(time.perf_counter() - t0)
            visible_first += found == 1
        print(
            f"ack -> visible to another client: {visible_first}/{trials} on its first query; "
            f"that query p50 {np.percentile(lags, 50) * 1000:.2f} ms, "
            f"p99 {np.percentile(lags, 99) * 1000:.2f} ms"
        )
        print("(per s: calls per second for lookups and searches, rows per second for ingests;")
        print(" floor: the same client calls against bench/flight_floor.py, a server that does no work;")
        print(" client cpu: the clients' CPU time per call in those floor calls)")
    finally:
        for handle in _OPEN:
            handle.close()
        proc.terminate()
        floor_proc.kill()
        proc.wait(timeout=300)
        floor_proc.wait()
        writer.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
