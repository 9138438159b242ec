"""A stateful property test of the write path: random puts, deletes, flushes, crashes, reopens,
recoveries and rounds of every background job (merge, index build and catch-up, base compaction, index
upkeep, base version cleanup, GC) against a real table, checked after every step against a dict model.

The model keeps, per region, the list of region writes ("ops": the rows one region writer received in
one call, tombstones included) and how many of them are durable (in the WAL). Durability is modelled
exactly, from the writer settings rather than from the writer's internals:

* durable writer: an op is durable when its call returns;
* non-durable writer (time-based WAL flushes disabled): an op is buffered; the buffer becomes one WAL
  entry when it holds `max_wal_buffer_batches` batches (the writer's WAL thread appends it in the
  background: the machine waits for that before it checks), when the MemTable fills up (`max_memtable_rows`,
  `max_memtable_batches`: the MemTable is sealed, its buffered writes flushed first) and on `flush()`;
* a crash (`abort()`) loses exactly the buffered ops; recovery must bring back exactly the rest.

After every step two oracles must agree with the model:

* visible state: `reference.stored_rows(table, writer MemTables)`, plus the WAL tail of regions the
  current writer has not claimed yet (their rows reach a MemTable only when a writer claims them);
* durable state: `wal_oracle.durable_rows` (base + generations + WAL tails, read from storage), which
  must equal the model without the buffered ops, at every step, not only after a crash.

The writer's own counters (`stats()`: WAL entries written, rows in the active MemTable) must match
what the model predicts, so the thresholds are checked too. A `MemWalTable` registered once at the
start stays registered through every step and must return what a table opened afresh holds in storage
(reader freshness across merges, compactions, version cleanup and GC).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support.optional import not_none
from support.reference import model_rows, stored_rows
from support.wal_oracle import apply_rows, check_region, durable_rows, region_snapshot

import memwal_df as mw
from memwal_df import errors
from memwal_df.jobs.compaction import CompactionSettings, debt
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)
BASE = [{"id": k, "name": f"base{k}", "v": float(k)} for k in range(0, 12, 2)]
NUM_BUCKETS = 4
ZERO = timedelta(0)
NO_TIMED_FLUSH_MS = 600_000  # WAL flushes of non-durable writes happen only at the modelled points

KEYS = st.integers(0, 24)
ROWS = st.lists(
    st.tuples(
        KEYS,
        st.none() | st.sampled_from(["", "a", "bb", "ccc", "é"]),
        st.none() | st.floats(allow_nan=False, allow_infinity=False, width=32),
    ),
    min_size=1,
    max_size=8,
)
WRITER_SETTINGS = st.fixed_dictionaries(
    {
        "durable": st.booleans(),
        "max_memtable_rows": st.sampled_from([3, 8, 100_000, 100_000]),
        "max_memtable_batches": st.sampled_from([2, 5, 8000]),
        "max_wal_buffer_batches": st.sampled_from([1, 3, 1024, 1024]),
    }
)

# Thresholds a base of a few dozen rows passes: every fragment is small (below 8 rows: the target also
# splits a rewrite), and one deleted row makes a fragment due.
COMPACTIONS = st.builds(
    lambda sizes, n, share: CompactionSettings(sizes[0], sizes[1], n, share),
    st.sampled_from([(8, 8), (1 << 20, 1_000)]),
    st.integers(2, 3),
    st.sampled_from([0.01, 0.5]),
)
UPKEEPS = st.builds(IndexUpkeepSettings, max_segments=st.integers(1, 2), retrain_share=st.just(0.1))


@dataclass
class RegionModel:
    ops: list[list[dict[str, Any]]] = field(default_factory=list)  # every acknowledged op, in order
    durable: int = 0  # ops[:durable] are in the WAL or in a generation
    # the current writer's region writer for this region, as the model predicts it
    claimed: bool = False
    pending: int = 0  # buffered batches (non-durable)
    active_rows: int = 0
    active_batches: int = 0
    wal_entries: int = 0  # entries this region writer wrote (its stats()["wal_entries"])

    def rows(self, durable_only: bool) -> list[dict[str, Any]]:
        ops = self.ops[: self.durable] if durable_only else self.ops
        return [r for op in ops for r in op]


class WriterMachine(RuleBasedStateMachine):
    def __init__(self, uri: str, storage_options: dict[str, str] | None, cleanup: Callable[[], None]) -> None:
        super().__init__()
        self.uri, self.options, self._cleanup = uri, storage_options, cleanup
        self.table = mw.create_table(
            uri,
            pa.Table.from_pylist(BASE, schema=SCHEMA),
            "id",
            region_spec=mw.bucket("id", NUM_BUCKETS),
            storage_options=storage_options,
        )
        self.regions: dict[uuid.UUID, RegionModel] = defaultdict(RegionModel)
        self.writer: mw.TableWriter | None = None
        self.recovered = False  # recover() ran since the last crash
        self.collected = False  # a GC ran: old manifest versions and merged generations are gone
        self.indexed = False  # the base has a BTREE index on the key
        self.unmerged = False  # a flush or a clean close since the last maintain round
        self.cfg: dict[str, Any] = {}
        self._region_of: dict[int, uuid.UUID] = {}
        # one reader registered once, as a service embedding DataFusion keeps it, across every step
        self.ctx = mw.register(datafusion.SessionContext())
        self.ctx.register_table("t", mw.MemWalTable(uri, storage_options))

    # ------------------------------------------------------------------ model helpers

    def region_of(self, key: int) -> uuid.UUID:
        if key not in self._region_of:
            values = not_none(self.table.spec).evaluate(
                pa.table({"id": pa.array([key], pa.int64())}), self.table.schema.field_ids
            )
            self._region_of[key] = self.table.region_id_for((values[0][0].as_py(),))
        return self._region_of[key]

    def model(self, durable_only: bool) -> dict[Any, dict[str, Any]]:
        out = {r["id"]: dict(r) for r in BASE}
        for rm in self.regions.values():
            apply_rows(out, rm.rows(durable_only))
        return out

    def open_writer(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.writer = self.table.writer(
            durable=cfg["durable"],
            max_memtable_rows=cfg["max_memtable_rows"],
            max_memtable_batches=cfg["max_memtable_batches"],
            max_wal_buffer_batches=cfg["max_wal_buffer_batches"],
            max_wal_flush_interval_ms=NO_TIMED_FLUSH_MS,
            max_wal_buffer_size=1 << 40,
            max_memtable_size=1 << 40,
        )
        for rm in self.regions.values():
            rm.claimed = False

    def before_write(self, keys: list[int]) -> dict[uuid.UUID, tuple[int, int]]:
        """(rows, batches) the writer will replay into each region it claims during the next call."""
        replay = {}
        for rid in {self.region_of(k) for k in keys}:
            if not self.regions[rid].claimed:
                snap = region_snapshot(self.table, rid)
                tail = snap.tail if snap is not None else []
                replay[rid] = (sum(len(rec.rows) for rec in tail), sum(rec.batches for rec in tail))
        return replay

    def write_ops(self, ops: list[list[dict[str, Any]]], replay: dict[uuid.UUID, tuple[int, int]]) -> None:
        """Record one call's rows: `ops` are its chunks in order; each is split by region."""
        for chunk in ops:
            parts: dict[uuid.UUID, list[dict[str, Any]]] = {}
            for row in chunk:
                parts.setdefault(self.region_of(row["id"]), []).append(row)
            for rid, part in parts.items():
                rm = self.regions[rid]
                if not rm.claimed:  # claimed during this call: its MemTable starts with the replay
                    rm.claimed, rm.pending, rm.wal_entries = True, 0, 0
                    rm.active_rows, rm.active_batches = replay[rid]
                rm.ops.append(part)
                rm.active_rows += len(part)
                rm.active_batches += 1
                if self.cfg["durable"]:
                    rm.wal_entries += 1
                    rm.durable = len(rm.ops)
                else:
                    rm.pending += 1
                    if rm.pending >= self.cfg["max_wal_buffer_batches"]:
                        self._wal_flush(rm)
                if (
                    rm.active_rows >= self.cfg["max_memtable_rows"]
                    or rm.active_batches >= self.cfg["max_memtable_batches"]
                ):
                    self._seal(rm)

    @staticmethod
    def _wal_flush(rm: RegionModel) -> None:
        if rm.pending:
            rm.wal_entries += 1
            rm.pending = 0
        rm.durable = len(rm.ops)

    @staticmethod
    def _seal(rm: RegionModel) -> None:
        """Sealed: buffered writes get no WAL entry, the generation makes them durable (the writer
        counters are checked once the background flush committed it)."""
        rm.pending = 0
        rm.durable = len(rm.ops)
        rm.active_rows = rm.active_batches = 0

    def check_writer_counters(self) -> None:
        assert self.writer is not None
        for rid, rw in self.writer.writers.items():
            rm = self.regions[rid]
            deadline = time.monotonic() + 60
            while (s := rw.stats())["buffered_batches"] > rm.pending:  # background appends and commits
                assert time.monotonic() < deadline, ("WAL entries were not appended", rid, s, rm)
                time.sleep(0.002)
            assert s["buffered_batches"] == rm.pending, (rid, s, rm)
            assert s["wal_entries"] == rm.wal_entries, (rid, s, rm)
            assert s["memtable_rows"] == rm.active_rows, (rid, s, rm)
        claimed = {rid for rid, rm in self.regions.items() if rm.claimed}
        assert claimed == set(self.writer.writers)

    def lose_buffered_writes(self) -> None:
        """A crash: ops not in the WAL are gone."""
        event(f"crash loses buffered writes: {any(rm.durable < len(rm.ops) for rm in self.regions.values())}")
        for rm in self.regions.values():
            del rm.ops[rm.durable :]
            rm.claimed, rm.pending = False, 0

    def settle(self) -> None:
        """Wait until every background MemTable flush of the current writer is done."""
        assert self.writer is not None
        deadline = time.monotonic() + 60
        while any(rw.stats()["sealed_memtables"] for rw in self.writer.writers.values()):
            assert time.monotonic() < deadline, "background MemTable flushes did not finish"
            time.sleep(0.005)

    # ------------------------------------------------------------------ rules

    @initialize(cfg=WRITER_SETTINGS)
    def start(self, cfg: dict[str, Any]) -> None:
        self.open_writer(cfg)

    @precondition(lambda self: self.writer is not None)
    @rule(rows=ROWS)
    def put(self, rows: list[tuple[int, str | None, float | None]]) -> None:
        self._put(rows)

    @precondition(lambda self: self.writer is not None)
    @rule(rows=st.lists(st.tuples(KEYS, st.just("many"), st.none()), min_size=5, max_size=16))
    def put_many(self, rows: list[tuple[int, str | None, float | None]]) -> None:
        self._put(rows)

    @precondition(lambda self: self.writer is not None and len(self.model(durable_only=False)) > 0)
    @rule(data=st.data())
    def update_existing(self, data: st.DataObject) -> None:
        keys = sorted(self.model(durable_only=False))
        rows = data.draw(
            st.lists(
                st.tuples(st.sampled_from(keys), st.just("upd"), st.floats(-1, 1)), min_size=1, max_size=6
            )
        )
        self._put(rows)

    @precondition(lambda self: self.writer is not None and len(self.model(durable_only=False)) > 0)
    @rule(data=st.data())
    def delete_existing(self, data: st.DataObject) -> None:
        keys = sorted(self.model(durable_only=False))
        self.delete(data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4)))

    def _put(self, rows: Sequence[tuple[int, str | None, float | None]]) -> None:
        assert self.writer is not None
        dicts = [{"id": k, "name": n, "v": v} for k, n, v in rows]
        replay = self.before_write([k for k, _, _ in rows])
        self.writer.put(pa.Table.from_pylist(dicts, schema=SCHEMA))
        size = self.cfg["max_memtable_rows"]  # TableWriter.put cuts its input into chunks of this size
        self.write_ops(
            [[{**r, "_tombstone": False} for r in dicts[i : i + size]] for i in range(0, len(dicts), size)],
            replay,
        )
        self.check_writer_counters()

    @precondition(lambda self: self.writer is not None)
    @rule(keys=st.lists(KEYS, min_size=1, max_size=5))
    def delete_any(self, keys: list[int]) -> None:
        self.delete(keys)

    def delete(self, keys: list[int]) -> None:
        assert self.writer is not None
        replay = self.before_write(keys)
        self.writer.delete(keys)
        self.write_ops([[{"id": k, "name": None, "v": None, "_tombstone": True} for k in keys]], replay)
        self.check_writer_counters()

    @precondition(lambda self: self.writer is not None)
    @rule(
        action=st.sampled_from(["flush", "crash", "crash", "crash", "reopen", "recover"]), cfg=WRITER_SETTINGS
    )
    def lifecycle(self, action: str, cfg: dict[str, Any]) -> None:
        """One rule for the events between writes, so that several writes come between two of them:
        flush, crash (abort), clean reopen (close; new table object and writer), recover() while the
        writer is live."""
        if action == "flush":
            self.flush()
        elif action == "crash":
            self.crash()
        elif action == "reopen":
            self.reopen(cfg)
        else:
            self.recover_fences_live_writer()

    def flush(self) -> None:
        assert self.writer is not None
        self.writer.flush()
        self.unmerged = True
        for rm in self.regions.values():
            if rm.claimed:
                self._seal(rm)
        self.check_writer_counters()
        for rw in self.writer.writers.values():
            assert rw.stats()["sealed_memtables"] == 0

    def crash(self) -> None:
        assert self.writer is not None
        self.writer.abort()
        self.check_writer_counters()
        self.lose_buffered_writes()
        self.writer = None
        self.recovered = False

    @precondition(lambda self: self.writer is None)
    @rule(cfg=WRITER_SETTINGS)
    def restart(self, cfg: dict[str, Any]) -> None:
        """After a crash: a new process opens the table and starts a writer."""
        self.reopen(cfg)

    def reopen(self, cfg: dict[str, Any]) -> None:
        """A new process: a new table object and a new writer (claims and replays on first use)."""
        if self.writer is not None:
            self.writer.close()
            self.unmerged = True
            for rm in self.regions.values():
                rm.durable = len(rm.ops)
        self.table = mw.open_table(self.uri, self.options)
        self.open_writer(cfg)

    @precondition(lambda self: self.writer is None and not self.recovered)
    @rule()
    def recover(self) -> None:
        self.recovered = True
        expected = {
            rid for rid in self.table.region_ids() if not_none(region_snapshot(self.table, rid)).tail_has_data
        }
        got = self.table.recover()
        event(f"recover() after a crash recovers {len(got)} regions")
        assert len(got) == len(set(got)) and set(got) == expected
        for rid in self.table.region_ids():
            assert not not_none(region_snapshot(self.table, rid)).tail_has_data
        assert self.table.recover() == []

    def recover_fences_live_writer(self) -> None:
        """`recover()` while a writer is live claims its regions that have WAL data: the writer is fenced
        there and reports its buffered (never durable) rows; then it crashes."""
        assert self.writer is not None
        self.settle()
        expected = {
            rid for rid in self.table.region_ids() if not_none(region_snapshot(self.table, rid)).tail_has_data
        }
        got = self.table.recover()
        event(f"recover() fences {len(set(got) & set(self.writer.writers))} live region writers")
        assert set(got) == expected
        for rid, rw in self.writer.writers.items():
            if rid not in expected:
                continue
            rm = self.regions[rid]
            with pytest.raises(errors.WriterFencedError) as exc:
                rw.flush()
            lost = exc.value.not_durable
            assert lost is None or isinstance(lost, pa.Table)
            assert (lost.to_pylist() if lost is not None else []) == [
                r for op in rm.ops[rm.durable :] for r in op
            ]
            key = next(k for k in range(1000) if self.region_of(k) == rid)
            with pytest.raises(errors.WriterFencedError):
                rw.put(pa.Table.from_pylist([{"id": key, "name": None, "v": None}], schema=SCHEMA))
        self.writer.abort()
        self.lose_buffered_writes()
        self.writer = None

    @precondition(lambda self: self.unmerged)
    @rule()
    def maintain(self) -> None:
        """Every background job once, run by another table object while the writer (if any) is live:
        merge, index build and catch-up, cleanup of every base version but the latest, GC without
        a grace period."""
        jobs = mw.open_table(self.uri, self.options)
        (done,) = jobs.maintain(
            interval=0,
            max_rounds=1,
            grace=ZERO,
            version_retention=ZERO,
            compact=CompactionSettings(1 << 20, 1_000, 2, 0.01),
            index_upkeep=IndexUpkeepSettings(max_segments=1),
        )
        assert not done.errors, done.errors
        self.collected, self.unmerged = True, False
        event(f"maintain merged {len(done.results['merge'].generations) > 0}")
        event(f"maintain compacted {done.results['compact'].compacted}")

    @precondition(lambda self: not self.indexed)
    @rule()
    def create_base_index(self) -> None:
        """A BTREE index on the key, which index catch-up then keeps up with merges and compactions."""
        lance.dataset(self.uri, storage_options=self.options).create_scalar_index("id", "BTREE")
        self.indexed = True

    @rule(settings=COMPACTIONS, merge_first=st.booleans())
    def compact(self, settings: CompactionSettings, merge_first: bool) -> None:
        """`table.compact` by another table object while the writer (if any) is live, maybe right after
        a merge (new small fragments, deletion files in older ones)."""
        jobs = mw.open_table(self.uri, self.options)
        if merge_first:
            jobs.merge()
        done = jobs.compact(settings)
        assert done.compacted or not done.debt.mostly_deleted
        assert not debt(lance.dataset(self.uri, storage_options=self.options), settings).mostly_deleted
        event(f"compact rewrote fragments: {done.compacted}")

    @rule(upkeep=UPKEEPS, merge_first=st.booleans())
    def index_upkeep(self, upkeep: IndexUpkeepSettings, merge_first: bool) -> None:
        """Index catch-up bounded by `upkeep`, by another table object."""
        jobs = mw.open_table(self.uri, self.options)
        if merge_first:
            jobs.merge()
        done = jobs.catch_up_indexes(upkeep=upkeep)
        assert all(i.covers_latest for i in done.indexes), done
        event(f"index upkeep merged segments: {any(i.merged_segments for i in done.indexes)}")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def long_lived_reader_matches_a_fresh_one(self) -> None:
        """The reader registered at the start returns what a table opened now holds in storage (once
        the writer's background MemTable flushes are done, so that both read the same state)."""
        if self.writer is not None:
            self.settle()
        rows = self.ctx.sql("SELECT * FROM t").to_arrow_table()
        assert model_rows(rows, ("id",)) == stored_rows(mw.open_table(self.uri, self.options))

    @invariant()
    def visible_state_matches_model(self) -> None:
        claimed: set[uuid.UUID] = set()
        memtables = []
        if self.writer is not None:
            claimed = set(self.writer.writers)
            memtables = [m for rw in self.writer.writers.values() for m in rw.memtables]
        got = stored_rows(self.table, memtables)
        for rid in self.table.region_ids():
            if rid not in claimed and (snap := region_snapshot(self.table, rid)) is not None:
                apply_rows(got, snap.tail_rows)
        assert got == self.model(durable_only=False)

    @invariant()
    def durable_state_matches_model(self) -> None:
        assert durable_rows(self.table) == self.model(durable_only=True)

    def teardown(self) -> None:
        try:
            if self.writer is not None:
                writer, self.writer = self.writer, None
                try:
                    writer.close()
                except BaseException:
                    writer.abort()
                    raise
                for rm in self.regions.values():
                    rm.durable = len(rm.ops)
            table = mw.open_table(self.uri, self.options)
            table.recover()
            gens = sum(len(not_none(region_snapshot(table, r)).manifest.sstables) for r in table.region_ids())
            event(f"generations flushed: {gens // 10 * 10}+")
            assert stored_rows(table) == self.model(durable_only=False)
            for rid in table.region_ids():
                if not self.collected:  # the structural checks read every manifest version
                    check_region(table, rid)
                assert not not_none(region_snapshot(table, rid)).tail_has_data
        finally:
            self._cleanup()


