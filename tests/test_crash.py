"""Crash tests with real processes, and fault injection around ambiguous storage outcomes.

A child process (the `WORKER` script below, written into a temporary directory) drives a writer over a
JSON-lines pipe: the test sends commands on its stdin and reads one reply per command on its stdout,
so a reply is an acknowledgement. Crashes are real: `os._exit(9)` injected at a chosen step of the
child's own write path (memwal_df functions wrapped inside the child; storage stays real), or SIGKILL
at a random moment. After the crash the test process opens the table, recovers and checks:

* every acknowledged write is there, and nothing that was never written (`stored_rows == model`);
  a write whose call was cut short may or may not be there, but only whole, per region;
* manifest versions are contiguous, epochs step by one per claim, referenced generations are complete,
  orphaned generation directories are referenced by no manifest version, the WAL is contiguous;
* the region keeps working: the next flush writes a new directory.

Scenarios: a crash at each step of a MemTable flush (after the generation's Lance table, after
bloom_filter.bin, after _pk_index, after the manifest commit, after the version hint) and of a claim
or WAL append; SIGKILL during a stream of durable writes; two processes racing to claim one region;
the spec's Appendix 1 with two processes. In-process fault injection covers writes that land although
the call reports an error (a lost answer, a failed fsync). The default suite runs a sample; the rest
is marked `slow`.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import obstore
import pyarrow as pa
import pytest
from obstore.exceptions import AlreadyExistsError
from support.cases import backend, cases
from support.children import close_process
from support.figures import case_name, record
from support.optional import not_none
from support.reference import stored_rows
from support.wal_oracle import apply_rows, check_region, durable_rows, wal_records

import memwal_df as mw
from memwal_df.errors import StorageError
from memwal_df.format import layout, local_storage
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.manifest import RegionManifestStore, new_manifest, next_version
from memwal_df.format.open_storage import open_storage
from memwal_df.format.wal import Wal, encode_entry
from memwal_df.write.generation import write_generation
from memwal_df.write.memtable import MemTable

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)
BASE = [{"id": k, "name": f"base{k}", "v": float(k)} for k in range(5)]
GUARANTEE = "a crashed job or writer loses nothing acknowledged"

WORKER = r'''
import json, os, random, sys, threading, traceback

import pyarrow as pa

import memwal_df as mw
from memwal_df import errors
from memwal_df.write import generation
from memwal_df.format import storage
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.object_storage import ObjectStorage

URI, OPTIONS = sys.argv[1], json.loads(sys.argv[2]) or None
SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)
out = sys.stdout
table = writer = None


def reply(**msg):
    out.write(json.dumps(msg) + "\n")
    out.flush()


def rows(data):
    return pa.Table.from_pylist([{"id": k, "name": n, "v": v} for k, n, v in data], schema=SCHEMA)


def position(w):
    return w.stats()["next_wal_position"] - 1 if isinstance(w, mw.RegionWriter) else None


def inject(point, k):
    """os._exit(9) at the k-th time the child reaches `point` (fault injection in our own code)."""
    hits = [0]

    def hit():
        hits[0] += 1
        if hits[0] == k:
            os._exit(9)

    outer = threading.local()  # count a publish once, also when create() calls put_if_not_exists()

    def publish(real):
        def wrapped(self, path, data):
            if getattr(outer, "busy", False):
                return real(self, path, data)
            outer.busy = True
            try:
                if point == "wal_before_publish" and "/wal/" in path:
                    hit()
                result = real(self, path, data)
                landed = result not in (False, storage.EXISTED)
                if landed and point in ("wal_after_publish", "claim_after_sentinel") and "/wal/" in path:
                    hit()
                if landed and point == "claim_after_commit" and "/manifest/" in path:
                    hit()
                return result
            finally:
                outer.busy = False

        return wrapped

    for cls in (LocalStorage, ObjectStorage):
        put = cls.put

        def put_(self, path, data, _put=put):
            if point == "gen_after_manifest" and path.endswith("/version_hint.json"):
                hit()
            _put(self, path, data)
            if point == "gen_after_bloom" and path.endswith("/bloom_filter.bin"):
                hit()
            if point == "gen_after_hint" and path.endswith("/version_hint.json"):
                hit()

        cls.put = put_
        cls.put_if_not_exists = publish(cls.put_if_not_exists)
        if hasattr(cls, "create"):
            cls.create = publish(cls.create)

    write_pk_index = generation.write_pk_index

    def write_pk_index_(*a, **kw):
        write_pk_index(*a, **kw)
        if point == "gen_after_pk_index":
            hit()

    generation.write_pk_index = write_pk_index_
    write_dataset = generation.lance.write_dataset  # the child writes datasets only in its flushes

    def write_dataset_(*a, **kw):
        result = write_dataset(*a, **kw)
        if point == "gen_after_lance":
            hit()
        return result

    generation.lance.write_dataset = write_dataset_
    for cls in (LocalStorage, ObjectStorage):
        sync_tree = cls.sync_tree

        def sync_tree_(self, path, _sync=sync_tree):
            if point == "gen_before_sync":
                hit()
            return _sync(self, path)

        cls.sync_tree = sync_tree_
    if point == "wal_temp_written":  # LocalStorage: temp file written and synced, not yet linked
        link = os.link

        def link_(src, dst, *a, **kw):
            d = kw.get("dst_dir_fd")  # LocalStorage links relative to a directory descriptor
            where = os.path.join(os.readlink(f"/proc/self/fd/{d}") if d is not None else "", str(dst))
            if "/wal/" in where:
                hit()
            return link(src, dst, *a, **kw)

        os.link = link_


def error(e):
    nd = getattr(e, "not_durable", None)
    nd = nd.to_pylist() if nd is not None else None
    return {"error": type(e).__name__, "msg": str(e), "not_durable": nd}


def apply(w, op):
    if op["op"] == "put":
        w.put(rows(op["rows"]))
    else:
        w.delete(op["keys"])


def random_op(rng, key_max, max_rows, tag):
    if rng.random() < 0.25:
        return {"op": "delete", "keys": [rng.randrange(key_max) for _ in range(rng.randint(1, max_rows))]}
    n = rng.randint(1, max_rows)
    return {"op": "put", "rows": [[rng.randrange(key_max), f"{tag}-{j}", rng.random()] for j in range(n)]}


def stream(cmd):
    """Durable writes as fast as possible; each is announced before and acknowledged after."""
    rng = random.Random(cmd["seed"])
    for i in range(cmd["n"]):
        op = random_op(rng, cmd["key_max"], cmd["max_rows"], f"s{cmd['seed']}-{i}")
        reply(intent=i, **op)
        apply(writer, op)
        reply(ack=i)
    reply(done=cmd["n"])


def race(cmd):
    """Claim the region again and again, write a little, then close or crash (abort)."""
    rng = random.Random(cmd["seed"])
    for j in range(cmd["n"]):
        try:
            w = table.region_writer(cmd["region"], durable=True)
        except errors.WriterFencedError as e:
            reply(claim_fenced=j, msg=str(e))
            continue
        reply(claimed=j, epoch=w.epoch)
        for i in range(rng.randint(1, 3)):
            key = rng.randrange(cmd["key_max"])
            value = f"{cmd['tag']}-{j}-{i}"
            deleted = rng.random() < 0.2
            try:
                if deleted:
                    w.delete([key])
                else:
                    w.put(rows([[key, value, None]]))
            except errors.WriterFencedError:
                reply(fenced=[key, value, deleted])
                break
            reply(ack=[key, value, deleted], position=position(w), epoch=w.epoch)
        try:
            if rng.random() < 0.5:
                w.close()
            else:
                w.abort()
        except errors.WriterFencedError:
            reply(close_fenced=j)
            w.abort()
    reply(done=cmd["n"])


for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    try:
        if op == "open":
            table = mw.open_table(URI, OPTIONS)
            reply(ok=True)
        elif op == "claim":
            durable = cmd.get("durable", True)
            writer = table.region_writer(cmd["region"], durable=durable, **cmd.get("settings", {}))
            replayed = [r["id"] for m in writer.memtables for r in m.to_table().to_pylist()]
            reply(ok=True, epoch=writer.epoch, replayed=replayed, position=position(writer))
        elif op == "writer":
            writer = table.writer(durable=cmd.get("durable", True), **cmd.get("settings", {}))
            reply(ok=True)
        elif op == "inject":
            inject(cmd["point"], cmd["k"])
            reply(ok=True)
        elif op in ("put", "delete"):
            apply(writer, cmd)
            reply(ok=True, position=position(writer))
        elif op == "flush":
            writer.flush()
            reply(ok=True)
        elif op == "close":
            writer.close()
            reply(ok=True)
        elif op == "abort":
            writer.abort()
            reply(ok=True)
        elif op == "stream":
            stream(cmd)
        elif op == "race":
            race(cmd)
        elif op == "exit":
            reply(ok=True)
            os._exit(0)
        else:
            reply(error="unknown", msg=op)
    except errors.MemWalError as e:
        reply(**error(e))
    except Exception as e:
        reply(error=type(e).__name__, msg=traceback.format_exc())
'''

TIMEOUT = 120.0


@pytest.fixture(scope="session")
def worker_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crash_worker") / "memwal_worker.py"
    path.write_text(WORKER)
    return path


class Worker:
    """A child process running WORKER; `call` sends a command and returns its reply (None: it died)."""

    def __init__(self, script: Path, uri: str, options: dict[str, str] | None, log_dir: Path) -> None:
        self.stderr_path = log_dir / f"worker-{uuid.uuid4().hex[:8]}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", str(script), uri, json.dumps(options)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, command: str, /, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**args, "op": command}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = TIMEOUT) -> dict[str, Any] | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"worker did not answer in {timeout}s; stderr:\n{self.stderr()}") from None

    def call(self, command: str, /, **args: Any) -> dict[str, Any] | None:
        self.send(command, **args)
        return self.read()

    def ok(self, command: str, /, **args: Any) -> dict[str, Any]:
        reply = self.call(command, **args)
        assert reply is not None and "error" not in reply, f"{command}: {reply}; stderr:\n{self.stderr()}"
        return reply

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        close_process(self.proc)


@pytest.fixture
def spawn(worker_script: Path, tmp_path: Path):
    workers: list[Worker] = []

    def start(uri: str, options: dict[str, str] | None) -> Worker:
        w = Worker(worker_script, uri, options, tmp_path)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


def new_table(uri: str, options: dict[str, str] | None) -> mw.Table:
    return mw.create_table(
        uri,
        pa.Table.from_pylist(BASE, schema=SCHEMA),
        "id",
        region_spec=mw.bucket("id", 4),
        storage_options=options,
    )


def manual_table(uri: str, options: dict[str, str] | None) -> mw.Table:
    """A table without a region spec: its regions are created by hand, under any region id."""
    return mw.create_table(uri, pa.Table.from_pylist(BASE, schema=SCHEMA), "id", storage_options=options)


class Model:
    """The acknowledged state: key → row."""

    def __init__(self) -> None:
        self.rows: dict[Any, dict[str, Any]] = {r["id"]: dict(r) for r in BASE}

    def apply(self, op: dict[str, Any]) -> None:
        apply_rows(self.rows, op_rows(op))

    def copy(self) -> Model:
        m = Model()
        m.rows = {k: dict(v) for k, v in self.rows.items()}
        return m


def op_rows(op: dict[str, Any]) -> list[dict[str, Any]]:
    if op["op"] == "put":
        return [{"id": k, "name": n, "v": v, "_tombstone": False} for k, n, v in op["rows"]]
    return [{"id": k, "name": None, "v": None, "_tombstone": True} for k in op["keys"]]


def apply_op(writer: Any, op: dict[str, Any]) -> None:
    """Run a worker-style op on an in-process writer."""
    if op["op"] == "put":
        writer.put(
            pa.Table.from_pylist([{"id": k, "name": n, "v": v} for k, n, v in op["rows"]], schema=SCHEMA)
        )
    else:
        writer.delete(op["keys"])


def check_all_regions(table: mw.Table) -> dict[uuid.UUID, Any]:
    return {rid: check_region(table, rid) for rid in table.region_ids()}


def region_of(table: mw.Table, key: int) -> uuid.UUID:
    values = not_none(table.spec).evaluate(
        pa.table({"id": pa.array([key], pa.int64())}), table.schema.field_ids
    )
    return table.region_id_for((values[0][0].as_py(),))


def cycle_ops(cycle: int) -> list[dict[str, Any]]:
    """Three durable writes: new keys, updates of earlier keys and of base keys, deletes."""
    base = 10 * cycle
    return [
        {"op": "put", "rows": [[base + i, f"c{cycle}", float(i)] for i in range(4)]},
        {
            "op": "put",
            "rows": [[base + 1, f"c{cycle}-upd", None], [base - 8, None, 0.5], [1, f"c{cycle}", None]],
        },
        {"op": "delete", "keys": [base + 2, base - 7, 3, 999]},
    ]


# ---------------------------------------------------------------------------------------------------
# A crash at every step of a MemTable flush
# ---------------------------------------------------------------------------------------------------

# The Lance data, the bloom filter and the pk index are written concurrently (any order); all of
# them are synced before the manifest names the generation.
FLUSH_POINTS = [
    "gen_after_lance",
    "gen_after_bloom",
    "gen_after_pk_index",
    "gen_before_sync",
    "gen_after_manifest",
    "gen_after_hint",
]
COMMITTED = {"gen_after_manifest", "gen_after_hint"}


@pytest.mark.parametrize(
    "kind, point, k",
    cases(
        [("local", p, 1) for p in FLUSH_POINTS]
        + [("local", "gen_after_pk_index", 2), ("s3", "gen_after_bloom", 2)],
        [(kind, p, k) for kind in ("local", "s3") for p in FLUSH_POINTS for k in (1, 2, 3)],
    ),
)
def test_crash_during_memtable_flush(request, tmp_path, spawn, kind, point, k):
    """The child flushes k times (3 durable writes before each); the k-th flush dies at `point`."""
    uri, options = backend(request, kind, tmp_path)
    manual_table(uri, options)
    rid = uuid.uuid4()
    model = Model()
    w = spawn(uri, options)
    w.ok("open")
    w.ok("claim", region=str(rid), durable=True)
    w.ok("inject", point=point, k=k)
    for cycle in range(1, k + 1):
        for op in cycle_ops(cycle):
            w.ok(op["op"], **op)
            model.apply(op)
        reply = w.call("flush")
        if cycle < k:
            assert reply == {"ok": True}
    assert reply is None and w.wait() == 9, f"the crash point was not reached: {reply}\n{w.stderr()}"

    table = mw.open_table(uri, options)
    committed = point in COMMITTED
    found = check_region(table, rid)
    latest = not_none(RegionManifestStore(table.storage, rid).latest())
    assert [s.generation for s in latest.sstables] == list(range(1, k + 1 if committed else k))
    hint = json.loads(table.storage.get(layout.version_hint_path(rid)))["version"]
    assert hint == (latest.version - 1 if point == "gen_after_manifest" else latest.version)
    if committed:
        assert found.orphans == set()
    else:  # the directory of the k-th flush is there, partly written, and no manifest names it
        (orphan,) = found.orphans
        assert not_none(layout.parse_generation_dir_name(orphan))[1] == k
        rel = layout.generation_path(rid, orphan)
        written = {  # what must be in the directory at each point (the rest may be, in any order)
            "gen_after_lance": {"lance"},
            "gen_after_bloom": {"bloom"},
            "gen_after_pk_index": {"pk"},
            "gen_before_sync": {"lance", "bloom", "pk"},
        }[point]
        assert "lance" not in written or table.storage.list(f"{rel}/_versions"), "Lance data written"
        assert "bloom" not in written or table.storage.exists(f"{rel}/{layout.BLOOM_FILTER_FILE}")
        assert "pk" not in written or table.storage.list(f"{rel}/{layout.PK_INDEX_DIR}")

    assert table.recover() == ([] if committed else [rid])
    assert stored_rows(table) == model.rows
    after = check_region(table, rid)
    latest = not_none(RegionManifestStore(table.storage, rid).latest())
    assert [s.generation for s in latest.sstables] == list(range(1, k + 1))
    assert found.orphans <= after.orphans  # still referenced by no manifest version
    assert latest.sstables[-1].path not in found.orphans  # the retried flush used a new directory
    assert table.recover() == []

    with table.region_writer(rid) as rw:  # the region goes on working
        op = {"op": "put", "rows": [[500, "after", 1.0], [1, "after", 2.0]]}
        apply_op(rw, op)
        model.apply(op)
    assert stored_rows(table) == model.rows
    check_region(table, rid)
    record(GUARANTEE, case_name(request), crash_points=1, rows_checked=len(model.rows))


# ---------------------------------------------------------------------------------------------------
# A crash while claiming a region or while appending to the WAL
# ---------------------------------------------------------------------------------------------------

WRITE_POINTS = [
    "claim_after_commit",
    "claim_after_sentinel",
    "wal_before_publish",
    "wal_after_publish",
    "wal_temp_written",
]


@pytest.mark.parametrize(
    "kind, point, k",
    cases(
        [("local", p, 2) for p in WRITE_POINTS] + [("s3", "wal_after_publish", 2)],
        [
            (kind, p, k)
            for kind in ("local", "s3")
            for p in WRITE_POINTS
            for k in (1, 2, 4)
            if kind == "local" or p != "wal_temp_written"
        ],
    ),
)
def test_crash_while_claiming_or_writing(request, tmp_path, spawn, kind, point, k):
    """The region holds durable writes of an earlier (crashed) writer; a child claims it and writes.
    It dies after committing its claim, after its fence sentinel, or around its k-th WAL append."""
    uri, options = backend(request, kind, tmp_path)
    table = manual_table(uri, options)
    rid = uuid.uuid4()
    model = Model()
    earlier = table.region_writer(rid)
    for op in cycle_ops(1):
        apply_op(earlier, op)
        model.apply(op)
    earlier.abort()

    w = spawn(uri, options)
    w.ok("open")
    if point.startswith("claim"):
        w.ok("inject", point=point, k=1)
        assert w.call("claim", region=str(rid)) is None
    else:
        w.ok("claim", region=str(rid))
        w.ok("inject", point=point, k=k)
        ops = [op for c in range(2, 2 + k) for op in cycle_ops(c)][:k]
        for i, op in enumerate(ops):
            reply = w.call(op["op"], **op)
            if i < k - 1:
                assert reply is not None and reply.get("ok"), reply
                model.apply(op)
        assert reply is None
        if point == "wal_after_publish":  # published, never acknowledged: it is in the WAL, so it counts
            model.apply(ops[-1])
    assert w.wait() == 9, w.stderr()

    table = mw.open_table(uri, options)
    found = check_region(table, rid)
    if point == "claim_after_commit":
        assert found.epochs[-1] == 2 and not any(r.sentinel for r in found.wal)
    elif point == "claim_after_sentinel":
        assert found.wal[-1].sentinel and found.wal[-1].writer_epoch == 2
    if kind == "local":
        wal_dir = Path(uri) / layout.region_dir(rid) / layout.WAL_DIR
        leftovers = [n for n in os.listdir(wal_dir) if ".tmp." in n]
        # An unnamed O_TMPFILE vanishes with the process; a named temp file (file systems without
        # O_TMPFILE) stays, ignored by listings and by the next writer.
        assert bool(leftovers) == (point == "wal_temp_written" and not local_storage._unnamed_files)

    assert table.recover() == [rid]
    assert stored_rows(table) == model.rows
    found = check_region(table, rid)
    assert found.epochs[-1] == 3 and found.orphans == set()
    with table.region_writer(rid) as rw:
        rw.put(pa.Table.from_pylist([{"id": 501, "name": "after", "v": None}], schema=SCHEMA))
    model.apply({"op": "put", "rows": [[501, "after", None]]})
    assert stored_rows(table) == model.rows
    check_region(table, rid)
    record(GUARANTEE, case_name(request), crash_points=1, rows_checked=len(model.rows))


# ---------------------------------------------------------------------------------------------------
# SIGKILL at a random moment of a stream of durable writes (background MemTable flushes included)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, seed",
    cases(
        [("local", 1), ("local", 2), ("s3", 1)],
        [("local", s) for s in range(1, 31)] + [("s3", s) for s in range(1, 7)],
    ),
)
def test_sigkill_during_durable_stream(request, tmp_path, spawn, kind, seed):
    """A routed durable writer streams random puts and deletes (MemTables of 8 rows / 3 batches, so
    flushes run in the background); the child prints each op before and each acknowledgement after.
    It is SIGKILLed at a random moment. Every acknowledged op must be there after recovery; the one
    in flight, if any, is there or not, independently in each region it touches."""
    rng = random.Random(seed)
    uri, options = backend(request, kind, tmp_path)
    table = new_table(uri, options)
    w = spawn(uri, options)
    w.ok("open")
    w.ok("writer", durable=True, settings={"max_memtable_rows": 8, "max_memtable_batches": 3})
    w.send("stream", seed=seed, n=100_000, key_max=40, max_rows=5)
    target, delay = rng.randint(1, 60), rng.uniform(0, 0.1)
    intents: dict[int, dict[str, Any]] = {}
    acked: list[int] = []
    while len(acked) < target:
        msg = w.read()
        assert msg is not None, w.stderr()
        if "intent" in msg:
            intents[msg["intent"]] = msg
        elif "ack" in msg:
            acked.append(msg["ack"])
    time.sleep(delay)
    w.proc.send_signal(signal.SIGKILL)
    while (msg := w.read()) is not None:
        if "intent" in msg:
            intents[msg["intent"]] = msg
        elif "ack" in msg:
            acked.append(msg["ack"])
    assert w.wait() == -signal.SIGKILL
    assert acked == list(range(len(acked)))
    in_flight = [intents[i] for i in intents if i >= len(acked)]
    assert len(in_flight) <= 1

    model = Model()
    for i in acked:
        model.apply(intents[i])
    table = mw.open_table(uri, options)
    before = check_all_regions(table)
    table.recover()
    got = stored_rows(table)
    with_flight = model.copy()
    for op in in_flight:
        with_flight.apply(op)
    keys = set(got) | set(model.rows) | set(with_flight.rows)
    by_region: dict[uuid.UUID, set[Any]] = {}
    for key in keys:
        by_region.setdefault(region_of(table, key), set()).add(key)
    for rid, ks in by_region.items():  # per region: all of the in-flight op's rows, or none
        part = {k: got[k] for k in ks if k in got}
        assert part in (
            {k: model.rows[k] for k in ks if k in model.rows},
            {k: with_flight.rows[k] for k in ks if k in with_flight.rows},
        ), f"seed {seed}: region {rid} lost acknowledged writes or kept part of one write"
    after = check_all_regions(table)
    for rid, found in before.items():
        assert found.orphans <= after[rid].orphans
    assert table.recover() == []
    with table.writer() as again:  # the table goes on working
        again.put(pa.Table.from_pylist([{"id": 7, "name": "after", "v": None}], schema=SCHEMA))
    record(
        GUARANTEE, case_name(request), crash_points=1, writes_acknowledged=len(acked), rows_checked=len(got)
    )


# ---------------------------------------------------------------------------------------------------
# Two processes racing to claim the same region
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, rounds", cases([("local", 12), ("s3", 4)], [("local", 12), ("s3", 4), ("local", 80), ("s3", 20)])
)
def test_two_processes_race_to_claim_a_region(request, tmp_path, spawn, kind, rounds):
    """Two children claim the same (new) region `rounds` times each, write one to three single-key
    puts or deletes after each claim (acknowledged with their WAL position), then close or crash.

    Then: every claim got its own epoch, and epochs step by one, one claim at a time, through
    contiguous manifest versions; no two acknowledged writes share a WAL position; the WAL holds
    exactly the acknowledged writes (a write refused as fenced was never written); and the last
    claim's replay plus the generations give, for each key, the acknowledged write with the highest
    WAL position."""
    uri, options = backend(request, kind, tmp_path)
    table = manual_table(uri, options)
    rid = uuid.uuid4()
    a, b = spawn(uri, options), spawn(uri, options)
    for w in (a, b):
        w.ok("open")
    for w, tag in ((a, "A"), (b, "B")):
        w.send("race", region=str(rid), n=rounds, seed=hash((tag, rounds)) & 0xFFFF, key_max=6, tag=tag)
    messages: list[dict[str, Any]] = []
    for w in (a, b):
        while True:
            msg = w.read()
            assert msg is not None and "error" not in msg, f"{msg}\n{w.stderr()}"
            if "done" in msg:
                break
            messages.append(msg)

    claimed = [m["epoch"] for m in messages if "claimed" in m]
    claim_fenced = sum("claim_fenced" in m for m in messages)
    assert len(claimed) + claim_fenced == 2 * rounds
    assert len(set(claimed)) == len(claimed), "two claims got the same epoch"
    acks = [m for m in messages if "ack" in m]
    positions = [m["position"] for m in acks]
    assert len(set(positions)) == len(positions), "two acknowledged writes at one WAL position"

    final = table.region_writer(rid)  # the last claim
    found = check_region(table, rid)
    assert sorted(set(found.epochs)) == list(range(1, final.epoch + 1))
    assert final.epoch == len(claimed) + claim_fenced + 1
    assert set(claimed) <= set(found.epochs)

    written = {rec.position: (rec.writer_epoch, rec.rows) for rec in found.wal if not rec.sentinel}
    expected = {
        m["position"]: (
            m["epoch"],
            [
                {
                    "id": m["ack"][0],
                    "name": None if m["ack"][2] else m["ack"][1],
                    "v": None,
                    "_tombstone": m["ack"][2],
                }
            ],
        )
        for m in acks
    }
    assert written == expected, "the WAL does not hold exactly the acknowledged writes"

    model = Model()
    for m in sorted(acks, key=lambda m: m["position"]):
        key, value, deleted = m["ack"]
        model.apply(
            {"op": "delete", "keys": [key]} if deleted else {"op": "put", "rows": [[key, value, None]]}
        )
    assert stored_rows(table, final.memtables) == model.rows
    final.close()
    assert stored_rows(table) == model.rows
    assert table.recover() == []
    check_region(table, rid)
    record(
        "fencing: one writer per epoch",
        case_name(request),
        claims=len(claimed) + claim_fenced,
        writes_acknowledged=len(acks),
    )


# ---------------------------------------------------------------------------------------------------
# Spec Appendix 1 (writer fencing) with two real processes
# ---------------------------------------------------------------------------------------------------


def appendix_initial_state(table: mw.Table, rid: uuid.UUID) -> Model:
    """Region manifest version 1: writer_epoch 5, WAL entries up to 10 flushed (as generation 1),
    entries 11 and 12 written by epoch 5 and not flushed, wal_entry_position_last_seen 12."""
    model = Model()
    wal = Wal(table.storage, rid)
    gen1 = MemTable(1, table.schema.wal, table.schema.primary_key)
    for position in range(1, 13):
        batch = pa.RecordBatch.from_pylist(
            [{"id": 100 + position, "name": f"e5-{position}", "v": None, "_tombstone": False}],
            schema=table.schema.wal,
        )
        assert wal.append(position, encode_entry([batch], 5, 1 if position <= 10 else 2))
        if position <= 10:
            gen1.append(batch)
        model.apply({"op": "put", "rows": [[100 + position, f"e5-{position}", None]]})
    sst = write_generation(table.storage, rid, gen1, table.data_storage_version)
    m = new_manifest(rid, 0, {})
    m.writer_epoch = 5
    m.replay_after_wal_entry_position = 10
    m.wal_entry_position_last_seen = 12
    m.current_generation = 2
    m.sstables.append(sst)
    assert RegionManifestStore(table.storage, rid).commit(m)
    return model


def put_op(keys: list[int], tag: str) -> dict[str, Any]:
    return {"op": "put", "rows": [[k, f"{tag}{k}", None] for k in keys]}


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_appendix1_writer_fencing_with_processes(request, tmp_path, spawn, kind):
    uri, options = backend(request, kind, tmp_path)
    table = manual_table(uri, options)
    rid = uuid.uuid4()
    model = appendix_initial_state(table, rid)
    store = RegionManifestStore(table.storage, rid)
    a, b = spawn(uri, options), spawn(uri, options)
    a.ok("open")
    b.ok("open")

    # 1-2: A loads version 1 (epoch 5) and claims epoch 6; it replays entries 11 and 12.
    reply = a.ok("claim", region=str(rid))
    assert reply["epoch"] == 6 and sorted(reply["replayed"]) == [111, 112]
    assert not_none(store.latest()).writer_epoch == 6
    # 3: A writes three WAL entries (after its fence sentinel at 13: ours are 14, 15, 16).
    a_positions = []
    for i in range(3):
        op = put_op([200 + i], "A")
        a_positions.append(a.ok(op["op"], **op)["position"])
        model.apply(op)
    assert a_positions == [14, 15, 16]
    # 4-5: B loads the manifest (epoch 6) and claims epoch 7; its replay includes A's entries.
    reply = b.ok("claim", region=str(rid))
    assert reply["epoch"] == 7 and sorted(reply["replayed"]) == [111, 112, 200, 201, 202]
    m = not_none(store.latest())
    assert m.writer_epoch == 7 and m.replay_after_wal_entry_position == 10
    # 6: B writes two WAL entries (after its sentinel at 17).
    for i in range(2):
        op = put_op([300 + i], "B")
        assert b.ok(op["op"], **op)["position"] == 18 + i
        model.apply(op)
    # 7-9: A tries to flush its MemTable: it sees epoch 7 > 6 and is fenced; every later call fails.
    reply = a.call("flush")
    assert reply["error"] == "WriterFencedError" and "epoch 7" in reply["msg"]
    op = put_op([299], "A")
    assert a.call(op["op"], **op)["error"] == "WriterFencedError"
    assert a.ok("close") == {"ok": True}  # a fenced writer closes without flushing
    # 10: B continues normally and flushes.
    op = put_op([302, 200], "B")
    b.ok(op["op"], **op)
    model.apply(op)
    b.ok("close")

    wal = wal_records(table, rid)
    assert [(r.position, r.writer_epoch, r.sentinel) for r in wal] == (
        [(p, 5, False) for p in range(1, 13)]
        + [(13, 6, True), (14, 6, False), (15, 6, False), (16, 6, False)]
        + [(17, 7, True), (18, 7, False), (19, 7, False), (20, 7, False)]
    )
    found = check_region(table, rid)
    latest = not_none(store.latest())
    assert latest.writer_epoch == 7 and [s.generation for s in latest.sstables] == [1, 2]
    assert latest.replay_after_wal_entry_position == 20
    assert len(found.orphans) == 1  # A's generation 2 attempt, written before it saw the new epoch
    assert stored_rows(table) == model.rows  # no data loss: A's entries are in B's generation
    for a_key in (200, 201, 202):
        assert a_key in model.rows


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_fenced_non_durable_writer_reports_its_buffered_rows(request, tmp_path, spawn, kind):
    """Appendix 1 with a non-durable writer A: its rows not yet in the WAL when B claims are returned
    in `WriterFencedError.not_durable` and are nowhere in the table; its WAL-flushed rows survive."""
    uri, options = backend(request, kind, tmp_path)
    table = manual_table(uri, options)
    rid = uuid.uuid4()
    model = Model()
    a, b = spawn(uri, options), spawn(uri, options)
    a.ok("open")
    b.ok("open")
    a.ok("claim", region=str(rid), durable=False, settings={"max_wal_flush_interval_ms": 600_000})
    op = put_op([1, 2], "A")
    a.ok(op["op"], **op)
    a.ok("flush")  # durable now
    model.apply(op)
    buffered = [put_op([3], "A"), {"op": "delete", "keys": [1]}]
    for op in buffered:
        a.ok(op["op"], **op)
    assert b.ok("claim", region=str(rid))["epoch"] == 2
    reply = a.call("flush")
    assert reply["error"] == "WriterFencedError"
    assert reply["not_durable"] == [r for op in buffered for r in op_rows(op)]
    b.ok("close")
    assert stored_rows(table) == model.rows


# ---------------------------------------------------------------------------------------------------
# Ambiguous outcomes: a write that landed although the call failed (a lost response, a timeout)
# ---------------------------------------------------------------------------------------------------


def _manifest_pair(storage: Any) -> tuple[uuid.UUID, Any]:
    rid = uuid.uuid4()
    v1 = new_manifest(rid, 0, {})
    assert RegionManifestStore(storage, rid).commit(v1)
    return rid, v1


@pytest.mark.parametrize("failure", ["retried-412", "timeout"])
def test_ambiguous_claim_commit_is_never_taken_for_ours(monkeypatch, failure):
    """Two claimers of a region build byte-identical claim manifests (version N+1, epoch + 1). If A's
    PUT gets no clear answer while B's identical claim landed, A must not take B's file for its own:
    both would hold the same epoch and fencing would be gone. A must see a lost race (and claim a
    higher epoch)."""
    storage = open_storage(f"memory:///{uuid.uuid4()}")
    rid, v1 = _manifest_pair(storage)
    claim = next_version(v1)
    claim.writer_epoch = 2
    assert RegionManifestStore(storage, rid).commit(claim)  # B
    identical = next_version(v1)
    identical.writer_epoch = 2
    assert identical.SerializeToString() == claim.SerializeToString()

    def no_answer(store, key, data, **kw):  # A's request never landed; the store gave no clear answer
        if failure == "retried-412":
            raise AlreadyExistsError(
                f"Object at location {key} already exists ... retries: 1, max_retries: 10"
            )
        raise OSError("Generic S3 error: error sending request: operation timed out")

    monkeypatch.setattr(obstore, "put", no_answer)
    assert RegionManifestStore(storage, rid).commit(identical) is False


def test_ambiguous_flush_commit_that_landed_counts_as_committed(monkeypatch):
    """A flush commit (same epoch as the version before it, a new random generation path) that
    landed although its PUT timed out is ours: commit() reports success, not an error the writer
    would answer by flushing the generation a second time."""
    storage = open_storage(f"memory:///{uuid.uuid4()}")
    rid, v1 = _manifest_pair(storage)
    flushed = next_version(v1)
    flushed.sstables.add(generation=1, path="0123abcd_gen_1")
    flushed.current_generation = 2
    real_put = obstore.put

    def landed_then_timeout(store, key, data, **kw):
        real_put(store, key, data, **kw)
        raise OSError("Generic S3 error: error sending request: operation timed out")

    monkeypatch.setattr(obstore, "put", landed_then_timeout)
    assert RegionManifestStore(storage, rid).commit(flushed) is True
    monkeypatch.undo()
    assert RegionManifestStore(storage, rid).latest() == flushed


def _fail_once_after_landing(
    monkeypatch, cls: type[LocalStorage], path_part: str, make_error: Any
) -> list[str]:
    """Wrap `cls.put_if_not_exists`: the next call whose path contains `path_part` writes, then raises."""
    real = cls.put_if_not_exists
    hits: list[str] = []

    def wrapped(self, path, data):
        created = real(self, path, data)
        if path_part in path and not hits:
            hits.append(path)
            raise make_error(path)
        return created

    monkeypatch.setattr(cls, "put_if_not_exists", wrapped)
    return hits


@pytest.mark.s3
def test_flush_whose_manifest_put_lost_its_answer_commits_once(monkeypatch, s3_bucket, s3_storage_options):
    """On S3 a manifest PUT can land while the client sees a timeout. The flush must not be retried
    into a second directory listed as the same generation."""
    uri = f"s3://{s3_bucket}/{uuid.uuid4()}"
    table = manual_table(uri, s3_storage_options)
    rid = uuid.uuid4()
    rw = table.region_writer(rid)
    apply_op(rw, put_op([1, 2], "x"))
    real_put = obstore.put
    hits: list[str] = []

    def landed_then_timeout(store, key, data, **kw):
        real_put(store, key, data, **kw)
        if "/manifest/" in key and key.endswith(".binpb") and not hits:
            hits.append(key)
            raise OSError("Generic S3 error: error sending request: operation timed out")

    monkeypatch.setattr(obstore, "put", landed_then_timeout)
    rw.flush()
    rw.close()
    assert hits
    latest = not_none(RegionManifestStore(table.storage, rid).latest())
    assert [s.generation for s in latest.sstables] == [1]
    check_region(table, rid)


def test_flush_retried_after_an_unresolvable_commit_error_lists_the_generation_once(monkeypatch, tmp_path):
    """Local storage: the manifest is linked into place, then fsync of the directory fails, so the
    commit raises though the version exists (no read-back can settle it). The writer retries the
    flush; the region must still list generation 1 once."""
    table = manual_table(str(tmp_path / "t"), None)
    rid = uuid.uuid4()
    rw = table.region_writer(rid)
    apply_op(rw, put_op([1, 2], "x"))
    _fail_once_after_landing(
        monkeypatch, LocalStorage, "/manifest/", lambda p: StorageError(f"fsync {p}: EIO")
    )
    try:
        rw.flush()
    except StorageError:
        rw.flush()  # the error is reported once; the background flush retries
    rw.close()
    check_region(table, rid)


def test_wal_append_that_raised_but_landed_does_not_fence_the_writer(monkeypatch, tmp_path):
    table = manual_table(str(tmp_path / "t"), None)
    rid = uuid.uuid4()
    rw = table.region_writer(rid)
    apply_op(rw, put_op([1], "a"))
    _fail_once_after_landing(monkeypatch, LocalStorage, "/wal/", lambda p: StorageError(f"fsync {p}: EIO"))
    with pytest.raises(StorageError):  # the outcome of this write is unknown to the caller ...
        apply_op(rw, put_op([2], "b"))
    apply_op(rw, put_op([3], "c"))  # ... but the writer must go on working
    # what this process shows is what a crash now would leave (the landed write included)
    assert stored_rows(table, rw.memtables) == durable_rows(table)
    rw.close()


def test_entries_without_rows_leave_nothing_to_recover(tmp_path):
    """Empty puts and deletes write nothing; a WAL entry without rows written by another writer (an
    older memwal_df wrote them for empty writes) is nothing to recover either: recover() used to
    re-claim such a region on every call, forever (a new epoch, sentinel and two versions each time)."""
    table = manual_table(str(tmp_path / "t"), None)
    rid = uuid.uuid4()
    rw = table.region_writer(rid)
    rw.put(SCHEMA.empty_table())
    rw.delete(pa.table({"id": pa.array([], pa.int64())}))
    assert rw.stats()["next_wal_position"] == 1
    empty = pa.RecordBatch.from_pylist([], schema=table.schema.wal)
    assert Wal(table.storage, rid).append(1, encode_entry([empty], rw.epoch, 1))
    rw.abort()
    epoch = not_none(RegionManifestStore(table.storage, rid).latest()).writer_epoch
    assert table.recover() == []
    assert table.recover() == []
    assert not_none(RegionManifestStore(table.storage, rid).latest()).writer_epoch == epoch
    assert stored_rows(table) == Model().rows
