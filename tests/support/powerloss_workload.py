"""The child process of the power-loss tests (`tests/support/powerloss.py`):

    python powerloss_workload.py setup ROOT NAME...   # untraced: each workload's table and preparation
    python powerloss_workload.py run ROOT NAME...     # traced under strace: the operations under test

Workload `NAME` works on the table `ROOT/NAME` (int64 key `id`, float64 `value`, two bucket
regions). `setup` creates it and prepares what the traced operation needs (flushed generations,
merged base versions, a base index, a torn WAL entry, a writer killed with SIGKILL, ...); the parent
then makes it durable with `os.sync()` and copies it as the base state. `run` performs the
operations whose file-system effects are recorded.

Everything the parent needs is written to stdout, one `os.write` per line, so that in the strace
trace every line is one `write(1, ...)` at the moment it was written; each line starts with the
workload's name:
* `NAME W <phase>` / `NAME END <phase>`: the workload's part of the phase starts / ends;
* `NAME OP <call>` / `NAME DONE <call>`: a Python-level operation starts / returned;
* `NAME INTENT <json>` before a put or delete is called, `NAME ACK <json>` after it returned (the
  write is acknowledged): `{"n": k, "op": "put", "rows": [[id, value], ...]}` or
  `{"n": k, "op": "delete", "keys": [...]}`; `n` orders the writes of a workload;
* `- BEGIN <k> <lance function> <caller>` / `- END <k>`: an outermost call into pylance (run phase
  only; `caller` is the innermost memwal_df frame), so that the audit knows which files one Lance
  call wrote. The last line of a phase is `- EXIT`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import lance
import lance.file
import lance.fragment
import pyarrow as pa
from lance.dataset import DatasetOptimizer, LanceDataset, MergeInsertBuilder

import memwal_df as mw
from memwal_df.format import layout
from memwal_df.jobs import maintain as maintain_job
from memwal_df.jobs.compaction import CompactionSettings

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("value", pa.float64())])
ZERO = timedelta(0)
# Small thresholds so that a base of a few tiny fragments is compacted.
TINY = CompactionSettings(small_fragment_rows=64, min_small_fragments=2, target_rows_per_fragment=64)


def emit(line: str) -> None:
    data = (line + "\n").encode()
    assert len(data) < 4096, "one write per line"
    written = os.write(1, data)
    assert written == len(data)


class Log:
    """The puts and deletes of one workload, each announced before the call and acknowledged after."""

    def __init__(self, name: str, first: int) -> None:
        self.name = name
        self.n = itertools.count(first)

    def op(self, call: str, fn: Callable[[], Any]) -> Any:
        emit(f"{self.name} OP {call}")
        result = fn()
        emit(f"{self.name} DONE {call}")
        return result

    def put(self, writer: Any, ids: list[int], ack: bool = True) -> None:
        n = next(self.n)
        rows = [[i, float(n * 1000 + i)] for i in ids]
        msg = json.dumps({"n": n, "op": "put", "rows": rows})
        emit(f"{self.name} INTENT {msg}")
        writer.put(pa.Table.from_pylist([{"id": i, "value": v} for i, v in rows], schema=SCHEMA))
        if ack:
            emit(f"{self.name} ACK {msg}")

    def delete(self, writer: Any, ids: list[int]) -> None:
        msg = json.dumps({"n": next(self.n), "op": "delete", "keys": ids})
        emit(f"{self.name} INTENT {msg}")
        writer.delete(pa.table({"id": pa.array(ids, pa.int64())}))
        emit(f"{self.name} ACK {msg}")


def create(log: Log, uri: str) -> mw.Table:
    """The table with its initial rows (ids 0-5, value 0.0), logged as write 0."""
    msg = json.dumps({"n": 0, "op": "put", "rows": [[i, 0.0] for i in range(6)]})
    emit(f"{log.name} INTENT {msg}")
    base = pa.table({"id": pa.array(range(6), pa.int64()), "value": pa.array([0.0] * 6)})
    table = mw.create_table(uri, base, "id", region_spec=mw.bucket("id", 2))
    emit(f"{log.name} ACK {msg}")
    return table


def keys_of(table: mw.Table, region_id: Any, keys: range) -> list[int]:
    rows = pa.table({"id": pa.array(list(keys), pa.int64()), "value": pa.array([0.0] * len(keys))})
    assert table.spec is not None
    values = table.spec.evaluate(rows, table.schema.field_ids)[0].to_pylist()
    return [k for k, v in zip(keys, values, strict=True) if table.region_id_for((v,)) == region_id]


def generations(log: Log, table: mw.Table, rounds: int, merge: bool = False) -> None:
    """`rounds` times: puts and a delete over both regions, a flush (and a merge)."""
    with table.writer(durable=True) as w:
        for r in range(rounds):
            log.put(w, [r, 6 + r, 9 + r])
            log.delete(w, [(4 + r) % 12])
            w.flush()
            if merge:
                table.merge()


def final_put(log: Log, table: mw.Table) -> None:
    """Durable writes after the operation under test (a WAL entry and a region manifest depend on
    whatever the operation left), then a flush by the writer's close."""
    w = log.op("writer", lambda: table.writer(durable=True))
    log.put(w, [1, 11])
    log.delete(w, [0])
    log.op("close", w.close)


# ------------------------------------------------------------------------------------ workloads


def setup_write(log: Log, uri: str) -> None:
    create(log, uri)


