"""`memwal serve` as a process and under load: the command starts, prints its URL and stops cleanly
on SIGTERM; a SIGKILLed server restarted on the same table serves every write it acknowledged;
concurrent writers and readers on separate connections agree with a model after every
acknowledgement; concurrent single-row writes share WAL entries; the maintain loop runs inside."""

from __future__ import annotations

import random
import signal
import threading
import time

import datafusion
import pytest
from adbc_driver_manager import dbapi
from support.children import close_process
from support.faulty_storage import FaultPlan, FaultyStorage
from support.serving import connect, ingest, make_table, query, rows, start_cli, token_file
from support.wal_oracle import wal_records

import memwal_df as mw
from memwal_df import serve
from memwal_df.format import layout


def _flushed_rows(uri: str) -> dict[int, str]:
    """id -> name as a reader of the flushed levels (no writer) sees the table."""
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    got = mw.query(ctx, "SELECT id, name FROM t")
    return dict(zip(got.column("id").to_pylist(), got.column("name").to_pylist(), strict=True))


def test_the_command_serves_and_stops_cleanly_on_sigterm(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    token = "cli-token-0123456789abcdef"
    tokens = token_file(tmp_path, "token", token)
    proc, url = start_cli(
        ["-t", f"t={uri}", "--port", "0", "--auth-token-file", str(tokens)], tmp_path / "log"
    )
    try:
        assert url.startswith("grpc://127.0.0.1:")
        with connect(url, token) as conn:
            assert ingest(conn, rows([1, 2])) == 2
            assert query(conn, "SELECT count(*) FROM t").column(0)[0].as_py() == 2
        with pytest.raises(dbapi.Error, match="UNAUTHENTICATED"), connect(url) as conn:
            query(conn, "SELECT 1")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert token not in (tmp_path / "log").read_text()
    finally:
        close_process(proc)
    assert _flushed_rows(uri) == {1: "r1", 2: "r2"}  # the clean stop flushed the MemTables


def test_the_command_refuses_a_public_address_without_tokens(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri)
    with pytest.raises(AssertionError, match="exit 2.*without authentication"):
        start_cli(["-t", f"t={uri}", "--host", "0.0.0.0", "--port", "0"], tmp_path / "log")


def test_sigkill_then_restart_serves_every_acknowledged_write(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri, regions=4)
    log = tmp_path / "log"
    proc, url = start_cli(["-t", f"t={uri}", "--port", "0"], log)
    acked: dict[int, str] = {}  # key -> the last name acknowledged for it
    lock = threading.Lock()
    stop = threading.Event()

    def write(worker: int) -> None:
        rng = random.Random(worker)
        keys = list(range(worker * 1000, worker * 1000 + 50))
        with connect(url) as conn:
            version = 0
            while not stop.is_set():
                version += 1
                batch = rng.sample(keys, rng.choice([1, 5]))
                tag = f"w{worker}v{version}-"
                try:
                    ingest(conn, rows(batch, tag))
                except dbapi.Error:
                    return  # the server is gone: this write may or may not have landed
                with lock:
                    acked.update({k: f"{tag}{k}" for k in batch})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(acked) < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        stop.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
        close_process(proc)
    assert len(acked) >= 100
    proc, url = start_cli(["-t", f"t={uri}", "--port", "0"], log)
    try:
        with connect(url) as conn:
            got = query(conn, "SELECT id, name FROM t").to_pylist()
        names = {r["id"]: r["name"] for r in got}
        for key, name in acked.items():
            # the acknowledged write, or one its writer sent after it whose outcome it never learnt
            assert key in names, f"acknowledged key {key} is missing"
            worker, version = name.split("-")[0][1:].split("v")
            got_worker, got_version = names[key].split("-")[0][1:].split("v")
            assert got_worker == worker and int(got_version) >= int(version), (key, name, names[key])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        close_process(proc)


def test_concurrent_writers_and_readers_agree_with_a_model(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri, regions=4)
    failures: list[str] = []
    models: list[dict[int, str]] = [{} for _ in range(4)]
    with serve({"t": uri}) as server:

        def work(worker: int) -> None:
            rng = random.Random(100 + worker)
            model = models[worker]
            keys = list(range(worker * 100, worker * 100 + 30))
            with connect(server.url) as writer, connect(server.url) as reader, writer.cursor() as cur:
                for step in range(25):
                    op = rng.choice(["ingest", "insert", "delete"])
                    batch = sorted(rng.sample(keys, rng.randrange(1, 6)))
                    if op == "ingest":
                        assert ingest(writer, rows(batch, f"i{step}-")) == len(batch)
                        model.update({k: f"i{step}-{k}" for k in batch})
                    elif op == "insert":
                        values = ", ".join(f"({k}, 's{step}-{k}', [0.0, 0.0, 0.0])" for k in batch)
                        cur.execute(f"INSERT INTO t VALUES {values}")
                        assert cur.rowcount == len(batch)
                        model.update({k: f"s{step}-{k}" for k in batch})
                    else:
                        cur.execute(f"DELETE FROM t WHERE id IN ({', '.join(map(str, batch))})")
                        live = [k for k in batch if k in model]
                        if cur.rowcount != len(live):
                            failures.append(
                                f"worker {worker} step {step}: DELETE counted {cur.rowcount}, model {live}"
                            )
                        for k in batch:
                            model.pop(k, None)
                    # read-your-writes from another connection, right after the acknowledgement
                    seen = query(reader, f"SELECT id, name FROM t WHERE id >= {keys[0]} AND id <= {keys[-1]}")
                    got = dict(
                        zip(seen.column("id").to_pylist(), seen.column("name").to_pylist(), strict=True)
                    )
                    if got != model:
                        failures.append(f"worker {worker} step {step} ({op}): read {got}, model {model}")

        threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        with connect(server.url) as conn:
            final = query(conn, "SELECT id, name FROM t").to_pylist()
    merged = {k: v for m in models for k, v in m.items()}
    assert {r["id"]: r["name"] for r in final} == merged
    assert _flushed_rows(uri) == merged


def test_concurrent_single_row_writes_share_wal_entries(tmp_path):
    """Group commit across clients: single-row ingests of four connections that arrive while the
    region's WAL append is stalled go into one entry together."""
    uri = str(tmp_path / "t")
    make_table(uri, regions=1)
    table = mw.open_table(uri)
    plan = FaultPlan(delay_s=0.5)
    table.storage = FaultyStorage(table.storage, plan)
    with serve({"t": table}) as server:
        with connect(server.url) as conn:
            ingest(conn, rows([0]))  # opens the region's writer: one entry
        plan.force("delay", lambda op, path: op == "create" and f"/{layout.WAL_DIR}/" in path)
        n = 4
        barrier = threading.Barrier(n)
        conns = [connect(server.url) for _ in range(n)]

        def put(i: int) -> None:
            barrier.wait()
            assert ingest(conns[i], rows([100 + i])) == 1

        threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in conns:
            c.close()
        assert plan.injected["delay"] == 1
        region = table.region_ids()[0]
        entries = [r for r in wal_records(table, region) if not r.sentinel]
        assert sorted(r["id"] for e in entries for r in e.rows) == [0, *range(100, 100 + n)]
        assert len(entries) < 1 + n, [e.batches for e in entries]


def test_the_maintain_loop_runs_inside_the_server(tmp_path):
    uri = str(tmp_path / "t")
    make_table(uri, regions=1)
    with serve({"t": uri}, maintain_interval=0.2, writer_settings={"max_memtable_rows": 10}) as server:
        with connect(server.url) as conn:
            for start in range(0, 50, 10):
                ingest(conn, rows(list(range(start, start + 10))))
            table = mw.open_table(uri)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                table.refresh()
                statuses = [table.region_status(r) for r in table.region_ids()]
                if any(s is not None and s.merged_generation > 0 for s in statuses):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError("the maintain loop merged no generation")
            assert query(conn, "SELECT count(*) FROM t").column(0)[0].as_py() == 50
    assert len(_flushed_rows(uri)) == 50
