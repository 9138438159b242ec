"""Base compaction (`Table.compact`, `memwal_df.jobs.compaction`): when it runs and what it rewrites,
that readers (long-lived DataFusion contexts included), merge progress, index catch-up and index
coverage survive it, compaction racing merges and the MemWAL index writers (every retained version
checked by `VersionOracle`), a compaction that loses its commit race, and `maintain` keeping the
base a bounded number of fragments round after round."""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import timedelta
from typing import Any

import lance
import pyarrow as pa
import pytest
from lance.dataset import DatasetOptimizer, MergeInsertBuilder
from support.cases import backend
from support.compacting import INDEXES, Lsm, coverage, fragments, lance_rows, progress, segments, sql_rows
from support.jobs import VersionOracle, Workload, base_rows, create, rows_at
from support.search_oracle import bm25, terms

import memwal_df as mw
from memwal_df.errors import CommitConflictError, InvalidConfigError
from memwal_df.jobs import compaction
from memwal_df.jobs.compaction import CompactionSettings, debt
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

ZERO = timedelta(0)
SMALL = CompactionSettings(
    target_rows_per_fragment=1000, small_fragment_rows=100, min_small_fragments=4, max_deleted_share=0.25
)


def _versions(lsm: Lsm) -> list[int]:
    return sorted(v["version"] for v in lsm.dataset().versions())


# ------------------------------------------------------------------------------------------------
# When compaction runs and what it rewrites


def test_below_the_thresholds_nothing_is_rewritten(tmp_path):
    lsm = Lsm(str(tmp_path / "t"), base=400, indexes=False)
    # one merge: a small fragment per region (2 < min_small_fragments); 30 of 400 base rows updated
    lsm.generation(new=30, update=list(range(0, 90, 3)))
    lsm.table.merge()
    before = lsm.dataset()
    found = debt(before, SMALL)
    assert len(found.small) == 2 and not found.mostly_deleted and not found.due
    result = lsm.table.compact(SMALL)
    assert not result.compacted and result.fragments_added == 0 and result.version == before.version
    assert _versions(lsm) == sorted(v["version"] for v in before.versions())  # no new base version
    assert fragments(lsm.dataset()) == fragments(before)


def test_small_fragments_are_merged_and_a_large_live_fragment_is_kept(tmp_path):
    lsm = Lsm(str(tmp_path / "t"), base=400, indexes=False)
    for i in range(2):  # two merges: four small fragments (one per region each)
        lsm.generation(new=30, update=list(range(i * 45, i * 45 + 45, 3)))  # 15 base rows updated
        lsm.table.merge()
    before = fragments(lsm.dataset())
    assert before[0] == (400, 30) and 30 / 400 < SMALL.max_deleted_share  # large, mostly live
    small = sorted(f for f, (rows, _) in before.items() if rows < SMALL.small_fragment_rows)
    assert len(small) == 4 == SMALL.min_small_fragments
    result = lsm.table.compact(SMALL)
    assert result.compacted and result.debt.due and set(result.debt.small) == set(small)
    assert result.fragments_removed == 4 and result.fragments_added == 1
    after = fragments(lsm.dataset())
    assert after[0] == before[0]  # the large fragment, untouched (same id, same deletion count)
    (merged,) = set(after) - {0}
    assert merged not in before and after[merged] == (90, 0)  # 2 x (30 new + 15 updated) rows
    assert lance_rows(lsm.dataset()) == lsm.model
    assert not debt(lsm.dataset(), SMALL).due
    assert not lsm.table.compact(SMALL).compacted  # nothing left to do: no new version
    assert lsm.dataset().version == result.version


@pytest.mark.parametrize("deleted", [100, 99])
def test_a_fragment_at_the_deleted_share_is_rewritten(tmp_path, deleted):
    """400 base rows with 100 deleted is exactly `max_deleted_share` (0.25): rewritten without its
    deleted rows; 99 is below it: nothing is due."""
    lsm = Lsm(str(tmp_path / "t"), base=400, indexes=False)
    lsm.generation(delete=list(range(deleted)))  # tombstones only: the merge adds no fragment
    lsm.table.merge()
    assert fragments(lsm.dataset()) == {0: (400, deleted)}
    result = lsm.table.compact(SMALL)
    if deleted < 100:
        assert not result.debt.due and not result.compacted
        assert fragments(lsm.dataset()) == {0: (400, deleted)}
        return
    assert result.debt.mostly_deleted == (0,) and result.compacted
    after = fragments(lsm.dataset())
    assert 0 not in after and list(after.values()) == [(300, 0)]
    assert lance_rows(lsm.dataset()) == lsm.model
    assert not lsm.table.compact(SMALL).debt.due


