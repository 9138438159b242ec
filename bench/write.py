"""Write-path benchmark: memwal_df against Lance 14's native MemWAL writer, same data, same disk, one run.

Measures (the write figures of docs/performance.md):

* upsert throughput (rows/s) of `--rows` upserts (half updates of base keys, half new keys) in `--batch`
  row batches, durable and non-durable, through 4 bucket regions and through 1 region, for memwal_df
  (`table.writer()`) and for Lance native (`ds.mem_wal_writer`). Native does not route: each batch is
  bucketed with `lance.mem_wal.evaluate_sharding_spec` and every part is put to that bucket's native
  writer, the same work memwal_df's TableWriter does. Every run ends with `close()`, so its time
  includes making everything durable and flushing every MemTable into generations;
* partial-upsert throughput (2 of 6 columns carried, keys spread over MemTables, generations and a
  btree-indexed base) next to full upserts of the same keys (`bench/_partial.py`);
* single-row durable put latency (p50/p99) for both, each interleaved with the raw I/O floor on the same
  disk (create + write + fsync of a file the size of a one-row WAL entry, with and without the directory
  fsync), and for non-durable writers the time from a put until its WAL entry is on disk;

Lance native is measured twice in durable mode: with its defaults (a durable put waits for the next
timed WAL flush, `max_wal_flush_interval_ms=100`) and tuned (`max_wal_flush_interval_ms=1`). On a local
disk Lance publishes WAL entries without any fsync; memwal_df fdatasyncs every entry and fsyncs its
directory. Both engines use the same `max_memtable_rows` (`--memtable-rows`, default rows/10) so that a
run produces ~12 generations. Every timed run starts after `os.sync()`; tables are removed only at the
end. Timings on a shared VM vary by +-20% from run to run: use `--repeat 3` (median shown) to compare.
No timing is asserted: the script reports.

    python bench/write.py --small                 # quick run
    python bench/write.py --small --partial-only  # partial vs full upserts only
    python bench/write.py                          # full run: base 100k, 200k upserts
    python bench/write.py --repeat 3 --json bench/results/write.json
    python bench/write.py --profile bench/results/write.prof [--profile-clock cpu]
        # cProfile (all threads) of memwal_df durable, 4 regions only
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import glob
import os
import platform
import pstats
import shutil
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
from _cli import write_json
from _partial import PartialRun, base_take, run_partial
from _partial import markdown as partial_markdown
from _workload import NUM_REGIONS, Workload, git_state, make_workload, scratch_root
from lance.mem_wal import evaluate_sharding_spec

import memwal_df as mw
from memwal_df.format import layout

# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


class Scratch:
    """Fresh table directories under one root on the benchmark disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def new(self, name: str) -> str:
        self.n += 1
        path = self.root / f"{self.n:02d}-{name}"
        return str(path)


def ours_table(uri: str, base: pa.Table, regions: int) -> mw.Table:
    spec = mw.bucket("id", regions) if regions > 1 else mw.unsharded()
    return mw.create_table(uri, base, primary_key="id", region_spec=spec)


def native_table(uri: str, base: pa.Table, regions: int) -> lance.LanceDataset:
    ds = lance.write_dataset(base, uri)
    if regions > 1:
        ds.initialize_mem_wal(bucket_column="id", num_buckets=regions)
    else:
        ds.initialize_mem_wal(unsharded=True)
    return lance.dataset(uri)


def mem_wal_files(uri: str) -> tuple[int, int]:
    """(generation directories, WAL entries) under a table's `_mem_wal/`."""
    gens = len(glob.glob(os.path.join(uri, layout.MEM_WAL_DIR, "*", "*_gen_*")))
    wal = len(glob.glob(os.path.join(uri, layout.MEM_WAL_DIR, "*", layout.WAL_DIR, "*.arrow")))
    return gens, wal


# --------------------------------------------------------------------------------------------------
# Throughput runs
# --------------------------------------------------------------------------------------------------


@dataclass
class Run:
    engine: str  # "memwal_df" | "lance" | "lance (tuned)"
    durable: bool
    regions: int
    rows: int
    put_s: float  # until the last put returned
    close_s: float  # close(): remaining WAL appends + MemTable flushes into generations
    generations: int
    wal_entries: int
    extra: dict[str, Any] = field(default_factory=dict)
    threads: int = 1  # concurrent putters

    @property
    def total_s(self) -> float:
        return self.put_s + self.close_s

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.total_s

    @property
    def put_rows_per_s(self) -> float:
        return self.rows / self.put_s


