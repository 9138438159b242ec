"""Partial-column upserts and conditional writes (`put(partial=True)`, `insert_if_absent`,
`put(if_match=...)`) against a dict model: their semantics (NULLs, absent and deleted keys, repeated
keys, vector columns), their typed errors (nothing applied), and a stateful property test mixing them
with full puts, deletes, flushes, merges, GC, crashes and reopens, read back through SQL scans and
point lookups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from support.children import SOURCE_ROOT
from support.lance_made import lance_made_table
from support.optional import not_none

import memwal_df as mw
from memwal_df import errors
from memwal_df.jobs.maintain import cleanup_versions

VEC = pa.list_(pa.float32(), 2)
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("a", pa.string()),
        pa.field("b", pa.int64()),
        pa.field("ver", pa.int64()),
        pa.field("vec", VEC),
    ]
)
VALUES = ("a", "b", "ver", "vec")
BASE: list[dict[str, Any]] = [
    {"id": k, "a": f"base{k}", "b": k, "ver": 1, "vec": [float(k), 0.0]} for k in range(0, 10, 2)
]
NEVER = -(2**40)  # a version no row has


def new_table(path: Any) -> mw.Table:
    return mw.create_table(
        str(path / "t"), pa.Table.from_pylist(BASE, schema=SCHEMA), "id", region_spec=mw.bucket("id", 2)
    )


def sql_rows(table: mw.Table, writer: Any = None, where: str = "") -> dict[int, dict[str, Any]]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table.uri, writer=writer))  # its own handle: the writer's stays
    got = ctx.sql(f"select * from t {where}").to_arrow_table().to_pylist()
    out = {r["id"]: r for r in got}
    assert len(out) == len(got), "a key returned twice"
    return out


def apply_model(
    model: dict[int, dict[str, Any]],
    rows: list[dict[str, Any]],
    mode: str = "upsert",
    partial: bool = True,
    expected: list[Any] | None = None,
) -> list[bool]:
    """The reference semantics, row by row in input order; which rows applied."""
    applied = []
    for i, row in enumerate(rows):
        cur = model.get(row["id"])
        if mode == "insert_if_absent":
            ok = cur is None
        elif mode == "if_match":
            assert expected is not None
            ok = cur is not None and cur["ver"] == expected[i]
        else:
            ok = True
        if ok:
            new = dict(cur) if cur is not None and partial else {"id": row["id"], **dict.fromkeys(VALUES)}
            new.update(row)
            model[row["id"]] = new
        applied.append(ok)
    return applied


def as_table(rows: list[dict[str, Any]], columns: list[str]) -> pa.Table:
    schema = pa.schema([SCHEMA.field(c) for c in columns])
    return pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows], schema=schema)


# ------------------------------------------------------------------------------------------------ semantics


@pytest.mark.parametrize("durable", [True, False])
def test_partial_put_fills_from_every_level(tmp_path: Any, durable: bool) -> None:
    table = new_table(tmp_path)
    model = {r["id"]: dict(r) for r in BASE}
    with table.writer(durable=durable) as w:
        w.put(
            pa.Table.from_pylist([{"id": 2, "a": "gen", "b": 20, "ver": 2, "vec": [2.0, 2.0]}], schema=SCHEMA)
        )
        w.flush()  # key 2 in a generation, key 4 in the base, key 6 in the MemTable
        w.put(pa.Table.from_pylist([{"id": 6, "a": "mem", "b": 60, "ver": 2, "vec": None}], schema=SCHEMA))
        apply_model(model, [{"id": 2, "a": "gen", "b": 20, "ver": 2, "vec": [2.0, 2.0]}], partial=False)
        apply_model(model, [{"id": 6, "a": "mem", "b": 60, "ver": 2, "vec": None}], partial=False)
        rows = [{"id": k, "b": 100 + k, "a": None} for k in (2, 4, 6, 11)]
        w.put(as_table(rows, ["id", "a", "b"]), partial=True)
        apply_model(model, rows)
        assert sql_rows(table, w) == model
    assert sql_rows(table) == model
    assert model[11] == {"id": 11, "a": None, "b": 111, "ver": None, "vec": None}  # new key: NULL elsewhere
    assert model[4]["vec"] == [4.0, 0.0]  # the vector column filled like any other


def test_deleted_key_is_absent_and_repeated_keys_apply_in_order(tmp_path: Any) -> None:
    table = new_table(tmp_path)
    model = {r["id"]: dict(r) for r in BASE}
    with table.writer() as w:
        w.delete([4])
        model.pop(4)
        rows: list[dict[str, Any]] = [{"id": 4, "b": 1}, {"id": 4, "a": "x"}]
        for row in rows:  # one table carries one set of columns: two puts, then one with both keys twice
            w.put(as_table([row], list(row)), partial=True)
        apply_model(model, rows)
        both = [{"id": 8, "ver": 2, "b": 5}, {"id": 8, "ver": 3, "b": 6}, {"id": 2, "ver": 9, "b": 7}]
        got = w.put(as_table(both, ["id", "ver", "b"]), partial=True, if_match={"ver": [1, 1, 1]})
        assert got is not None
        assert (
            got.mask.tolist()
            == apply_model(model, both, "if_match", expected=[1, 1, 1])
            == [True, False, True]
        )
        assert got.keys.column("id").to_pylist() == [8, 2]
        again = w.insert_if_absent(
            as_table([{"id": 13, "a": "n"}, {"id": 13, "a": "m"}], ["id", "a"]), partial=True
        )
        assert again.mask.tolist() == apply_model(
            model, [{"id": 13, "a": "n"}, {"id": 13, "a": "m"}], "insert_if_absent"
        )
        assert sql_rows(table, w) == model
    assert model[4] == {"id": 4, "a": "x", "b": 1, "ver": None, "vec": None}
    assert sql_rows(table) == model


def test_if_match_null_matches_null_and_region_writer(tmp_path: Any) -> None:
    table = new_table(tmp_path)
    with table.writer() as w:
        w.put(as_table([{"id": 3, "b": 3}], ["id", "b"]), partial=True)  # ver NULL
    bucket = not_none(table.spec).evaluate(
        pa.table({"id": pa.array([3], pa.int64())}), table.schema.field_ids
    )[0]
    with table.region_writer(values=(bucket[0].as_py(),)) as rw:
        got = rw.put(as_table([{"id": 3, "ver": 1}], ["id", "ver"]), partial=True, if_match={"ver": None})
        assert got is not None and got.mask.tolist() == [True]
        got = rw.put(as_table([{"id": 3, "ver": 5}], ["id", "ver"]), partial=True, if_match={"ver": None})
        assert got is not None and got.count == 0
    assert sql_rows(table, where="where id = 3")[3] == {"id": 3, "a": None, "b": 3, "ver": 1, "vec": None}


@pytest.mark.parametrize("flush_after_gc", [False, True])
def test_fill_survives_merge_and_gc_under_the_writers_base(tmp_path: Any, flush_after_gc: bool) -> None:
    """Another process merges the writer's generation, cleans up old base versions and collects it:
    the writer's open base lacks the row, and its manifest lists a generation that is gone (or, after
    its next flush, no longer lists it). The fill must read the latest base, never fill NULLs."""
    table = new_table(tmp_path)
    row = {"id": 5, "a": "five", "b": 5, "ver": 1, "vec": [5.0, 5.0]}
    with table.writer() as w:
        w.put(pa.Table.from_pylist([row], schema=SCHEMA))
        w.flush()
        other = mw.open_table(table.uri)
        other.merge()
        cleanup_versions(other, timedelta(0))
        assert [g for r in other.gc(grace=timedelta(0)).regions for g in r.generations] == [1]
        if flush_after_gc:
            w.put(pa.Table.from_pylist([{**row, "id": 9}], schema=SCHEMA))  # key 5's region
            w.flush()
        w.put({"id": [5], "b": [55]}, partial=True)
    assert sql_rows(table, where="where id = 5")[5] == {**row, "b": 55}


@pytest.mark.parametrize("durable", [True, False])
def test_compare_and_set_is_exact_under_concurrent_writers(tmp_path: Any, durable: bool) -> None:
    """Threads race to move `ver` of one key from v to v + 1 for v = 0, 1, ...: each step is applied by
    exactly one of them (the read and the write of a conditional put are one step of the region),
    while plain puts of other keys share the writer's WAL entries."""
    table = new_table(tmp_path)
    steps, threads = 25, 4
    with table.writer(durable=durable) as w:
        w.put({"id": [1], "ver": [0]}, partial=True)
        wins = [0] * threads

        def race(t: int) -> None:
            for v in range(steps):
                got = w.put({"id": [1], "ver": [v + 1]}, partial=True, if_match={"ver": v})
                assert got is not None
                wins[t] += got.count
                w.put({"id": [100 + t], "b": [v]}, partial=True)

        pool = [threading.Thread(target=race, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        assert sum(wins) == steps
        assert sql_rows(table, w, "where id = 1")[1]["ver"] == steps


@pytest.mark.parametrize("durable", [True, False])
def test_writes_over_several_regions_race_without_deadlock(tmp_path: Any, durable: bool) -> None:
    """Threads race compare-and-set steps on keys of both regions in one put each (a put holds every
    region's read-modify-write section at once), while others put whole rows and flush: nothing
    waits forever, and each key's step v -> v + 1 is applied by exactly one thread."""
    table = new_table(tmp_path)
    assert table.spec is not None
    buckets = not_none(table.spec).evaluate(
        pa.table({"id": pa.array(range(40), pa.int64())}), table.schema.field_ids
    )
    by_region = [[k for k, b in enumerate(buckets[0].to_pylist()) if b == r][:3] for r in (0, 1)]
    keys = [k for ks in zip(*by_region, strict=True) for k in ks]  # regions interleaved in the input
    steps, racers = 20, 3
    wins = {k: 0 for k in keys}
    lock = threading.Lock()
    w = table.writer(durable=durable)
    w.put({"id": keys, "ver": [0] * len(keys)}, partial=True)

    def race(t: int) -> None:
        mine = keys if t % 2 else keys[::-1]  # (the regions come in another order)
        for v in range(steps):
            got = w.put({"id": mine, "ver": [v + 1] * len(keys)}, partial=True, if_match={"ver": v})
            assert got is not None
            with lock:
                for k in got.keys.column("id").to_pylist():
                    wins[k] += 1

    def churn() -> None:
        for i in range(steps):
            w.put(pa.Table.from_pylist([{**BASE[0], "id": 1000 + i}], schema=SCHEMA))
            if i % 5 == 4:
                w.flush()

    pool = [threading.Thread(target=race, args=(t,), daemon=True) for t in range(racers)]
    pool.append(threading.Thread(target=churn, daemon=True))
    for th in pool:
        th.start()
    deadline = time.monotonic() + 120
    for th in pool:
        th.join(max(0.0, deadline - time.monotonic()))
    if any(th.is_alive() for th in pool):
        pytest.fail("writes over several regions wait for each other forever")
    w.close()
    # (each step is taken by one racer exactly once a key reached it: a key behind stays behind)
    assert wins == {k: steps for k in keys}
    got = sql_rows(table, where=f"where id in ({', '.join(map(str, keys))})")
    assert {k: r["ver"] for k, r in got.items()} == {k: steps for k in keys}


CHILD = """
import json, random, sys
import memwal_df as mw
table = mw.open_table(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
w = table.writer(durable=True)
for i in range(100_000):
    keys = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
    b = [rng.randrange(100) for _ in keys]
    op = {"keys": keys, "b": b, "ver": rng.randrange(3), "cond": rng.random() < 0.5}
    print(json.dumps({"intent": i, **op}), flush=True)
    data = {"id": keys, "b": op["b"], "ver": [op["ver"] + 1] * len(keys)}
    w.put(data, partial=True, if_match={"ver": op["ver"]} if op["cond"] else None)
    print(json.dumps({"ack": i}), flush=True)
"""


def test_sigkill_during_partial_and_conditional_writes(tmp_path: Any) -> None:
    """A durable writer killed with SIGKILL mid-stream: after recovery the table holds exactly the
    acknowledged writes, plus the one in flight either whole or not at all."""
    table = new_table(tmp_path)
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, table.uri, "7"], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    lines: list[str] = []
    while sum('"ack"' in line for line in lines) < 30:
        line = child.stdout.readline()
        assert line, "the writer child died"
        lines.append(line)
    child.send_signal(signal.SIGKILL)
    child.wait()
    lines += child.stdout.read().splitlines()
    msgs = []
    for line in lines:
        try:
            msgs.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line
            continue
    intents = [m for m in msgs if "intent" in m]
    acked = {m["ack"] for m in msgs if "ack" in m}
    model = {r["id"]: dict(r) for r in BASE}
    for op in intents:
        if op["intent"] not in acked:
            break
        _apply_logged(model, op)
    maybe = {k: dict(v) for k, v in model.items()}
    for op in intents[len(acked) : len(acked) + 1]:
        _apply_logged(maybe, op)
    table.recover()
    assert sql_rows(table) in (model, maybe)


def _apply_logged(model: dict[int, dict[str, Any]], op: dict[str, Any]) -> None:
    rows = [{"id": k, "b": b, "ver": op["ver"] + 1} for k, b in zip(op["keys"], op["b"], strict=True)]
    if op["cond"]:
        apply_model(model, rows, "if_match", expected=[op["ver"]] * len(rows))
    else:
        apply_model(model, rows)


# ------------------------------------------------------------------------------------------------ errors


def test_typed_errors_apply_nothing(tmp_path: Any) -> None:
    table = new_table(tmp_path)
    model = {r["id"]: dict(r) for r in BASE}
    with table.writer() as w:
        with pytest.raises(errors.MissingColumnsError, match="primary-key"):
            w.put({"b": [1]}, partial=True)
        with pytest.raises(errors.SchemaMismatchError, match="not in the table"):
            w.put({"id": [1], "nope": [1]}, partial=True)
        with pytest.raises(errors.MissingColumnsError):  # a conditional put of whole rows needs them all
            w.put({"id": [2], "ver": [2]}, if_match={"ver": 1})
        with pytest.raises(errors.InvalidConditionError, match="not a column"):
            w.put({"id": [2], "ver": [2]}, partial=True, if_match={"nope": 1})
        with pytest.raises(errors.InvalidConditionError, match="primary-key"):
            w.put({"id": [2], "ver": [2]}, partial=True, if_match={"id": 2})
        with pytest.raises(errors.InvalidConditionError, match="2 values for 1 rows"):
            w.put({"id": [2], "ver": [2]}, partial=True, if_match={"ver": [1, 1]})
        with pytest.raises(errors.InvalidConditionError, match="type int64"):
            w.put({"id": [2], "ver": [2]}, partial=True, if_match={"ver": "one"})
        with pytest.raises(errors.NullPrimaryKeyError):
            w.put({"id": [None, 2], "b": [1, 2]}, partial=True)
        assert sql_rows(table, w) == model
        assert w.writers == {} or all(rw.stats()["rows"] == 0 for rw in w.writers.values())


def test_missing_non_nullable_column_refuses_new_keys(tmp_path: Any) -> None:
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("n", pa.int64(), nullable=False),
            ("b", pa.int64()),
        ]
    )
    table = lance_made_table(
        str(tmp_path / "t"), pa.table({"id": [1, 2], "n": [10, 20], "b": [1, 2]}, schema=schema), "id"
    )
    with table.region_writer(uuid.uuid4()) as w:  # a table without a region spec: regions by hand
        w.put({"id": [1], "b": [5]}, partial=True)  # an existing key keeps its `n`
        with pytest.raises(errors.MissingValueError, match="'n' is not nullable") as e:
            w.put({"id": [2, 3], "b": [6, 7]}, partial=True)
        assert e.value.columns == ("n",)
        w.put({"id": [3], "n": [30]}, partial=True)  # carried: fine
    got = sql_rows(table)
    assert got == {
        1: {"id": 1, "n": 10, "b": 5},
        2: {"id": 2, "n": 20, "b": 2},
        3: {"id": 3, "n": 30, "b": None},
    }


