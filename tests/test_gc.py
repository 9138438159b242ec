"""Garbage collection (`Table.gc`, `memwal_df.jobs.garbage`): what it removes and that every retained base
version (time travel) still reads exactly the model afterwards, locally and on the moto S3 server;
a hypothesis interleaving of writes, flushes, merges, GC, version cleanup and writer reclaims, and
writer/merger/GC threads running at once."""

from __future__ import annotations

import shutil
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import lance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.jobs import (
    Workload,
    assert_monotonic,
    cleanup,
    create,
    every_version_reads,
    flushed_generations,
    progress_history,
    rows_at,
)
from support.optional import not_none

from memwal_df.errors import InvalidConfigError
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore

ZERO = timedelta(0)


def _gen_dirs(table) -> list[str]:
    return [
        n
        for r in table.region_ids()
        for n in table.storage.list_dir(layout.region_dir(r))
        if layout.parse_generation_dir_name(n)
    ]


def _wal_entries(table) -> int:
    return sum(
        len(table.storage.list(f"{layout.region_dir(r)}/{layout.WAL_DIR}")) for r in table.region_ids()
    )


@pytest.mark.slow_on_s3
def test_gc_keeps_what_time_travel_reaches_then_removes_it(table_uri, table_storage_options):
    table = create(table_uri, table_storage_options)
    work = Workload(table, seed=2)
    with table.writer() as w:
        for _ in range(3):
            work.generation(w)
    table.merge()
    dirs, wal = len(_gen_dirs(table)), _wal_entries(table)
    kept = table.gc(grace=ZERO)
    assert kept.generations == {} and not any(r.wal_positions for r in kept.regions)
    assert len(_gen_dirs(table)) == dirs and _wal_entries(table) == wal
    every_version_reads(table, work.model)  # old base versions still need every generation

    cleanup(table)
    assert table.gc(grace=timedelta(hours=1)).generations == {}  # versions were cleaned just now
    result = table.gc(grace=ZERO)
    assert sum(map(len, result.generations.values())) == dirs
    assert _gen_dirs(table) == [] and _wal_entries(table) == 0
    for r in table.region_ids():
        assert flushed_generations(table, r) == []
    every_version_reads(table, work.model)

    with table.writer() as w:  # writers and mergers carry on after GC
        work.generation(w)
    assert rows_at(table) == work.model
    table.merge()
    every_version_reads(table, work.model)


def test_gc_waits_for_index_catch_up(tmp_path):
    table = create(str(tmp_path / "t"), None)
    work = Workload(table, seed=4)
    with table.writer() as w:
        for _ in range(2):
            work.generation(w)
    table.merge(max_generations=1)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")  # Lance records catch-up = merged
    table.merge()
    cleanup(table)
    result = table.gc(grace=ZERO)
    assert result.generations and all(g == (1,) for g in result.generations.values())
    assert all(r.removable_through <= 1 for r in result.regions)
    every_version_reads(table, work.model)


def test_gc_removes_orphans_of_failed_flushes_only(tmp_path):
    table = create(str(tmp_path / "t"), None)
    work = Workload(table, seed=6)
    with table.writer() as w:
        work.generation(w)
    region = next(r for r in table.region_ids() if flushed_generations(table, r))
    (gen, path), *_ = flushed_generations(table, region)
    current = not_none(RegionManifestStore(table.storage, region).latest()).current_generation
    root = Path(table.uri)
    orphan = layout.generation_path(region, layout.generation_dir_name("deadbeef", gen))
    in_flight = layout.generation_path(region, layout.generation_dir_name("feedbeef", current))
    shutil.copytree(root / path, root / orphan)  # a flush of `gen` whose manifest commit failed
    shutil.copytree(root / path, root / in_flight)  # a flush of `current` still writing
    result = table.gc(grace=ZERO)
    assert [o for r in result.regions for o in r.orphans] == [orphan]
    assert not (root / orphan).exists() and (root / in_flight).exists() and (root / path).exists()
    assert rows_at(table) == work.model


def test_gc_trims_region_manifest_versions(tmp_path):
    table = create(str(tmp_path / "t"), None)
    work = Workload(table, seed=8)
    with table.writer() as w:
        for _ in range(4):
            work.generation(w)
    with pytest.raises(InvalidConfigError):
        table.gc(keep_manifest_versions=1)
    with pytest.raises(InvalidConfigError):
        table.gc(grace=timedelta(seconds=-1))
    table.gc(grace=ZERO, keep_manifest_versions=2)
    for r in table.region_ids():
        assert len(RegionManifestStore(table.storage, r).list_versions()) <= 2
    with table.writer() as w:  # reclaim (epoch + 1) on top of trimmed histories
        work.generation(w)
    assert rows_at(table) == work.model


OPS = st.lists(
    st.sampled_from(["gen", "merge", "merge1", "gc", "cleanup", "reclaim"]), min_size=3, max_size=12
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_interleaving_keeps_every_invariant(ops, seed):
    with tempfile.TemporaryDirectory() as d:
        table = create(f"{d}/t", None, regions=2)
        work = Workload(table, seed)
        writer = table.writer()
        try:
            for op in ops:
                if op == "gen":
                    work.generation(writer)
                elif op == "merge":
                    table.merge()
                elif op == "merge1":
                    table.merge(max_generations=1)
                elif op == "gc":
                    table.gc(grace=ZERO, keep_manifest_versions=2)
                elif op == "cleanup":
                    cleanup(table)
                else:
                    writer.close()
                    writer = table.writer()
                every_version_reads(table, work.model)  # no row lost, none resurrected, nothing needed gone
                assert_monotonic(progress_history(table))
        finally:
            writer.close()


@pytest.mark.slow_on_s3
def test_writer_merger_and_gc_threads_at_once(table_uri, table_storage_options):
    table = create(table_uri, table_storage_options, regions=2)
    work = Workload(table, seed=9)
    done = threading.Event()
    errors: list[BaseException] = []

    def loop(job) -> None:
        try:
            while not done.is_set():
                job()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def collect() -> None:
        cleanup(table)
        table.gc(grace=ZERO, keep_manifest_versions=2)

    jobs = [threading.Thread(target=loop, args=(j,)) for j in (table.merge, collect)]
    for t in jobs:
        t.start()
    try:
        with table.writer() as w:
            for _ in range(6):
                work.generation(w)
    finally:
        done.set()
        for t in jobs:
            t.join()
    assert not errors, errors
    table.merge()
    assert rows_at(table) == work.model
    every_version_reads(table, work.model)
    assert_monotonic(progress_history(table))
