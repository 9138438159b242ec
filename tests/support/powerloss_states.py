"""Crash states of a recorded run and their check: `CrashStates` builds the durable state a power
loss after any effect leaves (modes `synced`, `prefix`, `subset`), `check_state` recovers and reads
one in a worker process, `Expectations` knows what each crash point must read, and `run_states`
does it for every workload and reports (`Report`). The model: `tests/support/powerloss.py`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.powerloss import DATA_OPS, DIR_OPS, Effect, Recording

ABSENT = "absent"


# ------------------------------------------------------------------------------- crash states


MODES = ("synced", "prefix", "subset")


@dataclass
class CrashState:
    workload: str
    point: int  # the power fails right after effect `point` (-1: before the first)
    mode: str
    files: dict[str, tuple[int, bytes | None]]  # relative path -> (inode, content; None: a directory)
    landed_unsynced: int  # unsynced effects that landed anyway
    lost_unsynced: int  # unsynced effects that did not land

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for path, (_, data) in sorted(self.files.items()):
            h.update(path.encode() + b"\0")
            h.update(b"d" if data is None else hashlib.sha256(data).digest())
        return h.hexdigest()

    def materialize(self, dest: Path) -> None:
        """Write the state out as a real directory at `dest` (hard links stay hard links)."""
        dest.mkdir(parents=True)
        first: dict[int, Path] = {}
        for path, (ino, data) in sorted(self.files.items()):
            target = dest / path
            if data is None:
                target.mkdir()
            elif ino in first:
                os.link(first[ino], target)
            else:
                target.write_bytes(data)
                first[ino] = target


class CrashStates:
    """The states a power loss can leave one workload's table in (see the module docstring)."""

    def __init__(self, rec: Recording, workload: str) -> None:
        self.rec = rec
        self.workload = workload
        self.top = rec.base.lookup(workload)
        assert self.top is not None
        self.effects = [e for e in rec.effects if e.workload == workload]
        self.points = [e.index for e in self.effects]

    def sync_points(self) -> list[int]:
        """The last point before each fsync or sync of this workload, and the last one: the most
        acknowledged writes each synced state must hold."""
        out = {e.index - 1 for e in self.effects if e.kind in ("fsync", "fsync_dir", "sync")}
        out.add(self.points[-1])
        return sorted(p for p in out if p >= -1)

    def build(self, point: int, mode: str, rng: random.Random | None = None) -> CrashState:
        rng = rng or random.Random(point)
        happened = [e for e in self.effects if e.index <= point and (e.kind in DIR_OPS or e.kind in DATA_OPS)]
        unsynced = [e for e in happened if e.durable_at > point]
        landed: set[int] = set()
        torn: dict[int, tuple[str, int]] = {}  # effect index -> ("cut", length) or ("zeros", 0)
        if mode == "prefix" and unsynced:
            cut = rng.randint(unsynced[0].index - 1, point)
            landed = {e.index for e in unsynced if e.index <= cut}
        elif mode == "subset" and unsynced:
            share = rng.uniform(0.2, 0.8)
            landed = {e.index for e in unsynced if e.kind in DIR_OPS and rng.random() < share}
            per_file: dict[int, list[Effect]] = defaultdict(list)
            for e in unsynced:
                if e.kind in DATA_OPS:
                    per_file[e.ino].append(e)  # type: ignore[index]
            for ops in per_file.values():
                k = rng.randint(0, len(ops))
                landed.update(e.index for e in ops[:k])
                if k < len(ops) and ops[k].kind == "write" and rng.random() < 0.5:
                    nxt = ops[k]
                    torn[nxt.index] = (
                        ("zeros", 0) if rng.random() < 0.5 else ("cut", rng.randint(0, len(nxt.data)))
                    )
                    landed.add(nxt.index)
        elif mode not in MODES:
            raise ValueError(mode)
        entries = {d: dict(c) for d, c in self.rec.base.entries.items()}
        contents: dict[int, bytearray] = {}
        for e in happened:
            if e.durable_at > point and e.index not in landed:
                continue
            if e.kind in ("create", "link", "mkdir"):
                entries.setdefault(e.dir, {})[e.name] = e.ino  # type: ignore[arg-type,assignment,index]
                if e.kind == "mkdir":
                    entries.setdefault(e.ino, {})  # type: ignore[arg-type]
            elif e.kind == "rename":
                src = entries.setdefault(e.dir, {})  # type: ignore[arg-type]
                if src.get(e.name) == e.ino:  # type: ignore[arg-type]
                    del src[e.name]  # type: ignore[arg-type]
                entries.setdefault(e.dir2, {})[e.name2] = e.ino  # type: ignore[arg-type,assignment,index]
            elif e.kind in ("unlink", "rmdir"):
                entries.setdefault(e.dir, {}).pop(e.name, None)  # type: ignore[arg-type]
            else:  # data
                content = contents.get(e.ino)  # type: ignore[arg-type]
                if content is None:
                    content = contents[e.ino] = bytearray(self.rec.base.content.get(e.ino, b""))  # type: ignore[arg-type,index]
                if e.kind == "truncate":
                    if e.offset < len(content):
                        del content[e.offset :]
                    else:
                        content.extend(bytes(e.offset - len(content)))
                    continue
                data = e.data
                if e.index in torn:
                    how, n = torn[e.index]
                    data = bytes(len(data)) if how == "zeros" else data[:n]
                if e.offset > len(content):
                    content.extend(bytes(e.offset - len(content)))
                content[e.offset : e.offset + len(data)] = data
        files: dict[str, tuple[int, bytes | None]] = {}

        def walk(d: int, prefix: str) -> None:
            for name, ino in entries.get(d, {}).items():
                path = prefix + name
                if ino in entries:
                    files[path] = (ino, None)
                    walk(ino, path + "/")
                else:
                    data = contents.get(ino)
                    files[path] = (
                        ino,
                        bytes(data) if data is not None else bytes(self.rec.base.content.get(ino, b"")),
                    )

        walk(self.top, "")  # type: ignore[arg-type]
        return CrashState(self.workload, point, mode, files, len(landed), len(unsynced) - len(landed))


