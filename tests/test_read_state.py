"""Read state carried across versions is exact: one long-lived DataFusion context, with the tables
registered once, answers every query shape exactly like a dict model after every step of a history of
writes, flushes, merges, index builds and catch-ups, base compactions, version cleanups, GC and writer
reopens.

Two tables are registered: `d`, `MemWalTable(uri)` (the durable levels: checked against the model of
flushed rows), and `w`, `MemWalTable(uri, writer=w)` while a writer is open (every acknowledged write;
registered again when the writer changes, as a new writer is a new reader). Whatever a reader derives
and keeps from immutable levels (deduplicated views, key indexes, term statistics, row counts) must be
patched or dropped when the level set changes: any staleness shows up as a difference from the model.

The focused tests below the state machine pin each lifecycle edge such state could get wrong.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import lance
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
from support.jobs import cleanup
from support.read_state import (
    CATEGORIES,
    DIM,
    WORDS,
    Model,
    Row,
    add_base_indexes,
    check_reads,
    create,
    row,
    seeded_row,
    to_table,
)

import memwal_df as mw

ZERO = timedelta(0)
KEYS = st.integers(0, 30)
VALUES = st.none() | st.integers(-8, 8).map(lambda v: v / 4)
TEXTS = st.none() | st.lists(st.sampled_from(WORDS), max_size=4).map(" ".join)
VECTORS = st.none() | st.lists(st.integers(-4, 4).map(lambda v: v / 2), min_size=DIM, max_size=DIM)
ROWS = st.lists(
    st.builds(row, KEYS, st.none() | st.sampled_from(CATEGORIES), VALUES, TEXTS, VECTORS),
    min_size=1,
    max_size=6,
)


def writer(table: mw.Table) -> mw.TableWriter:
    """A durable writer whose MemTables are flushed only when asked."""
    return table.writer(durable=True, max_memtable_rows=1_000_000, max_memtable_batches=1_000_000)


def apply(model: Model, rows: list[Row]) -> None:
    """Upserts in order: the last row of a key wins."""
    for r in rows:
        model[r["id"]] = dict(r)


def _maintain(table: mw.Table) -> None:
    (done,) = table.maintain(interval=0, max_rounds=1, grace=ZERO, version_retention=ZERO)
    assert not done.errors, done.errors


def _cleanup_and_gc(table: mw.Table) -> None:
    cleanup(table)
    table.gc(grace=ZERO)


# Background work on the table, each run by a table object of its own; the maintain round (merge,
# index build, catch-up, cleanup, GC) is drawn twice as often as the others.
JOBS: dict[str, Callable[[mw.Table], Any]] = {
    "maintain round": _maintain,
    "merge": lambda t: t.merge(),
    "merge one generation per region": lambda t: t.merge(max_generations=1),
    "index build and catch-up": lambda t: (t.build_index(), t.catch_up_indexes()),
    "compact the base (Lance)": lambda t: lance.dataset(t.uri).optimize.compact_files(
        target_rows_per_fragment=1 << 20
    ),
    "version cleanup": cleanup,
    "gc": lambda t: t.gc(grace=ZERO),
    "version cleanup and gc": _cleanup_and_gc,
}


class ReadStateMachine(RuleBasedStateMachine):
    def __init__(self, uri: str, cleanup_dir: Callable[[], None]) -> None:
        super().__init__()
        self.uri, self._cleanup = uri, cleanup_dir
        self.acked: Model = {}  # every acknowledged write
        self.flushed: Model = {}  # what the durable levels hold (generations + base)
        self.writer: mw.TableWriter | None = None
        self.indexed = False
        self.steps = 0
        self.ctx = mw.register(datafusion.SessionContext())

    # ------------------------------------------------------------------ setup

    @initialize(regions=st.integers(2, 4), base=st.lists(KEYS, max_size=12, unique=True))
    def start(self, regions: int, base: list[int]) -> None:
        rows = [seeded_row(k, 0) for k in sorted(base)]
        self.table = create(self.uri, regions, rows)
        apply(self.acked, rows)
        apply(self.flushed, rows)
        self.durable = mw.MemWalTable(self.uri)
        self.ctx.register_table("d", self.durable)
        self.open_writer()

    def open_writer(self) -> None:
        self.writer = writer(self.table)
        self.ctx.register_table("w", mw.MemWalTable(self.uri, writer=self.writer))

    # ------------------------------------------------------------------ writes

    @precondition(lambda self: self.writer is not None)
    @rule(rows=ROWS, then_flush=st.booleans())
    def put(self, rows: list[Row], then_flush: bool = False) -> None:
        assert self.writer is not None
        self.writer.put(to_table(rows))
        apply(self.acked, rows)
        if then_flush:
            self.flush()

    @precondition(lambda self: self.writer is not None and self.acked)
    @rule(data=st.data())
    def update_existing(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.acked)), min_size=1, max_size=4))
        self.put([seeded_row(k, data.draw(st.integers(1, 99))) for k in keys], data.draw(st.booleans()))

    @precondition(lambda self: self.writer is not None)
    @rule(data=st.data(), then_flush=st.booleans())
    def delete(self, data: st.DataObject, then_flush: bool) -> None:
        assert self.writer is not None
        present = st.sampled_from(sorted(self.acked)) if self.acked else KEYS
        keys = data.draw(st.lists(present | KEYS, min_size=1, max_size=4))
        self.writer.delete(keys)
        for k in keys:
            self.acked.pop(k, None)
        if then_flush:
            self.flush()

    def flush(self) -> None:
        assert self.writer is not None
        self.writer.flush()
        self.flushed = {k: dict(r) for k, r in self.acked.items()}

    @precondition(lambda self: self.writer is not None)
    @rule(action=st.sampled_from(["flush", "close", "close and reopen"]))
    def lifecycle(self, action: str) -> None:
        """A flush, or a clean close (which flushes), then maybe a new writer: a new object, so `w`
        is registered again."""
        assert self.writer is not None
        if action == "flush":
            self.flush()
            return
        self.writer.close()
        self.flushed = {k: dict(r) for k, r in self.acked.items()}
        self.ctx.deregister_table("w")
        self.writer = None
        if action == "close and reopen":
            self.open_writer()

    @precondition(lambda self: self.writer is None)
    @rule()
    def reopen(self) -> None:
        self.table = mw.open_table(self.uri)
        self.open_writer()

    @precondition(lambda self: not self.indexed)
    @rule()
    def create_base_indexes(self) -> None:
        add_base_indexes(self.uri)
        self.indexed = True

    @rule(job=st.sampled_from([*JOBS, "maintain round"]))
    def background_job(self, job: str) -> None:
        """One background job, or the maintain loop's round of all of them, by another table object."""
        JOBS[job](mw.open_table(self.uri))
        event(f"job: {job}")

    # ------------------------------------------------------------------ the check after every step

    @invariant()
    def reads_equal_the_model(self) -> None:
        if not hasattr(self, "durable"):
            return
        self.steps += 1
        check_reads(self.ctx, "d", self.flushed, seed=self.steps)
        projected = self.durable.to_table(columns=["category", "id"]).to_pylist()
        assert sorted(projected, key=lambda r: r["id"]) == [
            {"category": r["category"], "id": k} for k, r in sorted(self.flushed.items())
        ]
        if self.writer is not None:
            check_reads(self.ctx, "w", self.acked, seed=self.steps)

    def teardown(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self._cleanup()


def run_machine(tmp_path: Path, **cfg: Any) -> None:
    class Machine(ReadStateMachine):
        def __init__(self) -> None:
            uri = str(tmp_path / uuid.uuid4().hex)
            super().__init__(uri, lambda: shutil.rmtree(uri, ignore_errors=True))

    run_state_machine_as_test(
        Machine,
        settings=settings(
            deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **cfg
        ),
    )


def test_read_state_machine(tmp_path: Path) -> None:
    run_machine(tmp_path, max_examples=10, stateful_step_count=30)


@pytest.mark.slow
def test_read_state_machine_long(tmp_path: Path) -> None:
    run_machine(tmp_path, max_examples=150, stateful_step_count=40)
