"""Load: four regions written concurrently at full speed (one durable writer process per region),
while a process runs merge, index build and catch-up, version cleanup and GC round after round, and
this process reads the table through the SQL reader again and again.

At the end (writers closed, the job process killed): the stored rows, what a crash would leave, the
SQL reader and every retained base version equal the model built from the writers' acknowledgement
logs; merge progress never went back and did advance; after every job runs to completion the base
alone holds the model. During the run, every read showed, for every key, a row the key's writer
actually wrote, and never an older state of the key than an earlier read showed (no stale or
resurrected row). Peak memory (VmHWM) of every process is recorded; backpressure bounds the writers'.
"""

from __future__ import annotations

import bisect
import random
import signal
import time
from datetime import timedelta
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from support.cases import backend, cases
from support.children import op_rows, peak_rss_mb, read_log, spawn, wait_ready
from support.figures import case_name, record
from support.jobs import Workload, assert_monotonic, create, every_version_reads, finish, progress_history
from support.optional import not_none
from support.reference import stored_rows
from support.wal_oracle import apply_rows, durable_rows

import memwal_df as mw
from memwal_df.format import memwal_index

REGIONS = 4
KEYS = 2000
BASE = 200  # keys 0..199 start in the base with v = 0.0
RETAIN_S = 20  # base versions the job process keeps: longer than any read takes (a reader of a version
# cleaned up meanwhile fails in Lance itself)
GUARANTEE = "under load every read is fresh and memory is bounded"


def keys_by_region(table: mw.Table) -> dict[Any, list[int]]:
    keys = pa.table({"id": pa.array(range(KEYS), pa.int64())})
    regions = not_none(table.spec).evaluate(keys, table.schema.field_ids)[0].to_pylist()
    out: dict[Any, list[int]] = {}
    for k, r in zip(range(KEYS), regions, strict=True):
        out.setdefault(r, []).append(k)
    return out


def read_all(ctx: datafusion.SessionContext) -> dict[int, float]:
    t = ctx.sql("SELECT id, v FROM t").to_arrow_table()
    ids, values = t.column("id").to_pylist(), t.column("v").to_pylist()
    assert len(set(ids)) == len(ids), "a key read twice"
    return dict(zip(ids, values, strict=True))


def key_histories(logs: list[list[dict[str, Any]]]) -> dict[int, list[float | None]]:
    """Per key, its states in order: the initial one, then one per acknowledged op touching it
    (the value put, or None for a delete). Every key has one writer, so the order is total."""
    states: dict[int, list[float | None]] = {k: [0.0 if k < BASE else None] for k in range(KEYS)}
    for ops in logs:
        for op in ops:
            for row in op_rows(op):
                states[row["id"]].append(None if row["_tombstone"] else row["v"])
    return states


def check_fresh(reads: list[dict[int, float]], states: dict[int, list[float | None]]) -> int:
    """Each read maps every key to a state of its history at or after the state the previous read
    showed; returns the number of (read, key) pairs checked."""
    for key, history in states.items():
        where: dict[float | None, list[int]] = {}
        for i, value in enumerate(history):
            where.setdefault(value, []).append(i)
        at = 0
        for n, read in enumerate(reads):
            value = read.get(key)
            indexes = where.get(value, [])
            i = bisect.bisect_left(indexes, at)
            assert i < len(indexes), f"read {n}: key {key} = {value}, not a state at or after {history[at]}"
            at = indexes[i]
    return len(reads) * len(states)