@pytest.mark.parametrize("durable", [True, False])
def test_refused_region_leaves_the_others_written_and_the_writer_usable(tmp_path: Any, durable: bool) -> None:
    """A partial write over two regions whose rows one region refuses (a new key lacks a non-nullable
    column): the other region's rows are written (each region's part is its own write), the error
    is raised, and both regions take later writes."""
    schema = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("n", pa.int64(), nullable=False)]
    )
    data = pa.table({"id": pa.array([], pa.int64()), "n": pa.array([], pa.int64())}, schema=schema)
    table = lance_made_table(str(tmp_path / "t"), data, "id", bucket_column="id", num_buckets=2)
    assert table.spec is not None
    candidates = pa.table({"id": pa.array(range(20), pa.int64())})
    buckets = not_none(table.spec).evaluate(candidates, table.schema.field_ids)[0].to_pylist()
    a, c = [k for k, b in enumerate(buckets) if b == 0][:2]  # two keys of one region
    b, d = [k for k, b in enumerate(buckets) if b == 1][:2]  # two of the other
    w = table.writer(durable=durable)
    w.put({"id": [a, b], "n": [5, 6]})
    for new_key in (c, d):  # the refused key routed with one region, then with the other
        with pytest.raises(errors.MissingValueError):
            w.put(pa.table({"id": pa.array([a, b, new_key], pa.int64())}), partial=True)
    later = threading.Thread(target=w.put, args=({"id": [a, b], "n": [7, 8]},), daemon=True)
    later.start()
    later.join(60)
    if later.is_alive():  # a region still waits for the refused write to finish
        w.abort()
        pytest.fail("a region takes no more writes after another region refused its rows")
    w.close()
    assert sql_rows(table) == {a: {"id": a, "n": 7}, b: {"id": b, "n": 8}}


