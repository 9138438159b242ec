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

import random
import signal
import time
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
    progress_history,
    rows_at,
)
from support.reference import stored_rows
from support.wal_oracle import durable_rows, freeze, reachable_states

import memwal_df as mw

GUARANTEE = "a crashed job or writer loses nothing acknowledged"


def run_to_crash(
    mode: str, uri: str, options: dict[str, str] | None, log_dir: Path, point: str, k: int
) -> None:
    proc = spawn(mode, uri, options, log_dir, crash=[point, k])
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
        regions = table.spec.evaluate(keys, table.schema.field_ids)[0].to_pylist()
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
