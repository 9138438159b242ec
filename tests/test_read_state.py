"""Read state carried across versions is exact: one long-lived DataFusion context, with the tables
registered once, answers every query shape exactly like a dict model after every step of a history of
writes, flushes, merges, index builds and catch-ups (with index upkeep: segment merges and vector
index retraining), base compactions (`table.compact` with thresholds small enough to fire, and Lance's
own `compact_files`), version cleanups, GC and writer reopens.

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
from support.figures import case_name, record
from support.jobs import cleanup
from support.read_state import (
    CATEGORIES,
    DIM,
    WORDS,
    Model,
    Row,
    add_base_indexes,
    add_vector_index,
    check_reads,
    create,
    row,
    seeded_row,
    to_table,
)

import memwal_df as mw
from memwal_df.format import memwal_index
from memwal_df.jobs.compaction import CompactionResult, CompactionSettings, debt
from memwal_df.jobs.index_catchup import CatchUpResult, coverage
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

GUARANTEE = "reader freshness"
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


# Thresholds these small tables pass: a few small fragments, or one with a deleted row, are due; a
# small target (a fragment is small below it) also splits a rewrite into several fragments.
COMPACTIONS = st.builds(
    lambda sizes, n, share: CompactionSettings(sizes[0], sizes[1], n, share),
    st.sampled_from([(8, 8), (40, 40), (1 << 20, 1_000)]),
    st.integers(2, 3),
    st.sampled_from([0.01, 0.5]),
)
UPKEEPS = st.builds(
    IndexUpkeepSettings, max_segments=st.integers(1, 2), retrain_share=st.sampled_from([0.01, 0.3, 10.0])
)
UPKEEP = IndexUpkeepSettings(max_segments=1, retrain_share=0.3)
COMPACTION = CompactionSettings(small_fragment_rows=1_000, min_small_fragments=2, max_deleted_share=0.01)


def index_state(uri: str) -> tuple[set[int], dict[str, set[int]], dict[str, dict[uuid.UUID, int]]]:
    """(fragment ids, fragments each base index covers, recorded index catch-up) of the latest version."""
    ds = lance.dataset(uri)
    found = memwal_index.read_details(uri, None, ds.version)
    catchup = memwal_index.index_catchup(found[0]) if found else {}
    covered = {name: frags for name, frags in coverage(ds).items() if name != "__lance_mem_wal"}
    return {f.fragment_id for f in ds.get_fragments()}, covered, catchup


def compact_keeping_indexes(table: mw.Table, settings: CompactionSettings) -> CompactionResult:
    """`table.compact`, checking that its commit remapped every index (no bitmap names a retired
        fragment; an index covering every fragment still does), kept each index's recorded catch-up and left
    no fragment past `max_deleted_share`."""
    frags, covered, catchup = index_state(table.uri)
    done = table.compact(settings)
    frags_after, covered_after, catchup_after = index_state(table.uri)
    # Lance rewrites every fragment with deletions past the share (small ones only in runs of two or more)
    assert done.compacted or not done.debt.mostly_deleted
    assert not debt(lance.dataset(table.uri), settings).mostly_deleted
    assert len(frags_after) == len(frags) - done.fragments_removed + done.fragments_added
    for name, was in covered.items():
        stale = covered_after[name] - frags_after  # (a merge deleting all of a fragment's rows retires it)
        assert stale <= was - frags, f"{name} names fragments the compaction retired: {stale}"
        if frags <= was:
            assert frags_after <= covered_after[name], f"{name} lost coverage"
        for region, gen in catchup.get(name, {}).items():
            assert catchup_after.get(name, {}).get(region, 0) >= gen, f"{name} catch-up went back"
    return done


def _maintain(table: mw.Table) -> None:
    (done,) = table.maintain(
        interval=0, max_rounds=1, grace=ZERO, version_retention=ZERO, compact=COMPACTION, index_upkeep=UPKEEP
    )
    assert not done.errors, done.errors
    compacted = done.results["compact"]
    assert isinstance(compacted, CompactionResult)
    event(f"maintain round compacted: {compacted.compacted}")


def _cleanup_and_gc(table: mw.Table) -> None:
    cleanup(table)
    table.gc(grace=ZERO)


# Background work, each run by a table object of its own: the maintain loop's round (merge, index
# build, catch-up, cleanup, GC), drawn twice as often as the others, or one job alone, so that the
# states between jobs are read too.
JOBS: dict[str, Callable[[mw.Table], Any]] = {
    "maintain round": _maintain,
    "merge": lambda t: t.merge(),
    "merge one generation per region": lambda t: t.merge(max_generations=1),
    "index build and catch-up": lambda t: (t.build_index(), t.catch_up_indexes()),
    "index catch-up with upkeep": lambda t: t.catch_up_indexes(upkeep=UPKEEP),
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
        self.vector_indexed = False
        self.steps = 0
        self.compactions = 0  # table.compact calls that rewrote fragments
        self.segment_merges = 0  # index optimizes that merged an index's segments or retrained it
        self.rows_checked = 0
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
    def put(self, rows: list[Row], then_flush: bool) -> None:
        assert self.writer is not None
        self.writer.put(to_table(rows))
        apply(self.acked, rows)
        if then_flush:
            self.flush()

    @precondition(lambda self: self.writer is not None)
    @rule(
        first=st.integers(0, 200),
        count=st.integers(10, 80),
        seed=st.integers(1, 99),
        then_flush=st.booleans(),
    )
    def put_many(self, first: int, count: int, seed: int, then_flush: bool) -> None:
        """A batch of new and existing keys over a wider key range: levels of many rows."""
        self.put([seeded_row(k, seed) for k in range(first, first + count)], then_flush)

    @precondition(lambda self: self.writer is not None and self.acked)
    @rule(data=st.data())
    def update_existing(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.acked)), min_size=1, max_size=4))
        self.put([seeded_row(k, data.draw(st.integers(1, 99))) for k in keys], data.draw(st.booleans()))

    @precondition(lambda self: self.writer is not None)
    @rule(data=st.data(), then_flush=st.booleans())
    def delete(self, data: st.DataObject, then_flush: bool) -> None:
        """Deletes of present keys (in any level) and of absent ones."""
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
        self.all_flushed()

    def all_flushed(self) -> None:
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
        self.all_flushed()
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

    @precondition(lambda self: not self.vector_indexed)
    @rule()
    def create_vector_index(self) -> None:
        """An IVF_FLAT index on the vectors (one partition: every search probes it all, exactly), which
        index catch-up then extends with delta segments, merges and retrains."""
        self.vector_indexed = add_vector_index(self.uri)
        event(f"vector index created: {self.vector_indexed}")

    @rule(settings=COMPACTIONS)
    def compact(self, settings: CompactionSettings) -> None:
        """`table.compact` by another table object, right after a merge (new fragments, deletion
        files); the maintain round compacts without one."""
        jobs = mw.open_table(self.uri)
        jobs.merge()
        done = compact_keeping_indexes(jobs, settings)
        self.compactions += done.compacted
        event(f"compact rewrote fragments: {done.compacted}")

    @rule(upkeep=UPKEEPS, merge_first=st.booleans())
    def index_upkeep(self, upkeep: IndexUpkeepSettings, merge_first: bool) -> None:
        """Index catch-up bounded by `upkeep` (merges every segment at `max_segments`, retrains the
        vector index past `retrain_share`), by another table object."""
        jobs = mw.open_table(self.uri)
        if merge_first:
            jobs.merge()
        done = jobs.catch_up_indexes(upkeep=upkeep)
        assert isinstance(done, CatchUpResult)
        merged = sum(i.merged_segments or i.retrained for i in done.indexes)
        self.segment_merges += merged
        for i in done.indexes:
            event(f"index upkeep: merged segments {i.merged_segments}, retrained {i.retrained}")
        if self.vector_indexed:
            segments = {d.name: len(d.segments) for d in lance.dataset(self.uri).describe_indices()}
            assert segments["vec_idx"] <= upkeep.max_segments, segments

    @rule(job=st.sampled_from([*JOBS, "maintain round"]))
    def background_job(self, job: str) -> None:
        """One background job, or the maintain loop's round of all of them, by another table object."""
        JOBS[job](mw.open_table(self.uri))
        event(f"job: {job}")

    # ------------------------------------------------------------------ the check after every step

    @invariant()
    def reads_equal_the_model(self) -> None:
        self.steps += 1
        self.rows_checked += check_reads(self.ctx, "d", self.flushed, seed=self.steps)
        projected = self.durable.to_table(columns=["category", "id"]).to_pylist()
        assert sorted(projected, key=lambda r: r["id"]) == [
            {"category": r["category"], "id": k} for k, r in sorted(self.flushed.items())
        ]
        if self.writer is not None:
            self.rows_checked += check_reads(self.ctx, "w", self.acked, seed=self.steps)

    def teardown(self) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self._cleanup()