@pytest.mark.parametrize(
    "bad",
    [
        {"target_rows_per_fragment": 0},
        {"small_fragment_rows": 0},
        {"small_fragment_rows": 2000, "target_rows_per_fragment": 1000},
        {"min_small_fragments": 1},
        {"max_deleted_share": 0},
        {"max_deleted_share": 1.5},
        {"max_deleted_share": -0.1},
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(InvalidConfigError):
        CompactionSettings(**bad)


# ------------------------------------------------------------------------------------------------
# What survives a compaction


def _history(lsm: Lsm, rounds: int) -> None:
    """Writes, merges and index catch-up: new keys, updates of base and merged keys, deletes."""
    rng = random.Random(7)
    for _ in range(rounds):
        keys = sorted(lsm.model)
        lsm.generation(new=25, update=rng.sample(keys, 30), delete=rng.sample(keys, 10))
        lsm.table.merge()
        lsm.table.catch_up_indexes()


def _check_searches(ctx: Any, lsm: Lsm) -> None:
    """fts finds exactly the rows holding the word; vector_search of stored vectors finds their rows
    at distance 0 (every partition probed, every candidate refined)."""
    for word in ("apple", "kiwi"):
        got = sql_rows(ctx, f"SELECT id, text, vec FROM fts('t', 'text', '{word}', 10000)")
        want = set(bm25(lsm.model, word))
        assert set(got) == want and all(word in terms(r["text"]) for r in got.values())
        assert all(got[k] == lsm.model[k] for k in got)
    options = "named_struct('nprobes', 2, 'refine_factor', 100)"
    for key in random.Random(3).sample(sorted(lsm.model), 5):
        vec = ", ".join(map(str, lsm.model[key]["vec"]))
        query = f"SELECT id, text, vec, _distance FROM vector_search('t', 'vec', [{vec}], 5, {options})"
        got = ctx.sql(query).to_arrow_table().to_pylist()
        assert got[0]["_distance"] == 0.0
        exact = [r["id"] for r in got if r["_distance"] == 0.0]
        assert key in exact, (key, got)


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_compaction_keeps_reads_progress_catch_up_and_index_coverage(request, tmp_path, kind):
    lsm = Lsm(*backend(request, kind, tmp_path))
    _history(lsm, 5)
    ctx = lsm.context()  # long-lived: registered once, before the compaction
    assert sql_rows(ctx) == lsm.model
    before = lsm.dataset()
    merged, catchup = progress(lsm)
    assert all(catchup[name] == merged for name in INDEXES)
    covered = coverage(before)
    assert all(covered[name] == set(fragments(before)) for name in INDEXES)
    vec_segments = len(segments(before, "vec_idx"))

    result = lsm.table.compact(SMALL)
    assert result.compacted and result.fragments_added < result.fragments_removed
    after = lsm.dataset()
    assert lance_rows(after) == lsm.model
    assert progress(lsm) == (merged, catchup)  # merge progress and catch-up as they were
    frags = set(fragments(after))
    assert set(fragments(before)) - frags, "the compaction rewrote nothing"
    for name in INDEXES:  # every index still covers every fragment
        assert coverage(after)[name] == frags, name
    assert len(segments(after, "vec_idx")) <= vec_segments
    caught = lsm.table.catch_up_indexes()
    assert all(
        not i.rebuilt and not i.unverified and not i.raised and i.covers_latest for i in caught.indexes
    )
    assert caught.version == lsm.dataset().version  # nothing to record
    assert sql_rows(ctx) == lsm.model
    _check_searches(ctx, lsm)

    lsm.dataset().cleanup_old_versions(older_than=ZERO)  # the replaced files go
    lsm.table.gc(grace=ZERO)
    assert sql_rows(ctx) == lsm.model
    lsm.generation(new=5, update=[1, 2], delete=[3])  # an unmerged generation on top
    assert sql_rows(ctx) == lsm.model
    assert sql_rows(lsm.context()) == lsm.model
    _check_searches(ctx, lsm)


# ------------------------------------------------------------------------------------------------
# Races


def _loop(uri: str, options: Any, job: str, stop: threading.Event, errors: list, done: list) -> None:
    table = mw.open_table(uri, storage_options=options)
    settings = CompactionSettings(
        target_rows_per_fragment=500, small_fragment_rows=60, min_small_fragments=2, max_deleted_share=0.2
    )
    while not stop.is_set():
        try:
            if job == "compact":
                if table.compact(settings).compacted:
                    done.append(job)
            else:
                getattr(table, job)()
        except CommitConflictError:
            pass  # a lost race: the next call retries
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append((job, e))
            return
        stop.wait(0.02)


def _jitter(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A random delay (0-20 ms, seeded) before every Lance commit, merge_insert and compaction."""
    rng, lock = random.Random(seed), threading.Lock()
    real_commit, real_execute = lance.LanceDataset.commit, MergeInsertBuilder.execute
    real_compact = DatasetOptimizer.compact_files

    def pause() -> None:
        with lock:
            delay = rng.random() * 0.02
        time.sleep(delay)

    def commit(*args: Any, **kwargs: Any) -> Any:
        pause()
        return real_commit(*args, **kwargs)

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        pause()
        return real_execute(self, *args, **kwargs)

    def compact_files(self: Any, *args: Any, **kwargs: Any) -> Any:
        pause()
        return real_compact(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(commit))
    monkeypatch.setattr(MergeInsertBuilder, "execute", execute)
    monkeypatch.setattr(DatasetOptimizer, "compact_files", compact_files)


@pytest.mark.parametrize("seed", [1, 2, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (3, 4, 5))])
def test_compaction_racing_merges_and_index_writers(tmp_path, monkeypatch, seed):
    """A writer, two mergers, the MemWAL index builder, index catch-up and compaction in threads;
    every retained base version: merge progress never lower, base = initial rows + each region's
    generations up to its progress."""
    table = create(str(tmp_path / "t"), None, regions=3)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    work, oracle = Workload(table, seed), VersionOracle(table)
    _jitter(monkeypatch, seed)
    stop = threading.Event()
    errors: list[tuple[str, BaseException]] = []
    done: list[str] = []
    jobs = ("merge", "merge", "build_index", "catch_up_indexes", "compact")
    threads = [threading.Thread(target=_loop, args=(table.uri, None, j, stop, errors, done)) for j in jobs]
    for t in threads:
        t.start()
    try:
        with table.writer() as w:
            for _ in range(8):
                work.generation(w)
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert done, "no compaction committed during the race"
    table.merge()
    table.compact(CompactionSettings(small_fragment_rows=60, min_small_fragments=2, max_deleted_share=0.2))
    assert oracle.check() > 10
    assert base_rows(table) == work.model
    assert rows_at(table) == work.model
    caught = table.catch_up_indexes()
    assert all(not i.unverified and i.covers_latest for i in caught.indexes)


def test_a_compaction_losing_its_commit_race_retries(tmp_path, monkeypatch, caplog):
    """A merge updating rows of the fragments being compacted commits while the compaction runs:
    Lance refuses the compaction's commit, `compact` plans again on the latest version and ends
    with the merged rows, and the compaction's retry keeps the merge progress."""
    lsm = Lsm(str(tmp_path / "t"), base=400, indexes=False)
    for _ in range(2):
        lsm.generation(new=40)
        lsm.table.merge()
    small = [k for k in lsm.model if k >= 400]
    oracle = VersionOracle(lsm.table)
    lsm.generation(update=small[:20], delete=small[20:25])  # rows of the small fragments
    real = DatasetOptimizer.compact_files
    calls: list[int] = []

    def compact_files(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            mw.open_table(lsm.uri).merge()  # commits after the compaction read its version
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DatasetOptimizer, "compact_files", compact_files)
    with caplog.at_level(logging.INFO, logger=compaction.__name__):
        result = lsm.table.compact(SMALL)
    assert len(calls) == 2 and "lost a commit race" in caplog.text
    assert result.compacted
    merged, _ = progress(lsm)
    assert sorted(merged.values()) == [3, 3]  # the racing merge's progress is kept
    assert lance_rows(lsm.dataset()) == lsm.model
    assert oracle.check() >= 4


def test_compaction_giving_up_raises_a_commit_conflict(tmp_path, monkeypatch):
    lsm = Lsm(str(tmp_path / "t"), base=400, indexes=False)
    for _ in range(2):
        lsm.generation(new=40)
    lsm.table.merge()

    def lose(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise lance.commit.CommitConflictError("lost")

    monkeypatch.setattr(DatasetOptimizer, "compact_files", lose)
    with pytest.raises(CommitConflictError):
        lsm.table.compact(CompactionSettings(small_fragment_rows=100, min_small_fragments=2))
    assert lance_rows(lsm.dataset()) == lsm.model


# ------------------------------------------------------------------------------------------------
# maintain


def test_maintain_keeps_the_base_a_bounded_number_of_fragments(tmp_path):
    """Rounds of writes and `maintain`: after each round nothing is due, so the base has fewer than
    `min_small_fragments` small fragments and, since no large fragment has `max_deleted_share` of
    its rows deleted, at most live rows / ((1 - max_deleted_share) * small_fragment_rows) large ones;
    the vector index has at most `max_segments` segments; one long-lived reader reads exactly the
    model every round. The same run without compaction (`compact=None`) ends with every merge's
    fragments."""
    upkeep = IndexUpkeepSettings(max_segments=2, retrain_share=100.0)
    settings = CompactionSettings(
        target_rows_per_fragment=400, small_fragment_rows=100, min_small_fragments=3, max_deleted_share=0.3
    )
    runs = {kind: Lsm(str(tmp_path / kind), base=300, partitions=2) for kind in ("compacted", "control")}
    readers = {kind: lsm.context() for kind, lsm in runs.items()}
    rng = random.Random(11)
    counts: dict[str, list[int]] = {kind: [] for kind in runs}
    for _ in range(6):
        for kind, lsm in runs.items():
            keys = sorted(lsm.model)
            lsm.generation(new=30, update=rng.sample(keys, 20), delete=rng.sample(keys, 5))
            (done,) = lsm.table.maintain(
                max_rounds=1,
                interval=0,
                grace=ZERO,
                version_retention=ZERO,
                compact=settings if kind == "compacted" else None,
                index_upkeep=upkeep,
            )
            assert not done.errors, done.errors
            assert sql_rows(readers[kind]) == lsm.model
            ds = lsm.dataset()
            counts[kind].append(len(ds.get_fragments()))
            assert len(segments(ds, "vec_idx")) <= upkeep.max_segments
            assert coverage(ds)["vec_idx"] == set(fragments(ds))
            if kind == "compacted":
                assert not debt(ds, settings).due
                small = [f for f, (n, _) in fragments(ds).items() if n < settings.small_fragment_rows]
                large_bound = len(lsm.model) / (
                    (1 - settings.max_deleted_share) * settings.small_fragment_rows
                )
                assert len(small) < settings.min_small_fragments
                assert counts[kind][-1] <= settings.min_small_fragments - 1 + int(large_bound)
    # the control keeps a fragment per region and merge: past the bound the compacted run keeps
    bound = (
        settings.min_small_fragments
        - 1
        + int(len(runs["control"].model) / ((1 - settings.max_deleted_share) * settings.small_fragment_rows))
    )
    assert counts["control"][-1] >= 11 > bound >= max(counts["compacted"]), counts


def test_lone_small_fragments_between_large_ones_are_not_due(tmp_path):
    """Lance compacts runs of adjacent candidates only: small fragments each between two large live
    ones are not a debt it can pay, and a second small one next to one is."""
    uri = str(tmp_path / "frags")
    sizes = [10, 300, 10, 300, 10]
    start = 0
    for i, n in enumerate(sizes):
        rows = pa.table({"id": pa.array(range(start, start + n), pa.int64())})
        lance.write_dataset(rows, uri, mode="create" if i == 0 else "append")
        start += n
    settings = CompactionSettings(
        small_fragment_rows=100, min_small_fragments=2, target_rows_per_fragment=1000
    )
    found = debt(lance.dataset(uri), settings)
    assert len(found.small) == 3 and not found.due
    lance.write_dataset(pa.table({"id": pa.array([start], pa.int64())}), uri, mode="append")
    found = debt(lance.dataset(uri), settings)
    assert len(found.small) == 4 and found.due