def run_write(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    w = log.op("writer", lambda: table.writer(durable=True))
    log.put(w, [0, 6])
    log.put(w, [1, 7])
    log.delete(w, [2])
    log.put(w, [8])
    log.op("flush", w.flush)
    log.put(w, [0, 9])
    log.delete(w, [6])
    log.put(w, [3, 10])
    log.op("flush", w.flush)
    log.put(w, [10])
    log.op("close", w.close)


def setup_merge(log: Log, uri: str) -> None:
    generations(log, create(log, uri), 2)


def run_merge(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    log.op("merge", table.merge)
    final_put(log, table)


def setup_index(log: Log, uri: str) -> None:
    table = create(log, uri)
    lance.dataset(uri).create_scalar_index("id", "BTREE")
    generations(log, table, 2, merge=True)


def run_index(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    log.op("build_index", table.build_index)
    log.op("catch_up_indexes", table.catch_up_indexes)
    final_put(log, table)


def setup_compact(log: Log, uri: str) -> None:
    generations(log, create(log, uri), 3, merge=True)


def run_compact(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    log.op("compact", lambda: table.compact(TINY))
    final_put(log, table)


def setup_gc(log: Log, uri: str) -> None:
    generations(log, create(log, uri), 2)


def run_gc(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    log.op("merge", table.merge)
    log.op("cleanup_versions", lambda: maintain_job.cleanup_versions(table, ZERO))
    log.op("gc", lambda: table.gc(grace=ZERO))
    final_put(log, table)


def setup_maintain(log: Log, uri: str) -> None:
    generations(log, create(log, uri), 2)


def run_maintain(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    log.op(
        "maintain",
        lambda: table.maintain(max_rounds=1, interval=0, grace=ZERO, version_retention=ZERO, compact=TINY),
    )
    final_put(log, table)


def setup_repair(log: Log, uri: str) -> None:
    """A flushed generation, then a crashed region writer: one acknowledged WAL entry and a torn
    trailing one (its put never returned)."""
    table = create(log, uri)
    generations(log, table, 1)
    bad = table.region_ids()[0]
    keys = keys_of(table, bad, range(12))
    rw = table.region_writer(bad, durable=True)
    log.put(rw, keys[:2])
    log.put(rw, keys[2:4], ack=False)
    position = rw.stats()["next_wal_position"] - 1
    rw.abort()
    path = layout.wal_path(bad, position)
    data = table.storage.get(path)
    table.storage.put(path, data[: len(data) // 2])  # torn


def run_repair(log: Log, uri: str) -> None:
    table = mw.open_table(uri)
    bad = table.region_ids()[0]
    log.op("repair_region", lambda: table.repair_region(bad, apply=True))
    log.op("recover", table.recover)
    final_put(log, table)


KILLED: list[Any] = []  # writers of `setup_recover`, left open until the process is killed


def setup_recover(log: Log, uri: str) -> None:
    """A writer with durable, unflushed writes in both regions, killed (SIGKILL) after its acks."""
    table = create(log, uri)
    generations(log, table, 1)
    w = table.writer(durable=True)
    log.put(w, [0, 1, 6])
    log.delete(w, [3])
    log.put(w, [7, 2])
    KILLED.append(w)


def run_recover(log: Log, uri: str) -> None:
    log.op("recover", lambda: mw.open_table(uri).recover())
    final_put(log, mw.open_table(uri))


WORKLOADS = ("write", "merge", "index", "compact", "gc", "maintain", "repair", "recover")


# ------------------------------------------------------------------------------- Lance calls


def instrument_lance() -> None:
    """Announce every outermost call into pylance (`- BEGIN k name caller` ... `- END k`)."""
    depth = threading.local()
    counter = itertools.count()
    package = os.path.dirname(os.path.abspath(mw.__file__)) + os.sep

    def caller() -> str:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(package):
                rel = os.path.relpath(frame.f_code.co_filename, os.path.dirname(package.rstrip(os.sep)))
                return f"{rel}:{frame.f_lineno}:{frame.f_code.co_name}"
            frame = frame.f_back
        return "-"

    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*a: Any, **kw: Any) -> Any:
            level = getattr(depth, "n", 0)
            if level:
                return fn(*a, **kw)
            k = next(counter)
            emit(f"- BEGIN {k} {name} {caller()}")
            depth.n = 1
            try:
                return fn(*a, **kw)
            finally:
                depth.n = 0
                emit(f"- END {k}")

        return wrapped

    classes = [
        LanceDataset,
        MergeInsertBuilder,
        DatasetOptimizer,
        lance.fragment.LanceFragment,
        lance.file.LanceFileWriter,
    ]
    for cls in classes:
        for attr, value in list(vars(cls).items()):
            if attr.startswith("_"):
                continue
            name = f"{cls.__name__}.{attr}"
            if isinstance(value, staticmethod):
                setattr(cls, attr, staticmethod(wrap(value.__func__, name)))
            elif isinstance(value, classmethod):
                setattr(cls, attr, classmethod(wrap(value.__func__, name)))
            elif inspect.isfunction(value):
                setattr(cls, attr, wrap(value, name))
    for module in (lance, sys.modules["lance.dataset"], lance.fragment):
        for attr in ("write_dataset", "write_fragments"):
            fn = getattr(module, attr, None)
            if fn is not None and inspect.isfunction(fn):
                setattr(module, attr, wrap(fn, attr))


def main() -> None:
    phase, root, *names = sys.argv[1:]
    if phase == "run":
        instrument_lance()
    for name in names:
        log = Log(name, 1 if phase == "setup" else 500)
        uri = os.path.join(root, name)
        emit(f"{name} W {phase}")
        globals()[f"{phase}_{name}"](log, uri)
        emit(f"{name} END {phase}")
    emit("- EXIT")
    if KILLED:  # a writer killed with durable, unflushed writes (`setup_recover`)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