class NativeRouter:
    """Lance native writers, one per bucket, fed the way memwal_df's TableWriter feeds its regions.
    Like memwal_df's, a bucket's writer is opened (its shard claimed) when the bucket first gets rows."""

    def __init__(self, ds: lance.LanceDataset, regions: int, **writer_kwargs: Any) -> None:
        self.ds = ds
        self.regions = regions
        self.kwargs = writer_kwargs
        self.shards = [str(uuid.uuid4()) for _ in range(regions)]
        self.open: dict[int, Any] = {}
        self.spec = ds.mem_wal_index_details()["sharding_specs"][0]
        self.lance_schema = ds.lance_schema
        self.lock = threading.Lock()  # one writer per shard when several threads put

    def writer(self, region: int) -> Any:
        w = self.open.get(region)
        if w is None:
            with self.lock:
                w = self.open.get(region)
                if w is None:
                    w = self.open[region] = self.ds.mem_wal_writer(self.shards[region], **self.kwargs)
        return w

    def put(self, table: pa.Table) -> None:
        if self.regions == 1:
            self.writer(0).put(table)
            return
        batch = table.to_batches()[0] if table.num_rows else table
        buckets = evaluate_sharding_spec(batch, self.spec, self.lance_schema).column(0).to_numpy()
        order = np.argsort(buckets, kind="stable")
        counts = np.bincount(buckets, minlength=self.regions)
        grouped = batch.take(pa.array(order))
        offset = 0
        for region, count in enumerate(counts.tolist()):
            if count:
                self.writer(region).put(grouped.slice(offset, count))
                offset += count

    def close(self) -> None:
        for w in self.open.values():
            w.close()


def timed_puts(
    put: Callable[[pa.Table], None], close: Callable[[], None], batches: list[pa.Table], threads: int = 1
) -> tuple[float, float]:
    """(seconds until the last put returned, seconds of close()). With `threads` > 1, that many
    threads put batches i, i + threads, i + 2 * threads ... at the same time."""
    gc.collect()
    os.sync()  # the previous run's dirty pages are not this run's I/O
    errors: list[BaseException] = []

    def share(i: int) -> None:
        try:
            for b in batches[i::threads]:
                put(b)
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=share, args=(i,)) for i in range(1, threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    share(0)
    for w in workers:
        w.join()
    t1 = time.perf_counter()
    if errors:
        raise errors[0]
    close()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


class AllThreads:
    """cProfile of the calling thread and of every thread started while it runs (the writer's region
    pool and flush threads), merged into one stats file."""

    def __init__(self, cpu: bool = False) -> None:
        self.profiles: list[cProfile.Profile] = []
        self.timer = time.thread_time if cpu else time.perf_counter

    def _hook(self, *_: Any) -> None:  # first profile event of a new thread: give it its own profiler
        p = cProfile.Profile(self.timer)
        self.profiles.append(p)
        p.enable()

    def start(self) -> None:
        threading.setprofile(self._hook)
        self._hook()

    def stop(self, path: str) -> None:
        threading.setprofile(None)
        self.profiles[0].disable()
        stats = pstats.Stats(self.profiles[0])
        for p in self.profiles[1:]:
            stats.add(p)
        stats.dump_stats(path)


def run_ours(
    scratch: Scratch,
    wl: Workload,
    regions: int,
    durable: bool,
    memtable_rows: int,
    profile: str | None = None,
    profile_cpu: bool = False,
    threads: int = 1,
) -> Run:
    uri = scratch.new(f"ours-{'d' if durable else 'nd'}-{regions}r-{threads}t")
    table = ours_table(uri, wl.base, regions)
    profiler = AllThreads(profile_cpu) if profile else None
    if profiler:
        profiler.start()
    w = table.writer(durable=durable, max_memtable_rows=memtable_rows)
    put_s, close_s = timed_puts(w.put, w.close, wl.batches, threads)
    if profiler:
        profiler.stop(profile)
    gens, wal = mem_wal_files(uri)
    stats = [rw.stats() for rw in w.writers.values()]
    extra = {"wal_bytes": sum(s["wal_bytes"] for s in stats)}
    return Run("memwal_df", durable, regions, wl.upsert_rows, put_s, close_s, gens, wal, extra, threads)


def run_native(
    scratch: Scratch,
    wl: Workload,
    regions: int,
    durable: bool,
    memtable_rows: int,
    interval_ms: int | None,
    threads: int = 1,
) -> Run:
    engine = "lance" if interval_ms is None else "lance (tuned)"
    uri = scratch.new(f"lance-{'d' if durable else 'nd'}-{regions}r-{interval_ms}-{threads}t")
    ds = native_table(uri, wl.base, regions)
    kwargs: dict[str, Any] = {"durable_write": durable, "max_memtable_rows": memtable_rows}
    if interval_ms is not None:
        kwargs["max_wal_flush_interval_ms"] = interval_ms
    router = NativeRouter(ds, regions, **kwargs)
    put_s, close_s = timed_puts(router.put, router.close, wl.batches, threads)
    gens, wal = mem_wal_files(uri)
    extra = {"max_wal_flush_interval_ms": interval_ms or 100}
    return Run(engine, durable, regions, wl.upsert_rows, put_s, close_s, gens, wal, extra, threads)


# --------------------------------------------------------------------------------------------------
# Latency
# --------------------------------------------------------------------------------------------------


@dataclass
class Latency:
    name: str
    samples_ms: list[float]
    baseline: Latency | None = None  # the raw fsync measured alongside

    def pct(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_ms)

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name.strip(),
            "n": len(self.samples_ms),
            "p50_ms": self.p50,
            "p99_ms": self.p99,
            "mean_ms": self.mean,
        }
        if self.baseline is not None:
            out["p50_over_raw_fsync_p50"] = self.p50 / self.baseline.p50
        return out


