"""Crash tests of the background jobs with real processes (`tests/support/job_child.py`).

* A merger, a garbage collector or an index builder dies (`os._exit(9)`) at a chosen point of its own
  code: between the merger's tombstone pass and its upsert pass, right before or after the upsert
  commit; GC after dropping generations from a manifest, in the middle of deleting a generation
  directory (file by file), between two WAL entry deletions; the index builder after advancing a
  region's WAL hint, before or after its commit.
* A durable writer and the job loop (merge, index build and catch-up, version cleanup, GC) are
  SIGKILLed at random moments, round after round, on the same table; the writer logs each write before
  and after the call (fsynced), so the parent knows what was acknowledged.

After every crash a new writer claims and replays (`table.recover()`) and the table is checked: the
stored rows (base, generations, WAL) are exactly a state the acknowledged writes lead to (the write
in flight whole or absent, per region); what a reader of the latest base version sees, what a crash
now would leave, and every retained base version (time travel) agree with it; merge progress never
went back. Then every job runs to completion and the base alone must hold the model.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from support.cases import backend, cases
from support.children import op_rows, read_log, spawn, stderr_tail, wait_ready
from support.figures import case_name, record
from support.jobs import (
    Workload,
    assert_catchup_covered,
    assert_monotonic,
    cleanup,
    create,
    every_version_reads,
    finish,
    merged_generation,
    progress_history,
    rows_at,
)
from support.optional import not_none
from support.reference import stored_rows
from support.wal_oracle import durable_rows, freeze, reachable_states

import memwal_df as mw
from memwal_df.jobs.compaction import CompactionSettings, debt

GUARANTEE = "a crashed job or writer loses nothing acknowledged"


def run_to_crash(
    mode: str, uri: str, options: dict[str, str] | None, log_dir: Path, point: str, k: int, **args: Any
) -> None:
    proc = spawn(mode, uri, options, log_dir, crash=[point, k], **args)
    proc.communicate(timeout=600)
    assert proc.returncode == 9, f"{mode} never reached {point} #{k} (exit {proc.returncode})"


def check_after_crash(
    table: mw.Table, model: dict[Any, dict[str, Any]], interrupted_cleanup: bool = False
) -> int:
    """The invariants every crash must keep (see the module docstring); returns the base versions
    skipped because a killed version cleanup had removed their files (see `every_version_reads`)."""
    assert stored_rows(table) == model
    assert durable_rows(table) == model
    assert rows_at(table) == model
    assert_monotonic(progress_history(table))
    return every_version_reads(table, model, interrupted_cleanup)


POINTS = {  # crash point -> (job, the hits k at which it is tried: a build commits once per run)
    "merge_after_delete": ("merge", (1, 2)),
    "merge_before_upsert": ("merge", (1, 2)),
    "merge_after_upsert": ("merge", (1, 2)),
    "gc_after_unlist": ("gc", (1, 2)),
    "gc_mid_delete": ("gc", (1, 2)),
    "gc_mid_wal": ("gc", (1, 2)),
    "build_after_last_seen": ("build", (1, 2)),
    "build_before_commit": ("build", (1,)),
    "build_after_commit": ("build", (1,)),
}


@pytest.mark.parametrize(
    "kind, point, k",
    cases(
        [
            ("local", "merge_after_delete", 1),
            ("local", "gc_mid_delete", 2),
            ("local", "build_before_commit", 1),
        ],
        [(kind, p, k) for kind in ("local", "s3") for p, (_, ks) in POINTS.items() for k in ks],
    ),
)
def test_job_killed_at_a_point(request, tmp_path, kind, point, k):
    uri, options = backend(request, kind, tmp_path)
    job = POINTS[point][0]
    table = create(uri, options, regions=2)
    lance.dataset(table.uri, storage_options=options).create_scalar_index("id", "BTREE")
    work = Workload(table, seed=hash((point, k)) & 0xFFFF)
    writer = table.writer()
    for _ in range(3):
        work.generation(writer)
    if job == "gc":  # merged, indexed, and no older base version reads the generations any more
        table.merge()
        table.catch_up_indexes()
        cleanup(table)
    if job == "build":  # durable writes past every region's wal_entry_position_last_seen
        work.write(writer)
    else:
        writer.close()

    run_to_crash(job, uri, options, tmp_path, point, k)

    if job == "build":  # the writer lost a manifest race to the dead builder, or not: it goes on
        work.generation(writer)
        writer.close()
        assert_catchup_covered(table)
    assert table.recover() == []
    assert check_after_crash(table, work.model) == 0
    checked = len(work.model)
    finish(table, work)
    record(GUARANTEE, case_name(request), crash_points=1, rows_checked=checked + len(work.model))


# ---------------------------------------------------------------------------------------------------
# A writer and the job loop killed at random moments
# ---------------------------------------------------------------------------------------------------


def region_history(table: mw.Table, acked: list[dict[str, Any]], in_flight: list[dict[str, Any]]) -> list:
    """The writes as `reachable_states` takes them: an op in flight is split per region (a routed
    write lands region by region)."""

    history = [(op_rows(op), True) for op in acked]
    for op in in_flight:
        keys = pa.table({"id": pa.array([r["id"] for r in op_rows(op)], pa.int64())})
        regions = not_none(table.spec).evaluate(keys, table.schema.field_ids)[0].to_pylist()
        for region in sorted(set(regions)):
            history.append(([r for r, g in zip(op_rows(op), regions, strict=True) if g == region], False))
    return history


@pytest.mark.parametrize(
    "kind, seed",
    cases([("local", 1)], [("local", s) for s in range(1, 31)] + [("s3", s) for s in range(1, 6)]),
)
def test_writer_and_jobs_killed_at_random_moments(request, tmp_path, kind, seed):
    rng = random.Random(seed)
    uri, options = backend(request, kind, tmp_path)
    table = create(uri, options, regions=2)
    model = {i: {"id": i, "v": 0.0} for i in range(200)}
    rounds = 2
    writes = checked = half_cleaned = 0
    for r in range(rounds):
        log = tmp_path / f"acks-{r}.jsonl"
        log.touch()
        writer = spawn(
            "write",
            uri,
            options,
            tmp_path,
            seed=seed * 100 + r,
            log=str(log),
            keys=300,
            settings={"max_memtable_rows": 24},
        )
        jobs = spawn("jobs", uri, options, tmp_path)
        wait_ready(writer, jobs)
        first, second = rng.sample([writer, jobs], 2)
        time.sleep(rng.uniform(0.2, 3.0))
        first.send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0, 1.0))
        second.send_signal(signal.SIGKILL)
        for p in (writer, jobs):
            p.communicate(timeout=60)
            assert isinstance(p.args, list)
            assert p.returncode == -signal.SIGKILL, (
                f"the {p.args[3]} child ended before it was killed:\n{stderr_tail(p)}"
            )

        acked, in_flight = read_log(log)
        table = mw.open_table(uri, options)
        table.recover()  # new writers claim and replay every region with WAL data
        got = stored_rows(table)
        assert freeze(got) in reachable_states(model, region_history(table, acked, in_flight)), (
            f"seed {seed} round {r}: acknowledged writes lost or a write kept in part"
        )
        half_cleaned += check_after_crash(table, got, interrupted_cleanup=True)
        checked += len(got)
        model = got
        writes += len(acked)
    work = Workload(table, seed)
    work.model = model
    finish(table, work)
    record(
        GUARANTEE,
        case_name(request),
        crash_points=2 * rounds,
        writes_acknowledged=writes,
        rows_checked=checked,
        half_cleaned_versions_skipped=half_cleaned,
    )


# ---------------------------------------------------------------------------------------------------
# A base compaction killed mid-way
# ---------------------------------------------------------------------------------------------------

# Every fragment of the test table is small (below 16 rows, which also splits the rewrite into several
# fragments: more data files, a longer rewrite) and one deleted row makes a fragment due.
COMPACTION: dict[str, Any] = {
    "target_rows_per_fragment": 16,
    "small_fragment_rows": 16,
    "min_small_fragments": 2,
    "max_deleted_share": 0.01,
}


def many_small_fragments(uri: str, seed: int, generations: int, unmerged: int) -> tuple[mw.Table, Workload]:
    """A table with a BTREE index whose base is many small fragments with deletions (one per region
    and merged generation), the index caught up, and `unmerged` more generations flushed, unmerged."""
    table = create(uri, None, regions=2)
    lance.dataset(uri).create_scalar_index("id", "BTREE")
    work = Workload(table, seed)
    with table.writer() as writer:
        for g in range(generations):
            work.generation(writer)
            if g == generations - unmerged - 1:
                table.merge()
                table.catch_up_indexes()
    return table, work


def kill_inside_rewrite(proc: subprocess.Popen, data_dir: Path) -> bool:
    """SIGKILL `proc` once a data file appears in `data_dir` after it announced its compaction (the
    rewrite is being written, not committed); True if it was killed there, False if it had ended."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and line != "compacting\n":
        line = proc.stdout.readline()
    if not line:
        return False
    before = set(os.listdir(data_dir))
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if set(os.listdir(data_dir)) - before:
            proc.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.0005)
    return False


