"""SIGKILL at exact file-system calls inside a region claim and inside recovery.

A claim takes milliseconds, so the random-moment kills of `test_crash.py` and `test_crash_jobs.py`
rarely land inside one. Here a ptrace tracer kills the child on entry to its k-th call of a class of
file-system calls, counted over all its threads (`tests/support/syscall_kill.py`; the child is
`tests/support/crash_point_child.py`), for k = 1, 2, ... until a run ends unkilled: every position
of that class in the run is a crash point. The classes: `namespace` (every change of a directory's
entries: link, rename, mkdir, unlink families; killed before each, the process has made exactly the
changes before it) and `sync` (fsync, fdatasync: killed after a publish, before its directory sync).

* Kills inside a region claim: the child claims a region round after round (replaying the WAL,
  fencing older writers with a sentinel and recording it in the manifest), makes durable writes
  after each claim (acknowledged once the call returned) and aborts, as a crash without a flush
  would. Two regions of one table: one holding a dead writer's flushed generation and unflushed
  durable WAL entries, and one that does not exist yet (its first claim creates it). A slow case
  gives the writer small MemTables, so background flushes (the replayed rows first) run between
  the claims and the kills land in them too.
* Kills during recovery: `open_table(uri).recover()` in a child, on a table whose regions hold
  unflushed durable WAL entries of a dead writer (so recovery claims, replays and flushes every
  region), killed at the k-th call; then a second recovering child, killed at a random position up
  to k (or finishing when it does not get that far); then recovery to the end. The durable state
  after each kill must be exactly the acknowledged one, and GC then removes the generation
  directories the killed flushes left.

After every kill: the table opens, `status` works and the SQL reader shows exactly what the oracle
reads from storage; what a crash now would leave (`durable_rows`) is the acknowledged state (the
write in flight whole or absent); every region keeps its invariants (`check_region`); recovery
stores exactly that state; a second recovery has nothing to do; the region takes a new write. S3 is
not covered: its publishes are HTTP requests, not file-system calls.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from support.children import op_rows
from support.figures import case_name, record
from support.optional import not_none
from support.reference import stored_rows
from support.syscall_kill import CLASSES, ChildPool, Run, start_tracer, unavailable
from support.wal_oracle import apply_rows, check_region, durable_rows

import memwal_df as mw
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
BASE = [{"id": k, "v": float(k)} for k in range(6)]
KEYS = range(40)
CLAIM = "kills inside a region claim"
RECOVERY = "kills during recovery"

NO_TRACER = unavailable()
pytestmark = pytest.mark.skipif(NO_TRACER is not None, reason=str(NO_TRACER))


# ---------------------------------------------------------------------------------------------------
# Tables, models and the checks after a kill
# ---------------------------------------------------------------------------------------------------


def model_of(ops: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    model = {r["id"]: dict(r) for r in BASE}
    for op in ops:
        apply_rows(model, op_rows(op))
    return model


def lost_writes(ops: list[dict[str, Any]], got: dict[Any, dict[str, Any]]) -> int:
    """How many acknowledged ops (the base rows count as one) no longer show in `got`: per key, the
    last op that wrote it must have left its row (or its absence)."""
    model = {r["id"]: dict(r) for r in BASE}
    last = dict.fromkeys(model, -1)
    for i, op in enumerate(ops):
        rows = op_rows(op)
        apply_rows(model, rows)
        last.update((r["id"], i) for r in rows)
    return len({last[k] for k in last if got.get(k) != model.get(k)})


def apply_op(writer: Any, op: dict[str, Any]) -> None:
    if op["op"] == "put":
        writer.put(pa.Table.from_pylist([{"id": k, "v": v} for k, v in op["rows"]], schema=SCHEMA))
    else:
        writer.delete(op["keys"])


def random_ops(rng: random.Random, keys: list[int], n: int, tag: int) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    for i in range(n):
        if rng.random() < 0.25:
            ops.append({"op": "delete", "keys": rng.sample(keys, 2)})
        else:
            ops.append(
                {"op": "put", "rows": [[k, tag + i + j / 10] for j, k in enumerate(rng.sample(keys, 3))]}
            )
    return ops


def bucket_keys(table: mw.Table) -> dict[int, list[int]]:
    values = not_none(table.spec).evaluate(
        pa.table({"id": pa.array(list(KEYS), pa.int64())}), table.schema.field_ids
    )
    out: dict[int, list[int]] = {}
    for key, value in zip(KEYS, values[0].to_pylist(), strict=True):
        out.setdefault(value, []).append(key)
    return out


@dataclass
class Template:
    """A table directory a dead writer left behind (copied afresh for every kill point), the writes
    it acknowledged, and the keys of each bucket (region value)."""

    path: Path
    ops: list[dict[str, Any]]
    keys: dict[int, list[int]]

    def copy(self, dst: Path) -> str:
        shutil.copytree(self.path, dst)
        return str(dst)


def dead_writer_table(path: Path, buckets: list[int], seed: int) -> Template:
    """A table (bucket(id, 2)) whose regions of `buckets` each hold a flushed generation and durable
    WAL entries no generation covers, written by a writer that stopped without flushing."""
    table = mw.create_table(
        str(path), pa.Table.from_pylist(BASE, schema=SCHEMA), "id", region_spec=mw.bucket("id", 2)
    )
    keys = bucket_keys(table)
    rng = random.Random(seed)
    writer = table.writer(durable=True)
    ops = []
    for phase in range(2):
        for op in random_ops(rng, [k for b in buckets for k in keys[b]], 4, 100 * (phase + 1)):
            apply_op(writer, op)
            ops.append(op)
        if phase == 0:
            writer.flush()
    writer.abort()
    return Template(path, ops, keys)


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Template]:
    root = tmp_path_factory.mktemp("crash_point_templates")
    return {
        "claim": dead_writer_table(root / "claim", [0], seed=1),  # region 1 does not exist yet
        "recover": dead_writer_table(root / "recover", [0, 1], seed=2),
    }


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    p = ChildPool(tmp_path_factory.mktemp("crash_point_children"))
    yield p
    p.close()


def sql_rows(uri: str) -> dict[Any, dict[str, Any]]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    return {r["id"]: r for r in mw.query(ctx, "SELECT id, v FROM t").to_pylist()}


@dataclass
class Tally:
    """Figures of one test case; `problems` are the failed checks (the test fails on any)."""

    kills: int = 0
    kills_inside: int = 0  # inside a claim / inside recovery
    kills_elsewhere: int = 0  # in a write or flush (claim test), a second kill (recovery test)
    positions: set[tuple[str, int]] = field(default_factory=set)
    writes_checked: int = 0
    lost: int = 0
    failed_to_open: int = 0
    orphans: int = 0  # generation directories of killed flushes GC removed
    problems: list[str] = field(default_factory=list)


def check_regions(table: mw.Table) -> None:
    """`check_region` on every region; a region directory without a manifest version (a first claim
    killed before its commit) must hold nothing else."""
    for rid in table.region_ids():
        if RegionManifestStore(table.storage, rid).latest() is None:
            left = [p for p in table.storage.list(layout.region_dir(rid)) if "version_hint" not in p]
            assert not left, f"region {rid} has no manifest version but holds {left}"
        else:
            check_region(table, rid)


def check_table(
    uri: str, acked: list[dict[str, Any]], in_flight: dict[str, Any] | None, tally: Tally, where: str
) -> dict[Any, dict[str, Any]] | None:
    """The checks every crashed state must pass (module docstring), recovery included; returns the
    recovered rows (None when the table did not open)."""
    try:
        table = mw.open_table(uri)
        table.status()
        seen = sql_rows(uri)
    except Exception as e:  # the table must open and read whatever the crash left
        tally.failed_to_open += 1
        tally.problems.append(f"{where}: the table did not open or read: {type(e).__name__}: {e}")
        return None
    allowed = [model_of(acked)] + ([model_of([*acked, in_flight])] if in_flight else [])
    tally.writes_checked += len(acked)
    problems = tally.problems
    try:
        if seen != stored_rows(table):
            problems.append(f"{where}: the SQL reader does not show what storage holds")
        crash_now = durable_rows(table)
        if crash_now not in allowed:
            tally.lost += lost_writes(acked, crash_now)
            problems.append(f"{where}: a crash now would leave a state the acknowledged writes do not")
        check_regions(table)
        table.recover()
        recovered = stored_rows(table)
        if recovered != crash_now:
            tally.lost += lost_writes(acked, recovered)
            problems.append(f"{where}: recovery did not store what the WAL and generations held")
        if sql_rows(uri) != recovered:
            problems.append(f"{where}: the SQL reader does not show the recovered rows")
        if table.recover() != []:
            problems.append(f"{where}: a second recovery found something to recover")
        check_regions(table)
        return recovered
    except Exception as e:
        problems.append(f"{where}: {type(e).__name__}: {e}")
        return None


def acked_ops(run: Run) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(acknowledged ops in order, the op in flight when the child died) from a child's messages."""
    intents = {m["intent"]: m for m in run.messages if "intent" in m}
    acked = [m["ack"] for m in run.messages if "ack" in m]
    assert acked == list(range(len(acked))), "acknowledgements out of order"
    flight = [intents[i] for i in intents if i >= len(acked)]
    assert len(flight) <= 1 and (not flight or run.killed)
    return [intents[i] for i in acked], (flight[0] if flight else None)