def run_machine(tmp_path: Path, request: pytest.FixtureRequest, **cfg: Any) -> dict[str, int]:
    """Run the machine; (over every history) how many `compact` rules rewrote fragments and how many
    `index_upkeep` rules merged an index's segments or retrained it."""
    totals = {"compactions": 0, "segment_merges": 0}

    class Machine(ReadStateMachine):
        def __init__(self) -> None:
            uri = str(tmp_path / uuid.uuid4().hex)
            super().__init__(uri, lambda: shutil.rmtree(uri, ignore_errors=True))

        def teardown(self) -> None:
            super().teardown()
            totals["compactions"] += self.compactions
            totals["segment_merges"] += self.segment_merges
            record(
                GUARANTEE, case_name(request), histories=1, steps=self.steps, rows_checked=self.rows_checked
            )

    run_state_machine_as_test(
        Machine,
        settings=settings(
            deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **cfg
        ),
    )
    return totals


def test_read_state_machine(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    run_machine(tmp_path, request, max_examples=5, stateful_step_count=20)


@pytest.mark.slow
def test_read_state_machine_long(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    totals = run_machine(tmp_path, request, max_examples=100, stateful_step_count=40)
    assert totals["compactions"] and totals["segment_merges"], totals


# ---------------------------------------------------------------------- lifecycle edges, one by one


class Lsm:
    """A table with a durable writer and one context holding `d` (durable levels) and `w` (with the
    writer), both registered once; `check` compares every read shape of both with the models."""

    def __init__(self, uri: str, base: list[int], regions: int = 2, indexed: bool = False) -> None:
        self.uri = uri
        rows = [seeded_row(k, 0) for k in base]
        self.table = create(uri, regions, rows)
        if indexed:
            add_base_indexes(uri)
        self.acked: Model = {}
        apply(self.acked, rows)
        self.flushed = dict(self.acked)
        self.writer = writer(self.table)
        self.durable = mw.MemWalTable(uri)
        self.ctx = mw.register(datafusion.SessionContext())
        self.ctx.register_table("d", self.durable)
        self.ctx.register_table("w", mw.MemWalTable(uri, writer=self.writer))
        self.checks = 0
        self.rows_checked = 0

    def put(self, keys: list[int], seed: int) -> None:
        rows = [seeded_row(k, seed) for k in keys]
        self.writer.put(to_table(rows))
        apply(self.acked, rows)

    def delete(self, keys: list[int]) -> None:
        self.writer.delete(keys)
        for k in keys:
            self.acked.pop(k, None)

    def flush(self) -> None:
        self.writer.flush()
        self.flushed = dict(self.acked)

    def jobs(self) -> mw.Table:
        return mw.open_table(self.uri)

    def collect(self) -> dict[uuid.UUID, tuple[int, ...]]:
        """Index catch-up (GC keeps merged generations base indexes do not cover), cleanup of every
        base version but the latest, GC without grace; the generations GC removed."""
        jobs = self.jobs()
        jobs.catch_up_indexes()
        cleanup(jobs)
        return jobs.gc(grace=ZERO).generations

    def base_versions(self) -> list[int]:
        return sorted(v["version"] for v in lance.dataset(self.uri).versions())

    def check(self) -> None:
        self.checks += 1
        self.rows_checked += check_reads(self.ctx, "d", self.flushed, seed=self.checks)
        self.rows_checked += check_reads(self.ctx, "w", self.acked, seed=self.checks)

    def close(self, request: pytest.FixtureRequest) -> None:
        self.writer.close()
        record(GUARANTEE, case_name(request), steps=self.checks, rows_checked=self.rows_checked)


@pytest.fixture(params=["no base index", "base indexes"])
def indexed(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "base indexes")


def test_a_query_planned_before_a_merge_runs_after_it(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """A DataFrame built, and a scan planned (its fragments taken), before a merge, return the rows of
    their snapshot when run after it; the merge changes no row, so that is the model."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    lsm.put(list(range(0, 12)), seed=1)
    lsm.flush()
    lsm.delete([2, 14])
    lsm.put([3, 21], seed=2)
    lsm.flush()
    lsm.check()
    frame = lsm.ctx.sql("SELECT * FROM d ORDER BY id")
    counted = lsm.ctx.sql("SELECT count(*) AS n FROM d")
    fragments = lsm.durable.get_fragments()
    assert lsm.jobs().merge().generations
    assert frame.to_arrow_table().to_pylist() == [lsm.flushed[k] for k in sorted(lsm.flushed)]
    assert counted.to_arrow_table().to_pylist() == [{"n": len(lsm.flushed)}]
    scanned = [r for f in fragments for r in f.scanner().to_table().to_pylist()]
    assert sorted(scanned, key=lambda r: r["id"]) == [lsm.flushed[k] for k in sorted(lsm.flushed)]
    lsm.check()
    lsm.close(request)


def test_a_generation_collected_between_two_queries(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """Queries that read (and may keep state of) generations, then merge, version cleanup and GC
    remove those generations: the next queries read their rows from the base."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    for seed in (1, 2, 3):
        lsm.put(list(range(seed, 24, 3)), seed=seed)
        lsm.delete([seed * 4])
        lsm.flush()
    lsm.check()
    assert lsm.jobs().merge().generations
    assert lsm.collect()
    lsm.check()
    lsm.put([1, 2, 30], seed=4)
    lsm.flush()
    lsm.check()
    lsm.close(request)


def test_a_region_created_after_the_reader_was_registered(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """Readers registered while the table has no region, then while it has one, see the rows of
    every region created since (in the writer's MemTables, then flushed, then merged)."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), regions=4, indexed=indexed)
    assert lsm.table.region_ids() == []
    lsm.check()
    lsm.put([0], seed=1)
    lsm.flush()
    lsm.check()
    assert len(lsm.jobs().region_ids()) == 1
    lsm.put(list(range(1, 12)), seed=2)
    lsm.check()
    lsm.flush()
    assert len(lsm.jobs().region_ids()) == 4
    lsm.check()
    lsm.jobs().merge()
    lsm.check()
    lsm.close(request)


def test_version_cleanup_removes_the_base_version_a_previous_query_used(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """Every query shape runs on base version v; merges make newer versions and cleanup deletes v:
    the next queries read the latest version, whatever was derived from v before."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    for seed in (1, 2):
        used = lsm.base_versions()[-1]
        lsm.check()
        lsm.put(list(range(seed, 20, 2)), seed=seed)
        lsm.delete([seed * 2])
        lsm.flush()
        assert lsm.jobs().merge().generations
        cleanup(lsm.table)
        assert used not in lsm.base_versions()
        lsm.check()
    lsm.close(request)


def test_a_key_updated_in_two_generations_then_one_merged(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """Keys written in generation 1 and again (updated, or deleted) in generation 2 of their region;
    merging generation 1 only puts its rows into the base, below generation 2's, which still win."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    keys = [1, 4, 7, 10, 13]
    lsm.put(keys, seed=1)
    lsm.flush()
    lsm.put(keys[:3], seed=2)
    lsm.delete(keys[3:])
    lsm.flush()
    lsm.check()
    merged = lsm.jobs().merge(max_generations=1).generations
    assert merged and all(gens == (1,) for gens in merged.values())
    lsm.check()
    assert lsm.collect()
    lsm.check()
    assert lsm.jobs().merge().generations
    lsm.check()
    lsm.close(request)


def test_a_delete_of_a_key_only_the_base_holds(
    tmp_path: Path, indexed: bool, request: pytest.FixtureRequest
) -> None:
    """Deletes of base rows no generation holds: hidden while in the MemTable (`w` only), flushed
    (both), merged, and after cleanup and GC; counts, aggregates and both searches leave them out."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    lsm.check()
    lsm.delete([0, 6, 12])
    lsm.check()
    lsm.flush()
    lsm.check()
    assert lsm.jobs().merge().generations
    lsm.check()
    assert lsm.collect()
    lsm.delete([2])
    lsm.check()
    lsm.close(request)


@pytest.mark.parametrize("how", ["table.compact", "Lance compact_files"])
def test_a_base_compaction_moves_every_row(
    tmp_path: Path, indexed: bool, how: str, request: pytest.FixtureRequest
) -> None:
    """A compaction rewrites the base's fragments (new row addresses, deletions applied) between
    queries: state located by row address or fragment must not survive it. `table.compact` with a
    small target writes several fragments and remaps the indexes in its commit."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=indexed)
    for seed in (1, 2, 3):
        lsm.put(list(range(seed, 20, 4)), seed=seed)
        lsm.delete([seed * 2])
        lsm.flush()
        assert lsm.jobs().merge().generations
    lsm.put([5, 8], seed=4)
    lsm.flush()
    lsm.check()
    before = lance.dataset(lsm.uri).get_fragments()
    assert any(f.metadata.deletion_file is not None for f in before)
    if how == "table.compact":
        done = compact_keeping_indexes(lsm.jobs(), CompactionSettings(8, 8, 2, 0.01))
        assert done.compacted and done.fragments_added > 1
    else:
        lance.dataset(lsm.uri).optimize.compact_files(target_rows_per_fragment=1 << 20)
    after = lance.dataset(lsm.uri).get_fragments()
    assert len(after) < len(before)
    assert not {f.fragment_id for f in after} & {f.fragment_id for f in before}
    assert all(f.metadata.deletion_file is None for f in after)
    lsm.check()
    assert lsm.jobs().merge().generations
    lsm.check()
    lsm.close(request)


def test_index_segments_merged_and_a_vector_index_retrained_between_queries(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Index catch-up adds delta segments to a vector index, then merges them into one and retrains
    it, and a compaction rewrites what it covers, between queries of one reader: searches through
    the index, lookups and scans stay exact after each."""
    lsm = Lsm(str(tmp_path / "t"), list(range(0, 20, 2)), indexed=True)
    assert add_vector_index(lsm.uri)
    lax = IndexUpkeepSettings(max_segments=4, retrain_share=100.0)

    def segments() -> int:
        return {d.name: len(d.segments) for d in lance.dataset(lsm.uri).describe_indices()}["vec_idx"]

    for seed in (1, 2):
        lsm.put(list(range(seed, 24, 3)), seed=seed)
        lsm.delete([seed * 4])
        lsm.flush()
        assert lsm.jobs().merge().generations
        lsm.check()
        (vec,) = [i for i in lsm.jobs().catch_up_indexes(upkeep=lax).indexes if i.name == "vec_idx"]
        assert vec.rebuilt and not vec.merged_segments and not vec.retrained
        lsm.check()
    assert segments() == 3
    done = lsm.jobs().catch_up_indexes(upkeep=IndexUpkeepSettings(max_segments=2, retrain_share=100.0))
    assert any(i.merged_segments for i in done.indexes), done
    assert segments() == 1
    lsm.check()
    lsm.put(list(range(0, 30, 2)), seed=3)
    lsm.flush()
    assert lsm.jobs().merge().generations
    lsm.check()
    done = lsm.jobs().catch_up_indexes(upkeep=IndexUpkeepSettings(max_segments=4, retrain_share=0.1))
    assert any(i.retrained for i in done.indexes)
    assert segments() == 1
    lsm.check()
    assert compact_keeping_indexes(lsm.jobs(), CompactionSettings(8, 8, 2, 0.01)).compacted
    lsm.check()
    # merged but not caught up (the search reads those generations instead of the index's gap), then
    # compacted together with indexed fragments: rows of both must stay found
    lsm.put(list(range(1, 30, 4)), seed=4)
    lsm.delete([3, 6])
    lsm.flush()
    assert lsm.jobs().merge().generations
    lsm.check()
    assert compact_keeping_indexes(lsm.jobs(), CompactionSettings(8, 8, 2, 0.01)).compacted
    lsm.check()
    lsm.close(request)