WARMUP = 10


def time_each(put: Callable[[pa.Table], None], rows: list[pa.Table]) -> list[float]:
    for r in rows[:WARMUP]:
        put(r)
    gc.collect()
    out = []
    for r in rows[WARMUP:]:
        t0 = time.perf_counter()
        put(r)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _rows_of_bucket(table: mw.Table, rows: list[pa.Table], bucket: int) -> list[pa.Table]:
    assert table.spec is not None
    ids = pa.concat_tables(rows)
    b = table.spec.evaluate(ids, table.schema.field_ids)[0].to_numpy(zero_copy_only=False)
    return [r for r, v in zip(rows, b, strict=True) if v == bucket]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class RawFsync:
    """The I/O floor: create a new file, write a WAL-sized payload, fsync it (optionally also fsync the
    directory, which a durable new name needs)."""

    def __init__(self, directory: str, size: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.payload = os.urandom(size)

    def __call__(self, dir_sync: bool) -> None:
        path = os.path.join(self.directory, uuid.uuid4().hex)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, self.payload)
        os.fsync(fd)
        os.close(fd)
        if dir_sync:
            dfd = os.open(self.directory, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)


def _interleaved(
    label: str, put: Callable[[pa.Table], None], rows: list[pa.Table], raw: RawFsync, n: int
) -> list[Latency]:
    """`n` single-row puts, each followed by one raw create + write + fsync (and one with the directory
    fsync too), so the put and its I/O floor are measured under the same disk conditions."""
    for i in range(WARMUP):
        put(rows[i])
        raw(False)
        raw(True)
    puts, raw_f, raw_fd = [], [], []
    gc.collect()
    os.sync()
    for row in rows[WARMUP : WARMUP + n]:
        puts.append(_timed(lambda: put(row)))  # noqa: B023
        raw_f.append(_timed(lambda: raw(False)))
        raw_fd.append(_timed(lambda: raw(True)))
    size = len(raw.payload)
    base = Latency(f"  raw create + write + fsync ({size} B), interleaved", raw_f)
    return [
        Latency(label, puts, base),
        base,
        Latency(f"  raw create + write + fsync + dir fsync ({size} B), interleaved", raw_fd, base),
    ]