def sweep(cls: str, ks: range, run_point: Any) -> int:
    """`run_point((cls, k))` for each k in `ks` until it reports a run that was not killed; returns
    how many calls of the class that run made (the positions there are)."""
    for k in ks:
        calls = run_point((cls, k))
        if calls is not None:
            return calls
    raise AssertionError(f"still killed at call {ks[-1]} of {cls}: the sweep never ended")


def report(
    guarantee: str, request: pytest.FixtureRequest, tally: Tally, inside: str, elsewhere: str, **more: int
) -> None:
    record(
        guarantee,
        case_name(request),
        **more,
        crash_points=tally.kills,
        **{inside: tally.kills_inside, elsewhere: tally.kills_elsewhere},
        syscall_positions=len(tally.positions),
        acked_writes_checked=tally.writes_checked,
        writes_lost=tally.lost,
        tables_not_opening=tally.failed_to_open,
    )
    assert not tally.problems, "\n".join(tally.problems[:20])
    assert tally.lost == 0 and tally.failed_to_open == 0


# ---------------------------------------------------------------------------------------------------
# The tracer
# ---------------------------------------------------------------------------------------------------

THREADED = """
import os, sys, threading
print("ready", flush=True)
sys.stdin.readline()
os.link("a", "b")
worker = threading.Thread(target=lambda: (os.link("a", "c"), os.rename("c", "d")))
worker.start()
worker.join()
os.mkdir("e")
print("done", flush=True)
"""