# ---------------------------------------------------------------------------------------------- state machine

KEYS = st.integers(0, 11)
ROW_VALUES = st.fixed_dictionaries(
    {
        "id": KEYS,
        "a": st.none() | st.sampled_from(["", "x", "yy"]),
        "b": st.none() | st.integers(-5, 5),
        "ver": st.none() | st.integers(0, 3),
        "vec": st.none() | st.sampled_from([[0.5, 1.0], [2.0, -1.0]]),
    }
)
ROWS = st.lists(ROW_VALUES, min_size=1, max_size=6)
COLUMNS = st.sets(st.sampled_from(VALUES), max_size=4).map(sorted)


class PartialMachine(RuleBasedStateMachine):
    """Random writes of every kind against the dict model; crashes lose exactly the non-durable writes
    since the last flush (time- and size-based WAL flushes disabled)."""

    def __init__(self, path: Any) -> None:
        super().__init__()
        self.table = new_table(path)
        self.model = {r["id"]: dict(r) for r in BASE}
        self.durable_model = {k: dict(v) for k, v in self.model.items()}
        self.writer: mw.TableWriter | None = None
        self.durable = True

    @initialize(durable=st.booleans())
    def start(self, durable: bool) -> None:
        self.open(durable)

    def open(self, durable: bool) -> None:
        self.durable = durable
        self.writer = self.table.writer(
            durable=durable,
            max_wal_flush_interval_ms=600_000,
            max_wal_buffer_batches=100_000,
            max_wal_buffer_size=1 << 40,
            max_memtable_rows=100_000,
            max_memtable_size=1 << 40,
        )
        # claim every region (replaying its WAL) with a conditional write that matches nothing
        keys = list(range(12))
        got = self.writer.put({"id": keys, "ver": [0] * 12}, partial=True, if_match={"ver": NEVER})
        assert got is not None and not got.mask.any()

    def acknowledged(self) -> None:
        if self.durable:
            self.durable_model = {k: dict(v) for k, v in self.model.items()}

    @rule(rows=ROWS)
    def put_full(self, rows: list[dict[str, Any]]) -> None:
        assert self.writer is not None
        self.writer.put(as_table(rows, list(SCHEMA.names)))
        apply_model(self.model, rows, partial=False)
        self.acknowledged()

    @rule(rows=ROWS, columns=COLUMNS)
    def put_partial(self, rows: list[dict[str, Any]], columns: list[str]) -> None:
        assert self.writer is not None
        self.writer.put(as_table(rows, ["id", *columns]), partial=True)
        apply_model(self.model, [{c: r[c] for c in ["id", *columns]} for r in rows])
        self.acknowledged()

    @rule(rows=ROWS, columns=COLUMNS)
    def insert_if_absent(self, rows: list[dict[str, Any]], columns: list[str]) -> None:
        assert self.writer is not None
        got = self.writer.insert_if_absent(as_table(rows, ["id", *columns]), partial=True)
        want = apply_model(
            self.model, [{c: r[c] for c in ["id", *columns]} for r in rows], "insert_if_absent"
        )
        assert got.mask.tolist() == want
        self.acknowledged()

    @rule(rows=ROWS, columns=COLUMNS, expected=st.none() | st.integers(0, 3), per_row=st.booleans())
    def put_if_match(
        self, rows: list[dict[str, Any]], columns: list[str], expected: int | None, per_row: bool
    ) -> None:
        assert self.writer is not None
        want_values = [r["ver"] for r in rows] if per_row else [expected] * len(rows)
        condition = {"ver": want_values if per_row else expected}
        got = self.writer.put(as_table(rows, ["id", *columns]), partial=True, if_match=condition)
        want = apply_model(
            self.model, [{c: r[c] for c in ["id", *columns]} for r in rows], "if_match", expected=want_values
        )
        assert got is not None and got.mask.tolist() == want
        assert got.keys.column("id").to_pylist() == [r["id"] for r, ok in zip(rows, want, strict=True) if ok]
        self.acknowledged()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def delete(self, keys: list[int]) -> None:
        assert self.writer is not None
        self.writer.delete(keys)
        for k in keys:
            self.model.pop(k, None)
        self.acknowledged()

    @rule()
    def flush(self) -> None:
        assert self.writer is not None
        self.writer.flush()
        self.durable_model = {k: dict(v) for k, v in self.model.items()}

    @rule(collect=st.booleans())
    def merge(self, collect: bool) -> None:
        other = mw.open_table(self.table.uri)  # another process's handle: the writer's base stays as it was
        other.merge()
        if collect:  # old base versions and merged generations vanish under the writer's open base
            cleanup_versions(other, timedelta(0))
            other.gc(grace=timedelta(0))

    @rule(durable=st.booleans())
    def crash(self, durable: bool) -> None:
        assert self.writer is not None
        self.writer.abort()
        self.model = {k: dict(v) for k, v in self.durable_model.items()}
        self.open(durable)

    @rule(durable=st.booleans())
    def reopen(self, durable: bool) -> None:
        assert self.writer is not None
        self.writer.close()
        self.durable_model = {k: dict(v) for k, v in self.model.items()}
        self.open(durable)

    @invariant()
    def reads_match_model(self) -> None:
        if self.writer is None:
            return
        assert sql_rows(self.table, self.writer) == self.model
        probes = [0, 3, 4, 7, 10]
        got = sql_rows(self.table, self.writer, f"where id in ({', '.join(map(str, probes))})")
        assert got == {k: self.model[k] for k in probes if k in self.model}

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            assert sql_rows(self.table) == self.model  # a durable reader, after the close flushed


def test_partial_and_conditional_writes_match_the_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    run_state_machine_as_test(
        lambda: PartialMachine(tmp_path_factory.mktemp("m")),  # type: ignore[arg-type]  # hypothesis calls any factory
        settings=settings(
            max_examples=12,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
