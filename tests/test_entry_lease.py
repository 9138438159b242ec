"""Merge progress never goes backwards and no generation merges twice: MemWAL index-entry
commits (index builder, catch-up record) racing mergers.

- Deterministic: a merger started from inside the index builder's Lance commit (the race that made
  Lance rebase the entry over the merge and publish lower progress), a builder that dies right after
  that commit, and a builder whose lease expired and was taken over by a merger.
- Randomized interleavings of a writer, two mergers, the builder and index catch-up, as threads
  (random delays before every Lance commit) and as processes.
Every retained base version is checked by `VersionOracle` (progress monotonic, the base equals the
initial rows plus each region's generations up to its progress, applied once and in order).
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lance
import pytest
from lance.dataset import LanceOperation, MergeInsertBuilder
from support.jobs import VersionOracle, Workload, base_rows, create, rows_at

import memwal_df as mw
from memwal_df.errors import CommitConflictError, CorruptManifestError
from memwal_df.format import entry_lease, memwal_index
from memwal_df.format import lease as lease_module
from memwal_df.format.lease import Lease
from memwal_df.jobs.merger import MergeResult


def _with_generations(uri: str, options: dict[str, str] | None, n: int = 3, seed: int = 1) -> Workload:
    work = Workload(create(uri, options, regions=2), seed)
    with work.table.writer() as w:
        for _ in range(n):
            work.generation(w)
    work.table.refresh()
    return work


def _is_entry_commit(operation: Any) -> bool:
    return isinstance(operation, LanceOperation.CreateIndex) and any(
        i.name == memwal_index.MEMWAL_INDEX_NAME for i in operation.new_indices
    )


class _MergeInsideEntryCommit:
    """At the first Lance commit of the MemWAL entry, start `table.merge()` in a thread (another
    table handle) and let the commit go on once that merge finished or waits for the entry lease.
    `after_commit` runs right after that first commit returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, table: mw.Table, after_commit: Callable[[], None]):
        self.uri, self.options = table.uri, table.storage_options or None
        self.after_commit = after_commit
        self.proceed = threading.Event()
        self.held_back = threading.Event()
        self.results: list[Any] = []
        self.thread: threading.Thread | None = None
        real_commit = lance.LanceDataset.commit
        real_wait = entry_lease._wait_while_active

        def commit(*args: Any, **kwargs: Any) -> Any:
            if self.thread is not None or not _is_entry_commit(args[1]):
                return real_commit(*args, **kwargs)
            self.thread = threading.Thread(target=self._merge)
            self.thread.start()
            self.proceed.wait()
            done = real_commit(*args, **kwargs)
            self.after_commit()
            return done

        def wait(storage: Any, lease: Lease | None) -> Any:
            if threading.current_thread() is self.thread and lease and lease.active(lease_module.now_ms()):
                self.held_back.set()
                self.proceed.set()
            return real_wait(storage, lease)

        monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(commit))
        monkeypatch.setattr(entry_lease, "_wait_while_active", wait)

    def _merge(self) -> None:
        try:
            self.results.append(mw.open_table(self.uri, storage_options=self.options).merge())
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.results.append(e)
        finally:
            self.proceed.set()

    def join(self) -> MergeResult:
        assert self.thread is not None, "the MemWAL entry was never committed"
        self.thread.join(timeout=300)
        (result,) = self.results
        assert isinstance(result, MergeResult), result
        return result


def test_merge_racing_the_builder_commit_never_lowers_progress(table_uri, table_storage_options, monkeypatch):
    work = _with_generations(table_uri, table_storage_options)
    table, oracle = work.table, VersionOracle(work.table)
    race = _MergeInsideEntryCommit(monkeypatch, table, after_commit=lambda: None)
    table.build_index()
    merged = race.join()
    assert race.held_back.is_set()  # the merger waited for the entry lease
    assert sum(len(g) for g in merged.generations.values()) >= 4
    assert oracle.check() >= 5
    assert base_rows(table) == work.model
    assert rows_at(table) == work.model


class _Died(Exception):
    pass


def _die() -> None:
    raise _Died


def test_builder_dying_after_its_commit_leaves_nothing_to_merge_twice(tmp_path, monkeypatch):
    """Before the lease: the rebased entry (lower progress) stayed when the builder died before its
    repair commit, every later build carried it forward, and once the merger's 16-version lookback
    no longer reached the merge, the merger merged every generation again."""
    work = _with_generations(str(tmp_path / "t"), None)
    table, oracle = work.table, VersionOracle(work.table)
    race = _MergeInsideEntryCommit(monkeypatch, table, after_commit=_die)
    with pytest.raises(_Died):
        table.build_index()
    first = race.join()
    for _ in range(17):
        table.build_index()
    again = table.merge()
    assert first.generations and not again.generations
    oracle.check()
    assert base_rows(table) == work.model