@pytest.mark.parametrize("kind, seconds", cases([("local", 6)], [("local", 6), ("local", 180), ("s3", 60)]))
def test_four_regions_at_full_speed_with_jobs_and_readers(request, tmp_path, kind, seconds):
    uri, options = backend(request, kind, tmp_path)
    table = create(uri, options, regions=REGIONS, base=BASE)
    regions = keys_by_region(table)
    assert len(regions) == REGIONS
    logs = [tmp_path / f"acks-{i}.jsonl" for i in range(REGIONS)]
    writers = [
        spawn(
            "write",
            uri,
            options,
            tmp_path,
            seed=i + 1,
            log=str(log),
            key_list=keys,
            max_rows=40,
            seconds=seconds,
            settings={"max_memtable_rows": 2000, "max_unflushed_memtable_bytes": 8 << 20},
        )
        for i, (log, keys) in enumerate(zip(logs, regions.values(), strict=True))
    ]
    jobs = spawn("jobs", uri, options, tmp_path, retain_s=RETAIN_S)
    wait_ready(*writers, jobs)

    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri, storage_options=options))
    reads: list[dict[int, float]] = []
    peaks = {"writer": 0.0, "jobs": 0.0}
    while any(w.poll() is None for w in writers):
        reads.append(read_all(ctx))
        for name, procs in (("writer", writers), ("jobs", [jobs])):
            for p in procs:
                peaks[name] = max(peaks[name], peak_rss_mb(p.pid) or 0.0)
        time.sleep(random.uniform(0, 0.3))
    for w in writers:
        w.communicate(timeout=120)
        assert w.returncode == 0, "a writer failed"
    peaks["jobs"] = max(peaks["jobs"], peak_rss_mb(jobs.pid) or 0.0)
    jobs.send_signal(signal.SIGKILL)
    jobs.communicate(timeout=60)

    acked = []
    for log in logs:
        ops, in_flight = read_log(log)
        assert not in_flight
        acked.append(ops)
    model: dict[Any, dict[str, Any]] = {k: {"id": k, "v": 0.0} for k in range(BASE)}
    for ops in acked:
        for op in ops:
            apply_rows(model, op_rows(op))
    table = mw.open_table(uri, options)
    assert table.recover() == []
    assert stored_rows(table) == model
    expected = {k: r["v"] for k, r in model.items()}
    fresh = mw.register(datafusion.SessionContext())
    fresh.register_table("t", mw.MemWalTable(uri, storage_options=options))
    assert read_all(fresh) == expected, "a new reader is stale"
    reads.append(read_all(ctx))
    assert reads[-1] == expected, "the reader that read all along is stale"
    checked = check_fresh(reads, key_histories(acked))
    assert durable_rows(table) == model
    history = progress_history(table)
    assert_monotonic(history)
    merged_during_run = sum(memwal_index.merged_generations(table.details).values())
    assert merged_during_run > 0, "the job process merged nothing"
    half_cleaned = every_version_reads(table, model, interrupted_cleanup=True)  # the job process was killed
    work = Workload(table, seed=0, base=BASE)
    work.model = model
    finish(table, work)
    writes = sum(map(len, acked))
    record(
        GUARANTEE,
        case_name(request),
        seconds=seconds,
        writes_acknowledged=writes,
        rows_written=sum(len(op_rows(op)) for ops in acked for op in ops),
        reads=len(reads),
        key_reads_checked=checked,
        generations_merged=merged_during_run,
        half_cleaned_versions_skipped=half_cleaned,
        peak_rss_writer_mb=round(peaks["writer"]),
        peak_rss_jobs_mb=round(peaks["jobs"]),
    )


def test_a_long_lived_reader_is_not_stale_after_gc_trims_manifest_versions(tmp_path):
    """A reader that remembers each region's latest manifest finds the newest one even when the
    versions right after the remembered one are gone: GC deletes old manifest versions, so after more
    commits than a probe batch plus `keep_manifest_versions`, no version of the next probe batch
    exists, and the reader must not take that for "nothing newer"."""
    uri = str(tmp_path / "t")
    table = create(uri, None, regions=1, base=5)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    work = Workload(table, seed=1, base=5)
    with table.writer() as w:
        work.generation(w)
        assert read_all(ctx) == {k: r["v"] for k, r in work.model.items()}
        for _ in range(4):  # four more manifest versions
            work.generation(w)
    table.gc(grace=timedelta(0), keep_manifest_versions=2)  # the remembered one and the next two go
    assert read_all(ctx) == {k: r["v"] for k, r in work.model.items()}