def test_the_tracer_kills_on_entry_to_the_kth_call_counted_over_threads(tmp_path):
    """Killed on entry to the k-th directory change (the second and third made by another thread),
    the process has made exactly the k-1 before it."""
    after = [set(), {"b"}, {"b", "c"}, {"b", "d"}, {"b", "d", "e"}]
    for k, expected in enumerate(after, start=1):
        cwd = tmp_path / str(k)
        cwd.mkdir()
        (cwd / "a").write_text("x")
        child = subprocess.Popen(
            [sys.executable, "-c", THREADED],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        tracer = start_tracer(child.pid, k, CLASSES["namespace"], None)
        out, _ = child.communicate("go\n", timeout=60)
        said = tracer.communicate(timeout=60)[0]
        if k < len(after):
            assert child.returncode == -signal.SIGKILL and said.startswith("killed"), (k, said, out)
        else:
            assert child.returncode == 0 and out == "done\n" and said == "ended 4\n", (said, out)
        assert set(os.listdir(cwd)) - {"a"} == expected, f"killed on entry to call {k}"


# ---------------------------------------------------------------------------------------------------
# Kills inside a region claim
# ---------------------------------------------------------------------------------------------------


def claim_cases() -> list[Any]:
    sample = [("replay", "namespace", 1, None), ("new", "namespace", 1, None)]
    everything: list[tuple[str, str, int, int | None]] = [
        (region, cls, 3, None) for region in ("replay", "new") for cls in ("namespace", "sync")
    ]
    everything.append(("replay", "namespace", 2, 4))
    out = [pytest.param(*c, id="-".join(map(str, c))) for c in sample]
    out += [pytest.param(*c, marks=pytest.mark.slow, id="-".join(map(str, c))) for c in everything]
    return out


@pytest.mark.parametrize("region, cls, rounds, memtable_rows", claim_cases())
def test_kills_inside_a_region_claim(request, tmp_path, templates, pool, region, cls, rounds, memtable_rows):
    """`region`: "replay" (a dead writer's unflushed WAL entries to replay, a sentinel to write) or
    "new" (the first claim creates the region). The child claims it `rounds` times, with two
    durable writes after each claim, and is killed at each call of the class `cls` in turn. With
    `memtable_rows`, MemTables that small: the writer flushes in the background (the replayed rows
    first), and kills land in those flushes too."""
    template = templates["claim"]
    bucket = 0 if region == "replay" else 1
    key = template.keys[bucket][0]
    tally = Tally()

    def run_point(kill: tuple[str, int]) -> int | None:
        uri = template.copy(tmp_path / f"{kill[0]}-{kill[1]}")
        command = {
            "uri": uri,
            "op": "claims",
            "values": [bucket],
            "keys": template.keys[bucket][:8],
            "rounds": rounds,
            "writes": 2,
            "seed": kill[1],
            "settings": {"max_memtable_rows": memtable_rows} if memtable_rows else {},
        }
        run = pool.take().run(command, kill)
        acked, in_flight = acked_ops(run)
        where = f"{region} region, killed on {run.call} (call {kill[1]} of {kill[0]})"
        if run.killed:
            tally.kills += 1
            tally.positions.add(kill)
            last = run.last("claiming", "claimed", "intent", "ack", "aborting", "aborted")
            assert last is not None, f"{where}: killed before the first claim"
            if "claiming" in last:
                tally.kills_inside += 1
            else:
                tally.kills_elsewhere += 1
                assert memtable_rows or "intent" in last or "aborting" in last, (
                    f"{where}: killed outside a claim, a write or an abort: {last}"
                )
        recovered = check_table(uri, template.ops + acked, in_flight, tally, where)
        if recovered is not None:  # the region goes on working
            table = mw.open_table(uri)
            with table.region_writer(values=[bucket]) as w:
                apply_op(w, {"op": "put", "rows": [[key, -1.0]]})
            if stored_rows(table) != {**recovered, key: {"id": key, "v": -1.0}}:
                tally.problems.append(f"{where}: a write after recovery did not land")
        return None if run.killed else run.calls

    calls = sweep(cls, range(1, 500), run_point)
    # single-threaded but for background flushes: every run makes the same calls
    assert memtable_rows or tally.kills == calls, f"{calls} calls of {cls}, {tally.kills} kills"
    assert tally.kills_inside > 0, f"no {cls} call inside a claim"
    report(CLAIM, request, tally, "kills_inside_claims", "kills_in_writes_and_flushes")


# ---------------------------------------------------------------------------------------------------
# Kills during recovery
# ---------------------------------------------------------------------------------------------------


def test_kills_during_recovery(request, tmp_path, templates, pool):
    """A sample of `test_kills_during_recovery_at_every_call`: every 16th directory change, from
    the 9th."""
    recovery_sweep(request, tmp_path, templates, pool, "namespace", 16)


@pytest.mark.slow
@pytest.mark.parametrize("cls", ["namespace", "sync"])
def test_kills_during_recovery_at_every_call(request, tmp_path, templates, pool, cls):
    """Two regions with unflushed durable WAL entries of a dead writer; `recover()` in a child is
    killed at each call of the class `cls` in turn, then a second recovering child at a random
    position up to that one, then recovery runs to the end. Every write the dead writer acknowledged
    must be there, with its value."""
    recovery_sweep(request, tmp_path, templates, pool, cls, 1)


def recovery_sweep(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    templates: dict[str, Template],
    pool: ChildPool,
    cls: str,
    stride: int,
) -> None:
    """Kill the recovery at every `stride`-th call of `cls` (see the tests above)."""
    template = templates["recover"]
    rng = random.Random(f"{cls}-{stride}")
    tally = Tally()

    def run_point(kill: tuple[str, int]) -> int | None:
        uri = template.copy(tmp_path / f"{kill[0]}-{kill[1]}")
        first = pool.take().run({"uri": uri, "op": "recover"}, kill)
        where = f"recovery killed on {first.call} (call {kill[1]} of {kill[0]})"
        if first.killed:
            tally.kills += 1
            tally.kills_inside += 1
            tally.positions.add(kill)
            assert first.last("recovering", "recovered") == {"recovering": True}, f"{where}: {first.messages}"
            table = mw.open_table(uri)  # the state the kill left, read without changing it
            crash_now = durable_rows(table)
            if crash_now != model_of(template.ops):
                tally.lost += lost_writes(template.ops, crash_now)
                tally.problems.append(f"{where}: a crash now would lose acknowledged writes")
            again = (cls, rng.randint(1, kill[1]))
            second = pool.take().run({"uri": uri, "op": "recover"}, again)
            if second.killed:
                tally.kills += 1
                tally.kills_elsewhere += 1
                where += f", then on {second.call} (call {again[1]})"
        recovered = check_table(uri, template.ops, None, tally, where)
        if recovered is not None:  # GC removes what the killed flushes left (nothing else)
            table = mw.open_table(uri)
            tally.orphans += sum(len(r.orphans) for r in table.gc(grace=timedelta(0)).regions)
            if any(check_region(table, rid).orphans for rid in table.region_ids()):
                tally.problems.append(f"{where}: GC left orphaned generation directories")
            if stored_rows(table) != recovered:
                tally.problems.append(f"{where}: GC changed the stored rows")
        return None if first.killed else first.calls

    sweep(cls, range(1 + stride // 2, 2000, stride), run_point)
    assert tally.kills_inside > 0
    report(RECOVERY, request, tally, "kills_inside_recovery", "second_kills", orphans_collected=tally.orphans)