# --------------------------------------------------------------------------------- the checker


# Workloads whose base state holds a torn WAL entry on purpose: recovery of a state in which the
# repair has not landed raises `CorruptRegionsError`, and the operator's procedure follows
# (`repair_region(apply=True)` for each region it names, then `recover()` again).
REPAIRED = frozenset({"repair"})


def check_state(path: str, repair: bool = False) -> dict[str, Any]:
    """Recover the table at `path` (with `repair`: repairing the regions recovery reports corrupt),
    then read it through SQL; every exception is reported."""
    import datafusion

    import memwal_df as mw
    from memwal_df.errors import CorruptRegionsError

    out: dict[str, Any] = {
        "recover_error": None,
        "read_error": None,
        "rows": None,
        "count": None,
        "repaired": 0,
    }
    try:
        table = mw.open_table(path)
        try:
            table.recover()
        except CorruptRegionsError as e:
            if not repair:
                raise
            for region_id in e.errors:
                table.repair_region(region_id, apply=True)
                out["repaired"] += 1
            table.recover()
    except BaseException as e:  # noqa: BLE001 - every failure is a finding, a Lance panic too
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        out["recover_error"] = f"{type(e).__name__}: {str(e)[:600]}"
    try:
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(path))
        out["rows"] = [
            (r["id"], r["value"]) for r in ctx.sql("SELECT id, value FROM t").to_arrow_table().to_pylist()
        ]
        out["count"] = ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().to_pylist()[0]["n"]
    except BaseException as e:  # noqa: BLE001 - a Lance panic too
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        out["read_error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return out


@dataclass
class Write:
    n: int
    op: dict[str, Any]
    intent: int  # effect index of its INTENT line (-1: setup)
    ack: float  # effect index of its ACK line (-1: setup; inf: never acknowledged)

    def values(self) -> dict[int, Any]:
        if self.op["op"] == "put":
            return {k: v for k, v in self.op["rows"]}
        return dict.fromkeys(self.op["keys"], ABSENT)


class Expectations:
    """What each crash point of one workload must read (see the module docstring)."""

    def __init__(self, rec: Recording, workload: str) -> None:
        writes: dict[int, Write] = {}
        for line in rec.setup_lines.get(workload, []):
            kind, _, payload = line.partition(" ")
            if kind in ("INTENT", "ACK"):
                op = json.loads(payload)
                w = writes.setdefault(op["n"], Write(op["n"], op, -1, float("inf")))
                if kind == "ACK":
                    w.ack = -1
        for e in rec.lines(workload):
            kind, _, payload = e.text.partition(" ")
            if kind in ("INTENT", "ACK"):
                op = json.loads(payload)
                w = writes.setdefault(op["n"], Write(op["n"], op, e.index, float("inf")))
                if kind == "ACK":
                    w.ack = e.index
        self.writes = [writes[n] for n in sorted(writes)]
        self.keys = sorted({k for w in self.writes for k in w.values()})

    def acked(self, point: int) -> int:
        return sum(1 for w in self.writes if w.ack <= point)

    def allowed(self, key: int, point: int) -> tuple[set[Any], Write | None]:
        """The values `key` may read after a power loss at `point`, and the write acknowledged last."""
        last, allowed = None, set()
        for w in self.writes:
            if key not in w.values() or w.intent > point:
                continue
            if w.ack <= point:
                last, allowed = w, {w.values()[key]}
            else:
                allowed.add(w.values()[key])
        if last is None:
            allowed.add(ABSENT)
        return allowed, last

    def check(self, point: int, rows: list[tuple[int, float]]) -> list[str]:
        """What is wrong with `rows` at `point` (empty: nothing)."""
        problems = []
        read: dict[int, Any] = {}
        for key, value in rows:
            if key in read:
                problems.append(f"key {key} read twice ({read[key]} and {value})")
            read[key] = value
        for key in sorted(set(self.keys) | set(read)):
            allowed, last = self.allowed(key, point)
            got = read.get(key, ABSENT)
            if got not in allowed:
                if last is not None:
                    value = last.values()[key]
                    when = "in the setup" if last.ack < 0 else f"at #{last.ack}"
                    acked = f"value {value}" if value != ABSENT else "absent"
                    problems.append(
                        f"LOST key {key}: reads {got}; {last.op['op']} #{last.n} ({acked}) was "
                        f"acknowledged {when}; allowed {sorted(map(str, allowed))}"
                    )
                else:
                    problems.append(f"key {key} reads {got}, which no write started before the crash gave it")
        return problems


# ------------------------------------------------------------------------------ a whole run


@dataclass
class Finding:
    workload: str
    point: int
    mode: str
    effect: str  # the effect the power failed after
    op: str
    problems: list[str]


@dataclass
class Report:
    """The outcome of checking the crash states of several workloads."""

    states: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # workload -> distinct states
    points: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # workload -> crash points
    acks_checked: int = 0  # acknowledged writes checked, summed over crash points
    lost: list[Finding] = field(default_factory=list)  # acknowledged writes not read back
    failed: list[Finding] = field(default_factory=list)  # recovery or read raised
    wrong: list[Finding] = field(default_factory=list)  # other wrong reads (duplicates, phantoms)

    def summary(self) -> str:
        out = []
        for w in sorted(self.states):
            lost = sum(1 for f in self.lost if f.workload == w)
            failed = sum(1 for f in self.failed if f.workload == w)
            out.append(
                f"  {w}: {self.points[w]} crash points, {self.states[w]} distinct states, "
                f"{failed} failed to recover or read, {lost} lost acknowledged writes"
            )
        return "\n".join(out)

    def by_operation(self) -> str:
        """Crash points that failed or lost writes, per workload and the operation the power failed in."""
        counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for f in self.failed:
            counts[(f.workload, f.op or "between operations")][0] += 1
        for f in self.lost:
            counts[(f.workload, f.op or "between operations")][1] += 1
        return "\n".join(
            f"  {w}, power lost during {op!r}: {failed} failed, {lost} lost writes"
            for (w, op), (failed, lost) in sorted(counts.items())
        )

    def details(self, limit: int = 40) -> str:
        out = []
        for title, items in (
            ("FAILED TO RECOVER OR READ", self.failed),
            ("LOST ACKNOWLEDGED WRITES", self.lost),
            ("WRONG READS", self.wrong),
        ):
            if not items:
                continue
            out.append(f"{title} ({len(items)} crash points):")
            for f in sorted(items, key=lambda f: (f.workload, f.point, f.mode))[:limit]:
                out.append(f"  [{f.workload}] power lost after {f.effect} [{f.mode}]")
                out.extend(f"      {p}" for p in f.problems[:8])
            if len(items) > limit:
                out.append(f"  ... and {len(items) - limit} more")
        return "\n".join(out)

    def text(self) -> str:
        return "\n".join(
            ["power-loss states:", self.summary(), "by operation:", self.by_operation(), self.details()]
        )


def _pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def choose_points(states: CrashStates, budget: int, rng: random.Random) -> Iterable[tuple[int, str]]:
    """(point, mode) pairs: the base state; the synced state right before every fsync (the most
    acknowledged writes each synced state must hold), spread evenly over half the budget when there
    are more; then random points in the `prefix` and `subset` modes, without end (the caller stops)."""
    synced = states.sync_points()
    take = max(1, budget // 2)
    if len(synced) > take:
        step = len(synced) / take
        synced = sorted({synced[int(i * step)] for i in range(take)} | {synced[-1]})
    yield -1, "synced"
    for p in synced:
        yield p, "synced"
    while True:
        yield rng.choice(states.points), rng.choice(("prefix", "subset"))


def _scratch(work: Path) -> Path:
    """Where states are recovered: a tmpfs (`/dev/shm`) when there is one, as the recovery of a state
    mostly waits for fsyncs, which there cost nothing; else `work`."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="memwal-powerloss-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="scratch-", dir=work))


def run_states(rec: Recording, budget: dict[str, int], work: Path, seed: int = 0, workers: int = 3) -> Report:
    """Build `budget[w]` distinct crash states of each workload `w` (fewer if 6 times as many tries
    find no more), recover and read each in a worker process, and check every crash point against the
    acknowledged writes. A state with a finding is written out again under `work` as the power loss
    left it (before recovery); its path is in the report. Recovery mostly waits for fsyncs:
    `workers` may exceed the cores."""
    report = Report()
    rng = random.Random(seed)
    expectations = {w: Expectations(rec, w) for w in rec.workloads}
    by_index = {e.index: e for e in rec.effects}
    at: dict[str, list[tuple[int, str]]] = defaultdict(list)  # fingerprint -> its (point, mode)s
    made: dict[str, tuple[str, int, str, float]] = {}  # fingerprint -> (workload, point, mode, seed)
    futures: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
    scratch = _scratch(work)
    try:
        with _pool(workers) as pool:
            for w in rec.workloads:
                states = CrashStates(rec, w)
                distinct = 0
                for tries, (point, mode) in enumerate(choose_points(states, budget[w], rng)):
                    if distinct >= budget[w] or tries >= 6 * budget[w]:
                        break
                    state_seed = rng.random()
                    state = states.build(point, mode, random.Random(state_seed))
                    fp = state.fingerprint
                    at[fp].append((point, mode))
                    report.points[w] += 1
                    if fp in futures:
                        continue
                    distinct += 1
                    dest = scratch / f"{w}-{len(futures):05d}"
                    state.materialize(dest)
                    made[fp] = (w, point, mode, state_seed)
                    futures[fp] = pool.submit(check_state, str(dest), w in REPAIRED)
                report.states[w] = distinct
            for n, (fp, future) in enumerate(futures.items()):
                w, first_point, first_mode, state_seed = made[fp]
                kept = work / f"{w}-{n:05d}"
                if _evaluate(report, expectations[w], by_index, w, at[fp], future.result(timeout=900), kept):
                    CrashStates(rec, w).build(first_point, first_mode, random.Random(state_seed)).materialize(
                        kept
                    )
                shutil.rmtree(scratch / f"{w}-{n:05d}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report


def _evaluate(
    report: Report,
    exp: Expectations,
    by_index: dict[int, Effect],
    w: str,
    points: list[tuple[int, str]],
    result: dict[str, Any],
    kept: Path,
) -> bool:
    """Check `result` for every crash point that led to its state, adding findings to `report`;
    whether there was one."""
    found = False
    where_kept = f"state before recovery: {kept}"
    for point, mode in points:
        effect = by_index.get(point)
        where = effect.describe() if effect else "nothing (the base state)"
        op = effect.op if effect else ""
        errors = [f"{k}: {result[k]}" for k in ("recover_error", "read_error") if result[k]]
        if errors:
            report.failed.append(Finding(w, point, mode, where, op, [*errors, where_kept]))
            found = True
        if result["rows"] is None:
            continue
        report.acks_checked += exp.acked(point)
        problems = exp.check(point, result["rows"])
        if result["count"] != len(result["rows"]):
            problems.append(f"count(*) = {result['count']} but the scan returned {len(result['rows'])} rows")
        lost = [p for p in problems if p.startswith("LOST")]
        other = [p for p in problems if not p.startswith("LOST")]
        if lost:
            report.lost.append(Finding(w, point, mode, where, op, [*lost, where_kept]))
        if other:
            report.wrong.append(Finding(w, point, mode, where, op, [*other, where_kept]))
        found = found or bool(problems)
    return found