def put_latency(scratch: Scratch, wl: Workload, n: int, tuned: int | None) -> tuple[list[Latency], int]:
    """Durable single-row put latency: memwal_df (one routed region writer), then Lance tuned, each
    interleaved with the raw I/O floor (a file the size of memwal_df's one-row WAL entry); then Lance
    with its default settings (about 100 ms a put). Returns the WAL entry size too."""
    table = ours_table(scratch.new("ours-latency"), wl.base, NUM_REGIONS)
    rw = table.routed_writer((0,), mw.WriterConfig(durable_write=True))
    ours_rows = _rows_of_bucket(table, wl.singles, 0)  # a routed writer takes rows of its region only
    rw.put(ours_rows[0])
    wal_dir = os.path.join(table.uri, layout.region_dir(rw.region_id), layout.WAL_DIR)
    entry_size = max(e.stat().st_size for e in os.scandir(wal_dir))
    raw = RawFsync(scratch.new("raw-fsync"), min(max(entry_size, 1024), 4096))
    out = _interleaved("memwal_df durable put (1 row)", rw.put, ours_rows[1:], raw, n)
    rw.close()

    if tuned:
        ds = native_table(scratch.new("lance-latency-tuned"), wl.base, NUM_REGIONS)
        w = ds.mem_wal_writer(str(uuid.uuid4()), durable_write=True, max_wal_flush_interval_ms=tuned)
        label = f"lance durable put (1 row, max_wal_flush_interval_ms={tuned})"
        out += _interleaved(label, w.put, wl.singles, raw, n)
        w.close()

    ds = native_table(scratch.new("lance-latency"), wl.base, NUM_REGIONS)
    w = ds.mem_wal_writer(str(uuid.uuid4()), durable_write=True)
    for r in wl.singles[:WARMUP]:
        w.put(r)
    default = [_timed(lambda: w.put(r)) for r in wl.singles[WARMUP : WARMUP + n]]  # noqa: B023
    w.close()
    out.append(Latency("lance durable put (1 row, default settings)", default, out[1]))
    return out, entry_size


