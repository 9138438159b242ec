"""Partial-upsert throughput next to full upserts of the same keys (the partial figures of
docs/performance.md, run by bench/write.py).

The table is the reference workload plus a sixth column, `count` int64, with a btree index on `id` in
the base. Before the timed part the writer already holds keys in every level: a third of the keys
updated are base keys, a third were written and flushed into generations, a third sit in the active
MemTables. The timed part updates those keys in `batch`-row puts, either as full rows (all 6 columns)
or as partial rows (`id`, `value`, `count`: 2 of the 5 value columns), each followed by `close()`.
Both runs start from identically prepared tables; only the puts and the close are timed, in wall time
and in CPU time of the whole process (every thread, Lance's included).

`base_take` measures the part of a partial upsert no implementation can skip: reading the missing
columns of the keys that only the base holds. It takes those columns of each timed put's base keys
with Lance, as the writer does (`memwal_df.read.lsm.fragments.fragment_take`: a `FragmentSession.take`,
through Lance's io_uring reader on Linux), and reports the process CPU per updated row. A full
upsert's CPU plus that take's, spread over every CPU, bounds how fast a partial upsert can be on this
machine (`markdown`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
from _workload import NUM_REGIONS, Workload

import memwal_df as mw
from memwal_df.read.lsm.fragments import fragment_take

CARRIED = ["id", "value", "count"]


@dataclass
class PartialRun:
    kind: str  # "full" | "partial"
    durable: bool
    rows: int
    put_s: float
    close_s: float
    cpu_s: float  # process CPU (every thread) during the puts and the close

    @property
    def rows_per_s(self) -> float:
        return self.rows / (self.put_s + self.close_s)

    @property
    def cpu_us_per_row(self) -> float:
        return self.cpu_s / self.rows * 1e6


def with_count(rows: pa.Table, shift: int = 0) -> pa.Table:
    """`rows` with the sixth column `count` (derived from the key, plus `shift`)."""
    ids = rows.column("id").to_numpy()
    return rows.append_column("count", pa.array(ids % 1000 + shift, pa.int64()))


def update_batches(
    wl: Workload, spread: tuple[np.ndarray, np.ndarray, np.ndarray], seed: int = 7
) -> list[pa.Table]:
    """The timed updates: the workload's batch shapes, each batch's keys drawn a third from each level
    (base keys, generation keys, MemTable keys), values from the workload's rows."""
    rng = np.random.default_rng(seed)
    out = []
    for batch in wl.batches:
        n = batch.num_rows
        parts = [rng.choice(pool, n // 3 + (i < n % 3), replace=False) for i, pool in enumerate(spread)]
        ids = np.concatenate(parts)
        rng.shuffle(ids)
        out.append(with_count(batch.set_column(0, "id", pa.array(ids, pa.int64())), shift=1))
    return out


def prepare(
    uri: str, wl: Workload, memtable_rows: int, durable: bool
) -> tuple[mw.TableWriter, tuple[np.ndarray, ...]]:
    """A table of the workload's base (btree on `id`) whose writer holds flushed generations and
    unflushed MemTables; the three key pools (base, generations, MemTables)."""
    table = mw.create_table(uri, with_count(wl.base), "id", region_spec=mw.bucket("id", NUM_REGIONS))
    lance.dataset(uri).create_scalar_index("id", "BTREE")
    table.refresh()
    base_keys = wl.base.column("id").to_numpy()
    n = len(base_keys) // 4
    start = int(base_keys.max()) + 1 + 10 * sum(b.num_rows for b in wl.batches)  # above every workload key
    gen_keys = np.arange(start, start + n, dtype=np.int64)
    mem_keys = gen_keys + n
    w = table.writer(durable=durable, max_memtable_rows=memtable_rows)
    fill = wl.base.slice(0, n)
    w.put(with_count(fill.set_column(0, "id", pa.array(gen_keys))))
    w.flush()
    w.put(with_count(fill.set_column(0, "id", pa.array(mem_keys))))
    return w, (base_keys, gen_keys, mem_keys)


def run_partial(
    new_uri: Callable[[str], str], wl: Workload, memtable_rows: int, durable: bool, partial: bool
) -> PartialRun:
    """One timed run of full or partial updates (see the module docstring)."""
    mode = "d" if durable else "nd"
    w, spread = prepare(new_uri(f"{'partial' if partial else 'full'}-{mode}"), wl, memtable_rows, durable)
    batches = update_batches(wl, spread)
    if partial:
        batches = [b.select(CARRIED) for b in batches]
    c0, t0 = time.process_time(), time.perf_counter()
    for b in batches:
        w.put(b, partial=partial)
    t1 = time.perf_counter()
    w.close()
    t2 = time.perf_counter()
    rows = sum(b.num_rows for b in batches)
    return PartialRun(
        "partial" if partial else "full", durable, rows, t1 - t0, t2 - t1, time.process_time() - c0
    )


def base_take(new_uri: Callable[[str], str], wl: Workload, memtable_rows: int) -> float:
    """Process CPU µs per updated row to take, with Lance, the columns a partial put does not carry of
    its keys that only the base holds (each put's base keys in one take, as the writer reads them)."""
    w, spread = prepare(new_uri("base-take"), wl, memtable_rows, durable=False)
    w.close()
    ds = lance.dataset(w.table.uri)
    (fragment,) = ds.get_fragments()
    missing = [c for c in ds.schema.names if c not in CARRIED]
    ids = fragment.to_table(columns=["id"]).column("id").to_numpy()
    order = np.argsort(ids)
    batches = update_batches(wl, spread)
    c0 = time.process_time()
    for b in batches:
        keys = b.column("id").to_numpy()
        at = np.searchsorted(ids, keys, sorter=order)
        found = (at < len(ids)) & (ids[order[np.minimum(at, len(ids) - 1)]] == keys)
        fragment_take(ds, fragment.fragment_id, np.sort(order[at[found]]), ["id", *missing])
    return (time.process_time() - c0) / sum(b.num_rows for b in batches) * 1e6


def markdown(runs: list[PartialRun], take_us: float | None = None) -> str:
    """A table: per mode, full and partial rows/s (median of the repeats), their ratio, the added
    cost per row of a partial upsert, and the CPU per row of both; with `take_us` (`base_take`), the
    bound it puts on a partial upsert on this machine's CPUs."""
    lines = [
        "| mode | full upserts rows/s | partial upserts rows/s | partial / full | added cost per row "
        "| CPU per row, full / partial |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cpus = os.cpu_count() or 1
    bounds = []
    for durable in sorted({r.durable for r in runs}, reverse=True):
        mine = [r for r in runs if r.durable == durable]
        full = _median(r.rows_per_s for r in mine if r.kind == "full")
        part = _median(r.rows_per_s for r in mine if r.kind == "partial")
        full_cpu = _median(r.cpu_us_per_row for r in mine if r.kind == "full")
        part_cpu = _median(r.cpu_us_per_row for r in mine if r.kind == "partial")
        mode = "durable" if durable else "non-durable"
        lines.append(
            f"| {mode} | {full:,.0f} | {part:,.0f} | {part / full:.0%} "
            f"| {(1 / part - 1 / full) * 1e6:.1f} µs | {full_cpu:.1f} / {part_cpu:.1f} µs |"
        )
        if take_us is not None:
            fastest = cpus / (full_cpu + take_us) * 1e6  # every CPU busy, nothing but the take added
            bounds.append(f"{mode} ≤ {fastest:,.0f} rows/s ({fastest / full:.0%} of full)")
    if take_us is not None:
        lines.append(
            f"\nLance take of the missing columns of the base keys: {take_us:.1f} µs CPU per updated row; "
            f"a partial upsert on {cpus} CPUs at best: " + ", ".join(bounds)
        )
    return "\n".join(lines)


def _median(values: Iterable[float]) -> float:
    return statistics.median(list(values))
