"""The merger (`Table.merge`, `memwal_df.jobs.merger`) against a dict model and the stored-rows oracle,
locally and on the moto S3 server; concurrent mergers as threads and processes; crashes between and
after a merger's commits (spec appendix 2)."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections import Counter

import lance
import pytest
from lance.mem_wal import CompactedSsTable
from support.jobs import (
    Workload,
    assert_monotonic,
    base_rows,
    create,
    flushed_generations,
    merged_generation,
    progress_history,
    rows_at,
)
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.errors import InvalidConfigError, MissingGenerationError
from memwal_df.jobs import merger


def _with_generations(uri: str, options: dict[str, str] | None, n: int, seed: int = 1) -> Workload:
    table = create(uri, options)
    work = Workload(table, seed)
    with table.writer() as w:
        for _ in range(n):
            work.generation(w)
    table.refresh()
    return work


def _unmerged(table: mw.Table) -> dict[uuid.UUID, list[int]]:
    return {
        r: [g for g, _ in flushed_generations(table, r) if g > merged_generation(table, r)]
        for r in table.region_ids()
    }


def test_merge_everything_matches_the_model(table_uri, table_storage_options):
    work = _with_generations(table_uri, table_storage_options, 3)
    table = work.table
    pending = _unmerged(table)
    assert sum(map(len, pending.values())) >= 8
    result = table.merge()
    assert result.generations == {r: tuple(g) for r, g in pending.items() if g}
    assert all(not r.skipped for r in result.regions)
    assert result.base_version == table.dataset.version
    assert base_rows(table) == work.model  # everything is in the base now
    assert stored_rows(table) == work.model
    assert not any(_unmerged(table).values())
    again = table.merge()
    assert again.generations == {} and again.base_version == result.base_version  # nothing committed
    assert_monotonic(progress_history(table))


def test_partial_merges_in_order_keep_reads_exact(tmp_path):
    work = _with_generations(str(tmp_path / "t"), None, 4, seed=7)
    table = work.table
    region = table.region_ids()[0]
    first = table.merge([region], max_generations=1)
    assert first.generations == {region: (1,)}
    assert merged_generation(table, region) == 1
    assert stored_rows(table) == work.model
    assert rows_at(table) == work.model
    second = table.merge([str(region)], max_generations=2)
    assert second.generations == {region: (2, 3)}
    assert stored_rows(table) == work.model
    rest = table.merge()
    assert region not in rest.generations or rest.generations[region] == (4,)
    assert base_rows(table) == work.model
    assert_monotonic(progress_history(table))


def test_bad_arguments_are_typed_errors(tmp_path):
    table = create(str(tmp_path / "t"), None)
    with pytest.raises(InvalidConfigError):
        table.merge(max_generations=0)
    with pytest.raises(InvalidConfigError):
        table.merge(["not-a-region"])


def test_missing_unmerged_generation_is_an_error(tmp_path):
    work = _with_generations(str(tmp_path / "t"), None, 1)
    table = work.table
    region = table.region_ids()[0]
    (_, path), *_ = flushed_generations(table, region)
    table.storage.delete_prefix(path)
    with pytest.raises(MissingGenerationError):
        table.merge([region])


def test_crash_after_the_delete_pass_then_a_new_merger(tmp_path):
    """A merger that committed the tombstone pass of a generation and died: the next one finishes it."""
    work = _with_generations(str(tmp_path / "t"), None, 2, seed=3)
    table = work.table
    region = next(r for r in table.region_ids() if _has_tombstones(table, r, 1))
    ds = lance.dataset(table.uri)
    first = merger._Merger(table, None)
    _, dead = first._read(dict(flushed_generations(table, region))[1], ds.schema)
    assert dead.num_rows and first._commit(ds.merge_insert("id").when_matched_delete(), dead)
    # pass 1 committed, pass 2 never ran
    assert merged_generation(table, region) == 0
    assert stored_rows(table) == work.model  # the unmerged generation still hides the deleted keys
    table.merge()
    assert base_rows(table) == work.model
    assert_monotonic(progress_history(table))


def _has_tombstones(table: mw.Table, region: uuid.UUID, gen: int) -> bool:
    path = dict(flushed_generations(table, region))[gen]
    return merger._Merger(table, None)._read(path, table.dataset.schema)[1].num_rows > 0


def test_crash_after_commit_is_not_merged_again(tmp_path):
    """Appendix 2: a merger committed generation 1 and died before reporting; a merger that planned
    from the old progress finds it merged (Lance's Stale marker error) and never re-applies it."""
    work = _with_generations(str(tmp_path / "t"), None, 2, seed=5)
    table = work.table
    region = table.region_ids()[0]
    path = dict(flushed_generations(table, region))[1]
    stale = merger._Merger(table, None)  # plans generation 1
    table.merge([region], max_generations=2)  # the other merger did 1 and 2 (then "crashed")
    version = lance.dataset(table.uri).version
    assert stale._generations(region, [(1, path)]) is None
    assert lance.dataset(table.uri).version == version  # nothing committed
    ds = lance.dataset(table.uri)  # and Lance itself refuses a stale marker
    with pytest.raises(OSError, match="Stale SSTable compaction"):
        ds.merge_insert("id").when_matched_update_all().mark_sstables_as_compacted(
            [CompactedSsTable(str(region), 2)]
        ).execute(ds.to_table().slice(0, 0))
    table.merge()
    assert base_rows(table) == work.model


@pytest.mark.slow_on_s3
def test_concurrent_mergers_threads(table_uri, table_storage_options):
    work = _with_generations(table_uri, table_storage_options, 4, seed=11)
    table = work.table
    pending = _unmerged(table)
    results, errors = [], []

    def run() -> None:
        try:
            results.append(mw.open_table(table.uri, table_storage_options).merge(parallel=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _check_each_merged_once([r.generations for r in results], pending)
    assert base_rows(table) == work.model
    assert_monotonic(progress_history(table))


def _merge_in_process(uri: str, queue: multiprocessing.Queue) -> None:
    result = mw.open_table(uri).merge()
    queue.put({str(r): list(g) for r, g in result.generations.items()})


def test_concurrent_mergers_processes(tmp_path):
    work = _with_generations(str(tmp_path / "t"), None, 4, seed=13)
    table = work.table
    pending = _unmerged(table)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_merge_in_process, args=(table.uri, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    outs = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    _check_each_merged_once([{uuid.UUID(r): tuple(g) for r, g in o.items()} for o in outs], pending)
    assert base_rows(table) == work.model
    assert_monotonic(progress_history(table))


def _check_each_merged_once(
    outcomes: list[dict[uuid.UUID, tuple[int, ...]]], pending: dict[uuid.UUID, list[int]]
) -> None:
    counts = Counter((r, g) for out in outcomes for r, gens in out.items() for g in gens)
    assert all(c == 1 for c in counts.values()), counts
    assert set(counts) == {(r, g) for r, gens in pending.items() for g in gens}


@pytest.mark.parametrize("per_commit", [1, 3, 8])
def test_generations_merged_together_match_one_at_a_time(tmp_path, per_commit):
    """Consecutive generations merged in one commit pair: the newest row of each key among them wins
    (a key deleted then re-put, or put then deleted, across generations), one marker per commit."""
    work = _with_generations(str(tmp_path / "t"), None, 7, seed=23)
    table = work.table
    pending = _unmerged(table)
    before = table.dataset.version
    result = table.merge(generations_per_commit=per_commit)
    assert result.generations == {r: tuple(g) for r, g in pending.items() if g}
    assert base_rows(table) == work.model
    assert stored_rows(table) == work.model
    assert_monotonic(progress_history(table))
    # at most two commits (tombstones, then rows + marker) per run of `per_commit` generations
    runs = sum(-(-len(g) // per_commit) for g in pending.values())
    assert table.dataset.version - before <= 2 * runs
    if per_commit == 8:
        assert table.dataset.version - before <= 2 * len([g for g in pending.values() if g])


def test_generations_merged_together_after_another_merger_did_the_first(tmp_path):
    """A merger that planned generations 1..4 together and finds 1..2 merged by another merges 3..4."""
    work = _with_generations(str(tmp_path / "t"), None, 4, seed=29)
    table = work.table
    region = max(table.region_ids(), key=lambda r: len(_unmerged(table)[r]))
    gens = flushed_generations(table, region)
    assert len(gens) >= 4
    late = merger._Merger(table, None, per_commit=8)
    table.merge([region], max_generations=2, generations_per_commit=1)
    done = late._generations(region, gens)
    assert done is not None and done.generations == tuple(g for g, _ in gens[2:])
    assert merged_generation(table, region) == gens[-1][0]
    table.merge()
    assert base_rows(table) == work.model
    assert_monotonic(progress_history(table))


def test_bad_generations_per_commit(tmp_path):
    table = create(str(tmp_path / "t"), None)
    with pytest.raises(InvalidConfigError):
        table.merge(generations_per_commit=0)
