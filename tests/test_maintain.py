"""The background-job loop (`Table.maintain`, `python -m memwal_df maintain`) and the jobs racing
each other as real processes: spec appendix 2 (concurrent mergers, a merger killed after its
commit), GC in its own process racing a writer, mergers and a reader, time travel after GC, and a
hypothesis interleaving of writers, mergers, both index builders and GC with the invariants checked
after every step (no row lost, no stale row resurrected, merge progress monotonic, catch-up covered,
nothing a reader needs deleted)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import lance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.jobs import (
    Workload,
    assert_catchup_covered,
    assert_monotonic,
    catchup_at,
    cleanup,
    create,
    every_version_reads,
    flushed_generations,
    progress_history,
    rows_at,
)

import memwal_df as mw
from memwal_df.errors import CommitConflictError, InvalidConfigError
from memwal_df.format import base_manifest, layout, memwal_index
from memwal_df.jobs.maintain import run_round

ZERO = timedelta(0)
ROOT = Path(__file__).resolve().parents[1]


def _merged(table) -> dict:
    table.refresh()
    return memwal_index.merged_generations(table.details)


def test_rounds_merge_build_catch_up_and_collect(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=2)
    lance.dataset(table.uri).create_scalar_index("id", "BTREE")
    work = Workload(table, seed=31)
    with table.writer() as w:
        for _ in range(3):
            work.generation(w)
    rounds = table.maintain(interval=0, max_rounds=2, grace=ZERO)
    assert [r.number for r in rounds] == [1, 2] and all(not r.errors for r in rounds)
    first = rounds[0].results
    assert set(first) == {
        "recover",
        "merge",
        "build_index",
        "catch_up_indexes",
        "compact",
        "cleanup_versions",
        "gc",
    }
    assert first["cleanup_versions"].old_versions == 0  # the default retention is a day
    assert first["merge"].generations and first["build_index"].regions == 2
    merged = _merged(table)
    assert merged == {r: flushed_generations(table, r)[-1][0] for r in table.region_ids()}
    assert catchup_at(table, table.dataset.version)["id_idx"] == merged
    assert rounds[1].results["merge"].generations == {}  # nothing left to merge
    cleanup(table)
    table.maintain(interval=0, max_rounds=1, grace=ZERO)  # GC now removes every merged generation
    assert all(flushed_generations(table, r) == [] for r in table.region_ids())
    assert rows_at(table) == work.model
    every_version_reads(table, work.model)
    assert_catchup_covered(table)


def test_a_failing_job_is_logged_and_the_others_still_run(caplog):
    calls: list[str] = []

    def flaky() -> str:
        calls.append("flaky")
        if len(calls) == 1:
            raise CommitConflictError("lost a race")
        return "ok"

    def broken() -> None:
        raise ValueError("boom")

    jobs = {"flaky": flaky, "broken": broken, "last": lambda: calls.append("last")}
    with caplog.at_level(logging.INFO, logger="memwal_df.jobs.maintain"):
        first, second = run_round(1, jobs), run_round(2, jobs)
    assert isinstance(first.errors["flaky"], CommitConflictError) and "flaky" not in first.results
    assert second.results["flaky"] == "ok" and "flaky" not in second.errors
    assert all(isinstance(r.errors["broken"], ValueError) for r in (first, second))
    assert calls == ["flaky", "last", "flaky", "last"]  # a failure never stops the round
    levels = {(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records}
    assert ("WARNING", "round 1") in levels and ("ERROR", "round 1") in levels
    assert any(r.exc_info for r in caplog.records if r.levelname == "ERROR")  # with traceback


def test_maintain_stops_when_asked_and_checks_arguments(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=1)
    for bad in (
        {"interval": -1},
        {"max_rounds": 0},
        {"version_retention": timedelta(seconds=-1)},
        {"keep_versions": 0},
    ):
        with pytest.raises(InvalidConfigError):
            table.maintain(**bad)
    stop = threading.Event()
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(table.maintain(interval=0.01, stop=stop)))
    runner.start()
    while not out and runner.is_alive() and not stop.is_set():
        time.sleep(0.05)
        stop.set()
    runner.join(timeout=120)
    assert not runner.is_alive() and len(out) >= 1


def test_command_line_entry_point(tmp_path):
    table = create(str(tmp_path / "t"), None, regions=2)
    work = Workload(table, seed=32)
    with table.writer() as w:
        work.generation(w)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "memwal_df", "maintain", table.uri, "--interval", "0", "--rounds", "1"]
    retention = ["--version-retention", "0", "--keep-versions", "2"]
    done = subprocess.run(cmd + retention, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "round 1: merge done" in done.stderr and "round 1: gc done" in done.stderr
    assert "round 1: cleanup_versions done" in done.stderr
    assert len(lance.dataset(table.uri).versions()) == 2
    assert all(g for g in _merged(table).values()) and rows_at(table) == work.model
    bad = subprocess.run([*cmd[:3], "nope"], capture_output=True, env=env, timeout=60, check=False)
    assert bad.returncode == 2


def _footprint(table: mw.Table) -> tuple[int, int]:
    """(generation directories, WAL entry files) over every region, as listed on storage."""
    gens = wal = 0
    for region_id in table.region_ids():
        names = table.storage.list_dir(layout.region_dir(region_id))
        gens += sum(1 for n in names if layout.parse_generation_dir_name(n))
        if layout.WAL_DIR in names:
            wal += len(table.storage.list_dir(f"{layout.region_dir(region_id)}/{layout.WAL_DIR}"))
    return gens, wal


def test_version_retention_keeps_a_long_run_bounded(tmp_path):
    """Round after round of writes: with a retention the loop removes base versions, so GC frees the
    merged generations and their WAL files (the footprint stays bounded); without one it never does.
    Readers of the latest version and time travel to every retained version stay exact."""
    tables = {keep: create(str(tmp_path / str(keep)), None, regions=2) for keep in (4, None)}
    works = {keep: Workload(t, seed=43) for keep, t in tables.items()}
    footprints: dict = {keep: [] for keep in tables}
    for _ in range(12):
        for keep, table in tables.items():
            with table.writer() as w:
                works[keep].generation(w)
            retention = None if keep is None else ZERO
            (done,) = table.maintain(
                interval=0, max_rounds=1, grace=ZERO, version_retention=retention, keep_versions=keep
            )
            assert not done.errors, done.errors
            footprints[keep].append(_footprint(table))
            assert rows_at(table) == works[keep].model
        kept = tables[4]
        assert len(kept.dataset.versions()) == 4
        every_version_reads(kept, works[4].model)
    bounded, unbounded = footprints[4], footprints[None]
    assert unbounded[-1][0] >= 20 and unbounded[-1][1] >= 40  # every generation and WAL entry stays
    # at most the newest generation of each region (what the oldest retained version still reads)
    # and its WAL entries (a put and a delete each) remain
    assert all(g <= 2 and w <= 4 for g, w in bounded)
    assert unbounded[-1][0] == sum(
        len(flushed_generations(tables[None], r)) for r in tables[None].region_ids()
    )
    assert_monotonic(progress_history(tables[4]))


# ------------------------------------------------------------------------------------------------
# Processes


def _maintain_process(uri: str, options: dict | None, seconds: float) -> None:
    table = mw.open_table(uri, options)
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    table.maintain(interval=0.2, stop=stop, grace=ZERO)


def _collect_process(uri: str, options: dict | None, seconds: float, out) -> None:
    """Base versions older than a second cleaned up (the time-travel policy), then GC with no grace;
    puts the number of generations it removed on `out`."""
    table = mw.open_table(uri, options)
    end, removed = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            lance.dataset(uri, storage_options=options).cleanup_old_versions(older_than=timedelta(seconds=1))
        except (ValueError, OSError):
            pass  # Lance lost a race with a concurrent cleanup; next loop
        result = table.gc(grace=ZERO, keep_manifest_versions=2)
        removed += sum(map(len, result.generations.values()))
    out.put(removed)


def _read_latest(table) -> dict:
    """What a reader of the latest version sees. A reader that finds a generation gone retakes its
    snapshot when the base moved meanwhile (GC only removes what the retained versions no longer
    read); a generation gone while its version is still the latest is a failure."""
    while True:
        version = base_manifest.latest_version(table.storage)
        try:
            return rows_at(table, version)
        except (OSError, ValueError):
            if base_manifest.latest_version(table.storage) == version:
                raise


def _merge_one_then_die(uri: str, options: dict | None) -> None:
    mw.open_table(uri, options).merge(max_generations=1)
    os._exit(9)  # appendix 2, scenario 2: crash right after the table commit


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_appendix_2_and_gc_as_processes_racing_a_writer_and_a_reader(backend, tmp_path, request):
    """Merger A commits one generation per region and dies; two maintain loops (merge, build,
    catch-up, GC) and a GC process with version cleanup race the writer; the reader (this process)
    checks the latest state after every generation (`_read_latest`)."""
    if backend == "s3":
        uri, options = (
            f"s3://{request.getfixturevalue('s3_bucket')}/t",
            request.getfixturevalue("s3_storage_options"),
        )
    else:
        uri, options = str(tmp_path / "t"), None
    table = create(uri, options, regions=2)
    lance.dataset(table.uri, storage_options=options).create_scalar_index("id", "BTREE")
    work = Workload(table, seed=33)
    with table.writer() as w:
        work.generation(w)
        work.generation(w)
    ctx = multiprocessing.get_context("spawn")
    crash = ctx.Process(target=_merge_one_then_die, args=(table.uri, options))
    crash.start()
    crash.join(timeout=300)
    assert crash.exitcode == 9
    assert all(g == 1 for g in _merged(table).values())  # committed before the crash
    seconds = 20.0
    procs = [ctx.Process(target=_maintain_process, args=(table.uri, options, seconds)) for _ in range(2)]
    removed = ctx.Queue()
    procs.append(ctx.Process(target=_collect_process, args=(table.uri, options, seconds, removed)))
    for p in procs:
        p.start()
    seen: list[dict] = []
    try:
        with table.writer() as w:
            while any(p.is_alive() for p in procs) and len(seen) < 12:
                work.generation(w)
                assert _read_latest(table) == work.model  # nothing lost, resurrected or needed gone
                seen.append(_merged(table))
                time.sleep(0.5)  # let the jobs interleave with the writes
    finally:
        for p in procs:
            p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs)
    assert any(g > 1 for progress in seen for g in progress.values())  # merges ran between the writes
    assert removed.get(timeout=10) > 0  # and GC removed generations meanwhile
    table.maintain(interval=0, max_rounds=1, grace=ZERO)
    assert rows_at(table) == work.model
    every_version_reads(table, work.model)  # time travel to every retained version after GC
    assert_monotonic(progress_history(table))
    assert_catchup_covered(table)
    merged = _merged(table)
    assert catchup_at(table, table.dataset.version)["id_idx"] == merged
    cleanup(table)
    table.gc(grace=ZERO)
    assert all(flushed_generations(table, r) == [] for r in table.region_ids())
    assert rows_at(table) == work.model


# ------------------------------------------------------------------------------------------------
# Randomized interleavings

OPS = st.lists(
    st.sampled_from(["gen", "merge1", "index", "build", "catchup", "gc", "cleanup", "round", "reclaim"]),
    min_size=3,
    max_size=12,
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_interleavings_of_every_job_keep_every_invariant(ops, seed):
    with tempfile.TemporaryDirectory() as d:
        table = create(f"{d}/t", None, regions=2)
        work = Workload(table, seed)
        writer = table.writer()
        try:
            for op in ops:
                if op == "gen":
                    work.generation(writer)
                elif op == "merge1":
                    table.merge(max_generations=1)
                elif op == "index":
                    lance.dataset(table.uri).create_scalar_index("id", "BTREE", replace=True)
                elif op == "build":
                    table.build_index()
                elif op == "catchup":
                    table.catch_up_indexes()
                elif op == "gc":
                    table.gc(grace=ZERO, keep_manifest_versions=2)
                elif op == "cleanup":
                    cleanup(table)
                elif op == "round":
                    assert not table.maintain(interval=0, max_rounds=1, grace=ZERO)[0].errors
                else:
                    writer.close()
                    writer = table.writer()
                every_version_reads(table, work.model)
                assert_monotonic(progress_history(table))
                assert_catchup_covered(table)
        finally:
            writer.close()