def test_a_merger_takes_over_an_expired_lease_and_fences_out_its_holder(tmp_path, monkeypatch):
    """The builder's lease expires before it commits (`ttl=0`); the merger fences and merges; the
    builder's commit, read before that fence, conflicts instead of rebasing over the merge."""
    work = _with_generations(str(tmp_path / "t"), None)
    table, oracle = work.table, VersionOracle(work.table)
    monkeypatch.setattr(entry_lease, "DEFAULT_TTL", timedelta(0))
    race = _MergeInsideEntryCommit(monkeypatch, table, after_commit=lambda: None)
    with pytest.raises(CommitConflictError, match="Merge"):
        table.build_index()
    merged = race.join()
    assert not race.held_back.is_set() and merged.generations  # nothing to wait for: it took over
    lease = entry_lease.current(table.storage)
    assert lease is not None and lease.released and lease.holder == "takeover"
    oracle.check()
    monkeypatch.undo()
    table.build_index()  # the next build commits normally
    oracle.check()
    assert base_rows(table) == work.model


def test_the_lease_is_released_and_pruned(tmp_path):
    table = _with_generations(str(tmp_path / "t"), None, n=1).table
    assert entry_lease.current(table.storage) is None
    for _ in range(3):
        table.build_index()
    lease = entry_lease.current(table.storage)
    assert lease is not None and lease.released and lease.epoch == 3
    assert table.storage.list_dir(entry_lease.LEASE_DIR) == [f"{3:020d}.json"]
    held = entry_lease.acquire(table.storage)
    assert held.epoch == 4 and entry_lease.current(table.storage) == held
    threading.Timer(0.2, entry_lease.release, args=(table.storage, held)).start()
    assert not entry_lease.admit(table.storage, table.uri, None)  # waited for the release
    assert entry_lease.current(table.storage) == Lease(4, held.holder, held.expires_ms, True)
    assert entry_lease.admit(table.storage, table.uri, None)


# ------------------------------------------------------------------------------------------------
# Randomized interleavings

# two mergers (one merging its regions in parallel threads), the index builder, index catch-up
JOBS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("merge", {"generations_per_commit": 1}),  # one generation per commit pair: the most versions
    ("merge", {"parallel": True}),  # runs of generations
    ("build_index", {}),
    ("catch_up_indexes", {}),
)


def _loop(
    uri: str, options: dict[str, str] | None, job: tuple[str, dict[str, Any]], stop: Any, errors: list
) -> None:
    table = mw.open_table(uri, storage_options=options)
    name, kwargs = job
    while not stop.is_set():
        try:
            getattr(table, name)(**kwargs)
        except CommitConflictError:
            pass  # a lost race: the next call retries
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return
        stop.wait(0.05)


def _jitter(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A random delay (0-30 ms, seeded) before every Lance commit and merge_insert."""
    rng, lock = random.Random(seed), threading.Lock()
    real_commit, real_execute = lance.LanceDataset.commit, MergeInsertBuilder.execute

    def pause() -> None:
        with lock:
            delay = rng.random() * 0.03
        time.sleep(delay)

    def commit(*args: Any, **kwargs: Any) -> Any:
        pause()
        return real_commit(*args, **kwargs)

    def execute(self: MergeInsertBuilder, *args: Any, **kwargs: Any) -> Any:
        pause()
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(commit))
    monkeypatch.setattr(MergeInsertBuilder, "execute", execute)


def _finish(work: Workload, oracle: VersionOracle) -> None:
    table = work.table
    table.merge()
    assert oracle.check() > 10
    assert base_rows(table) == work.model
    assert rows_at(table) == work.model


@pytest.mark.parametrize(
    "seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]
)
@pytest.mark.slow_on_s3
def test_random_interleavings_threads(table_uri, table_storage_options, monkeypatch, seed):
    table = create(table_uri, table_storage_options, regions=3)
    lance.dataset(table.uri, storage_options=table_storage_options).create_scalar_index("id", "BTREE")
    work, oracle = Workload(table, seed), VersionOracle(table)
    _jitter(monkeypatch, seed)
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_loop, args=(table.uri, table_storage_options, j, stop, errors)) for j in JOBS
    ]
    for t in threads:
        t.start()
    try:
        with table.writer() as w:
            for _ in range(6):
                work.generation(w)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    _finish(work, oracle)


def _loop_process(uri: str, job: tuple[str, dict[str, Any]], stop: Any, queue: Any) -> None:
    errors: list[BaseException] = []
    _loop(uri, None, job, stop, errors)
    queue.put(repr(errors[0]) if errors else None)


def test_random_interleavings_processes(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=3)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    work, oracle = Workload(table, seed=5), VersionOracle(table)
    ctx = multiprocessing.get_context("spawn")
    stop, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_loop_process, args=(table.uri, j, stop, queue)) for j in JOBS]
    for p in procs:
        p.start()
    try:
        with table.writer() as w:
            for _ in range(8):
                work.generation(w)
                time.sleep(random.random() * 0.5)
        # the job processes interleave until the base has versions enough to check (a loaded
        # machine gives them fewer rounds in the writer's time)
        deadline = time.monotonic() + 120
        while len(lance.dataset(table.uri).versions()) <= 12 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        outcomes = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    assert outcomes == [None] * len(procs)
    assert all(p.exitcode == 0 for p in procs)
    _finish(work, oracle)


def test_a_corrupt_lease_is_a_typed_error(tmp_path):
    table = _with_generations(str(tmp_path / "t"), None, n=1).table
    table.storage.put(f"{entry_lease.LEASE_DIR}/{1:020d}.json", b"{not json")
    with pytest.raises(CorruptManifestError):
        entry_lease.current(table.storage)
    with pytest.raises(CorruptManifestError):
        table.merge()