def run_machine(
    uri_factory: Callable[[], str], options: dict[str, str] | None, cleanup: Callable[[str], None], **cfg: Any
) -> None:
    class Machine(WriterMachine):
        def __init__(self) -> None:
            uri = uri_factory()
            super().__init__(uri, options, lambda: cleanup(uri))

    run_state_machine_as_test(
        Machine,
        settings=settings(
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            **cfg,
        ),
    )


def test_writer_state_machine_local(tmp_path):
    run_machine(
        lambda: str(tmp_path / uuid.uuid4().hex),
        None,
        lambda uri: shutil.rmtree(uri, ignore_errors=True),
        max_examples=14,
        stateful_step_count=30,
    )


@pytest.mark.s3
@pytest.mark.slow  # the local machine runs by default; S3 adds the storage layer's own faults and races
def test_writer_state_machine_s3(s3_bucket, s3_storage_options):
    run_machine(
        lambda: f"s3://{s3_bucket}/{uuid.uuid4()}",
        s3_storage_options,
        lambda uri: None,
        max_examples=3,
        stateful_step_count=12,
    )


@pytest.mark.slow
def test_writer_state_machine_local_long(tmp_path):
    run_machine(
        lambda: str(tmp_path / uuid.uuid4().hex),
        None,
        lambda uri: shutil.rmtree(uri, ignore_errors=True),
        max_examples=300,
        stateful_step_count=50,
    )


@pytest.mark.slow
@pytest.mark.s3
def test_writer_state_machine_s3_long(s3_bucket, s3_storage_options):
    run_machine(
        lambda: f"s3://{s3_bucket}/{uuid.uuid4()}",
        s3_storage_options,
        lambda uri: None,
        max_examples=30,
        stateful_step_count=30,
    )