def _wait_for_new_file(directory: str, before: int, timeout_s: float = 5.0) -> float:
    """Seconds until `directory` holds more than `before` finished `.arrow` files."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            n = sum(1 for e in os.scandir(directory) if e.name.endswith(".arrow"))
        except FileNotFoundError:
            n = 0
        if n > before:
            return time.perf_counter() - t0
        time.sleep(0.0002)
    return float("nan")


def durability_lag(scratch: Scratch, wl: Workload, n: int) -> list[Latency]:
    """Non-durable writers: time from a put returning until its WAL entry exists (default settings)."""
    out = []
    uri = scratch.new("ours-lag")
    table = ours_table(uri, wl.base, NUM_REGIONS)
    rw = table.routed_writer((0,), mw.WriterConfig(durable_write=False))
    wal_dir = os.path.join(uri, layout.region_dir(rw.region_id), layout.WAL_DIR)
    rows = _rows_of_bucket(table, wl.singles, 0)[:n]
    samples = []
    for i, r in enumerate(rows):
        rw.put(r)
        samples.append(_wait_for_new_file(wal_dir, i) * 1e3)
    rw.close()
    out.append(Latency("memwal_df non-durable put -> WAL entry on disk", samples))

    uri = scratch.new("lance-lag")
    ds = native_table(uri, wl.base, NUM_REGIONS)
    shard = str(uuid.uuid4())
    w = ds.mem_wal_writer(shard, durable_write=False)
    wal_dir = os.path.join(uri, layout.MEM_WAL_DIR, shard, layout.WAL_DIR)
    samples = []
    for i, r in enumerate(wl.singles[:n]):
        w.put(r)
        samples.append(_wait_for_new_file(wal_dir, i) * 1e3)
    w.close()
    out.append(Latency("lance non-durable put -> WAL entry on disk", samples))
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:,.1f} k"


def median_runs(runs: list[Run]) -> list[tuple[Run, list[Run]]]:
    """Per configuration (first-seen order): the run with the median total time, and all its runs."""
    groups: dict[tuple[str, bool, int, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.engine, r.durable, r.regions, r.threads), []).append(r)
    out = []
    for rs in groups.values():
        ordered = sorted(rs, key=lambda r: r.total_s)
        out.append((ordered[(len(ordered) - 1) // 2], rs))
    return out


def markdown(runs: list[Run], latencies: list[Latency]) -> str:
    medians = median_runs(runs)

    def native_of(r: Run, engine: str) -> Run | None:
        for o, _ in medians:
            if (o.engine, o.durable, o.regions, o.threads) == (engine, r.durable, r.regions, r.threads):
                return o
        return None

    repeats = max(len(rs) for _, rs in medians)
    lines = [
        "### Upsert throughput (each run ends with close(): everything durable and flushed into generations)",
        "",
        "| engine | mode | regions | putters | puts s | close s | total s | rows/s "
        + ("| rows/s min-max " if repeats > 1 else "")
        + "| rows/s (puts only) | gens | WAL entries | memwal_df / lance | memwal_df / lance (tuned) |",
        "|---|---|--:|--:|--:|--:|--:|--:|" + ("--:|" if repeats > 1 else "") + "--:|--:|--:|--:|--:|",
    ]
    for r, rs in medians:
        ratio = ratio_tuned = ""
        if r.engine == "memwal_df":
            if (n := native_of(r, "lance")) is not None:
                ratio = f"{r.rows_per_s / n.rows_per_s:.2f}x"
            if (n := native_of(r, "lance (tuned)")) is not None:
                ratio_tuned = f"{r.rows_per_s / n.rows_per_s:.2f}x"
        spread = ""
        if repeats > 1:
            rates = [x.rows_per_s for x in rs]
            spread = f"| {_fmt_rate(min(rates))} - {_fmt_rate(max(rates))} "
        lines.append(
            f"| {r.engine} | {'durable' if r.durable else 'non-durable'} | {r.regions} | {r.threads} "
            f"| {r.put_s:.2f} "
            f"| {r.close_s:.2f} | {r.total_s:.2f} | {_fmt_rate(r.rows_per_s)} {spread}"
            f"| {_fmt_rate(r.put_rows_per_s)} | {r.generations} | {r.wal_entries} | {ratio} | {ratio_tuned} |"
        )
    lines += [
        "",
        "### Single-row latency (durable puts interleaved with the raw I/O floor on the same disk)",
        "",
        "| measurement | n | p50 ms | p99 ms | mean ms | p50 / raw fsync p50 |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for lat in latencies:
        ratio = f"{lat.p50 / lat.baseline.p50:.2f}x" if lat.baseline is not None else ""
        lines.append(
            f"| {lat.name} | {len(lat.samples_ms)} | {lat.p50:.3f} | {lat.p99:.3f} | {lat.mean:.3f} "
            f"| {ratio} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--small", action="store_true", help="quick run: base 20k, 20k upserts, 100 latency puts")
    p.add_argument("--base", type=int, help="base table rows (default 100,000; small 20,000)")
    p.add_argument("--rows", type=int, help="upsert rows (default 200,000; small 20,000)")
    p.add_argument("--batch", type=int, default=1000, help="rows per put (default 1,000)")
    p.add_argument("--memtable-rows", type=int, help="max_memtable_rows of both engines (default rows/10)")
    p.add_argument("--latency-puts", type=int, help="single-row puts per engine (default 500; small 100)")
    p.add_argument("--lag-puts", type=int, default=20, help="non-durable puts timed until durable (20)")
    p.add_argument(
        "--tuned-interval-ms",
        type=int,
        default=1,
        help="max_wal_flush_interval_ms of the tuned Lance runs (default 1; 0 = skip them)",
    )
    p.add_argument("--dir", help="where tables go (default: a temp dir under bench/results/, same disk)")
    p.add_argument("--repeat", type=int, default=1, help="throughput runs per configuration (median shown)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="also run durable throughput with this many threads putting at once (group commit)",
    )
    p.add_argument(
        "--only",
        choices=["durable", "non-durable"],
        help="throughput runs of this mode only, and no latency runs (for quick comparisons)",
    )
    p.add_argument(
        "--partial-only", action="store_true", help="only the partial vs full upsert runs (bench/_partial.py)"
    )
    p.add_argument("--keep", action="store_true", help="keep the tables")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--profile", help="only profile memwal_df durable, 4 regions (cProfile) into this file")
    p.add_argument(
        "--profile-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cProfile timer: wall clock (shows waits) or per-thread CPU time (shows work)",
    )
    args = p.parse_args(argv)

    base_rows = args.base or (20_000 if args.small else 100_000)
    rows = args.rows or (20_000 if args.small else 200_000)
    memtable_rows = args.memtable_rows or max(rows // 10, args.batch)
    latency_puts = args.latency_puts or (100 if args.small else 500)
    tuned = args.tuned_interval_ms or None

    root = scratch_root(args.dir, "write-")
    scratch = Scratch(root)

    t0 = time.perf_counter()
    # Enough single rows for the durable latency run's bucket-0 filter (about a quarter of them).
    wl = make_workload(base_rows, rows, args.batch, (latency_puts + WARMUP) * 8)
    print(
        f"# bench/write.py: base {base_rows:,} rows, {rows:,} upserts in {len(wl.batches)} batches of "
        f"{args.batch:,} (half updates), max_memtable_rows {memtable_rows:,}; data generated in "
        f"{time.perf_counter() - t0:.1f}s; tables under {root}; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs",
        flush=True,
    )
    try:
        if args.profile:
            run = run_ours(
                scratch, wl, NUM_REGIONS, True, memtable_rows, args.profile, args.profile_clock == "cpu"
            )
            print(f"memwal_df durable {NUM_REGIONS} regions: {run.rows_per_s:,.0f} rows/s under cProfile")
            pstats.Stats(args.profile).sort_stats("cumulative").print_stats(30)
            pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
            return 0

        runs: list[Run] = []

        def record(run: Run) -> None:
            runs.append(run)
            print(
                f"  {run.engine:14s} {'durable' if run.durable else 'non-durable':11s} "
                f"{run.regions} region(s), {run.threads} putter(s): {run.rows_per_s:>10,.0f} rows/s "
                f"(puts {run.put_s:.2f}s + close {run.close_s:.2f}s)",
                flush=True,
            )

        modes = (True, False) if args.only is None else (args.only == "durable",)
        partial_runs: list[PartialRun] = []
        for rep in range(args.repeat):
            for durable, partial in [(d, p) for d in modes for p in (False, True)][
                :: 1 if rep % 2 == 0 else -1
            ]:
                run = run_partial(scratch.new, wl, memtable_rows, durable, partial)
                partial_runs.append(run)
                mode = "durable" if durable else "non-durable"
                print(
                    f"  memwal_df {mode:11s} {run.kind} upserts: {run.rows_per_s:>10,.0f} rows/s", flush=True
                )
        take_us = base_take(scratch.new, wl, memtable_rows)
        print(partial_markdown(partial_runs, take_us), flush=True)
        if args.partial_only:
            return 0
        configs = [(regions, durable, 1) for regions in (NUM_REGIONS, 1) for durable in modes]
        if args.threads > 1 and True in modes:
            configs += [(regions, True, args.threads) for regions in (NUM_REGIONS, 1)]
        for rep in range(args.repeat):
            for regions, durable, threads in configs:
                todo: list[Callable[[], Run]] = [
                    lambda: run_ours(scratch, wl, regions, durable, memtable_rows, threads=threads),  # noqa: B023
                    lambda: run_native(scratch, wl, regions, durable, memtable_rows, None, threads),  # noqa: B023
                ]
                if durable and tuned:
                    todo.append(
                        lambda: run_native(scratch, wl, regions, durable, memtable_rows, tuned, threads)  # noqa: B023
                    )
                for run in todo if rep % 2 == 0 else todo[::-1]:  # alternate who goes first
                    record(run())

        latencies: list[Latency] = []
        entry_size = 0
        if args.only is None:
            latencies, entry_size = put_latency(scratch, wl, latency_puts, tuned)
            latencies += durability_lag(scratch, wl, args.lag_puts)
        for lat in latencies:
            print(f"  {lat.name}: p50 {lat.p50:.3f} ms, p99 {lat.p99:.3f} ms", flush=True)

        print()
        print(markdown(runs, latencies))
        print(
            "\nLance native on a local disk publishes WAL entries without any fsync (temp file + rename or"
            " link);"
            f" memwal_df fdatasyncs each entry and fsyncs its directory. One-row WAL entry: {entry_size} B."
            f" Total bench time {time.perf_counter() - t0:.0f}s; load average now {os.getloadavg()[0]:.1f}"
            f" on {os.cpu_count()} CPUs (other processes skew the figures)."
        )
        if args.json:
            result = {
                "config": {
                    "base_rows": base_rows,
                    "upsert_rows": rows,
                    "batch": args.batch,
                    "memtable_rows": memtable_rows,
                    "latency_puts": latency_puts,
                    "dir": str(root),
                    "tuned_interval_ms": tuned,
                    "repeat": args.repeat,
                    "python": platform.python_version(),
                    "pylance": lance.__version__,
                    "pyarrow": pa.__version__,
                    "cpus": os.cpu_count(),
                    "load_average_end": os.getloadavg()[0],
                    "git": git_state(),
                },
                "throughput": [
                    {
                        **asdict(r),
                        "total_s": r.total_s,
                        "rows_per_s": r.rows_per_s,
                        "put_rows_per_s": r.put_rows_per_s,
                    }
                    for r in runs
                ],
                "latency": [lat.summary() for lat in latencies],
                "partial": [{**asdict(r), "rows_per_s": r.rows_per_s} for r in partial_runs],
                "partial_base_take_cpu_us_per_row": take_us,
                "wal_entry_bytes_one_row": entry_size,
            }
            write_json(args.json, result)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