COMPACT_KILLS = ["compact_before_rewrite", "inside_rewrite", "compact_after_commit", "timed"]


@pytest.mark.parametrize(
    "job, kill",
    cases(
        [("compact", "inside_rewrite"), ("maintain", "compact_after_commit")],
        [(job, kill) for job in ("compact", "maintain") for kill in COMPACT_KILLS],
    ),
)
def test_compaction_killed_mid_way(request, tmp_path, job, kill):
    """`table.compact` (or a maintain round, in its compaction step) killed before Lance's rewrite,
    inside it (its first data file written), after its commit (before the index catch-up is restored)
    or at a random moment: the table reads exactly the model at every retained version, merge progress
    did not go back, and compaction and maintain rounds run again to a compacted base holding the
    model."""
    uri = str(tmp_path / "t")
    seed = hash((job, kill)) & 0xFFFF
    table, work = many_small_fragments(uri, seed, generations=10, unmerged=2 if job == "maintain" else 0)
    progress = {r: merged_generation(table, r) for r in table.region_ids()}
    version = lance.dataset(uri).version
    args: dict[str, Any] = {"compaction": COMPACTION}
    if kill in ("compact_before_rewrite", "compact_after_commit"):
        run_to_crash(job, uri, None, tmp_path, kill, 1, **args)
    else:
        proc = spawn(job, uri, None, tmp_path, announce=True, **args)
        wait_ready(proc)
        if kill == "inside_rewrite":
            assert kill_inside_rewrite(proc, Path(uri) / "data"), "the compaction ended before a data file"
        else:
            time.sleep(random.Random(seed).uniform(0, 1.5))
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    if job == "compact" and kill in ("compact_before_rewrite", "inside_rewrite"):
        assert lance.dataset(uri).version == version, "the kill came after the compaction's commit"
    table = mw.open_table(uri)
    assert table.recover() == []
    assert check_after_crash(table, work.model) == 0
    assert all(merged_generation(table, r) >= g for r, g in progress.items())
    assert_catchup_covered(table)
    settings = CompactionSettings(**COMPACTION)
    table.compact(settings)
    assert stored_rows(table) == work.model
    for _ in range(2):
        with table.writer() as w:
            work.generation(w)
        (done,) = table.maintain(
            interval=0, max_rounds=1, grace=timedelta(0), version_retention=timedelta(0), compact=settings
        )
        assert not done.errors, done.errors
        assert check_after_crash(table, work.model) == 0
    table.compact(settings)
    assert not debt(lance.dataset(uri), settings).mostly_deleted
    finish(table, work)
    record(GUARANTEE, case_name(request), crash_points=1, rows_checked=2 * len(work.model))
