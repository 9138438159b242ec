"""Merge throughput: `Table.merge()` (regions in parallel, and serially) against the same merge done
with Lance's own primitives (one `merge_insert` per generation with `mark_sstables_as_compacted`, a
`when_matched_delete` pass for tombstones), in the same run on copies of one table.

Then the other background jobs on many small generations (default 1,000 generations across 100
regions, a BTREE index on the key): merge, MemWAL index build, index catch-up and GC, timed one
after the other on one table in the same run (so the merge time is their peer).

    PYTHONPATH=. python bench/merge.py [--small] [--base N] [--rows N] [--regions N] [--gens N]
                                       [--job-regions N] [--job-gens N] [--json FILE]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from datetime import timedelta

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _cli import add_int_args, config_of, write_json
from lance.mem_wal import CompactedSsTable

import memwal_df as mw
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore


def build(uri: str, base: int, rows: int, regions: int, gens: int) -> None:
    rng = np.random.default_rng(0)
    data = pa.table({"id": pa.array(np.arange(base), pa.int64()), "v": rng.random(base)})
    table = mw.create_table(uri, data, "id", region_spec=mw.bucket("id", regions))
    per_gen = rows // gens
    with table.writer(durable=False) as w:
        for _ in range(gens):
            ids = rng.choice(base * 2, per_gen, replace=False)  # about half updates
            for chunk in np.array_split(ids, max(1, per_gen // 1000)):
                w.put(pa.table({"id": pa.array(chunk, pa.int64()), "v": rng.random(len(chunk))}))
            w.delete(pa.table({"id": pa.array(rng.choice(base, per_gen // 50, replace=False), pa.int64())}))
            w.flush()


def lance_primitives(uri: str) -> int:
    """The merge with Lance's primitives only: region by region, generation by generation."""
    table = mw.open_table(uri)
    rows = 0
    for region in table.region_ids():
        m = RegionManifestStore(table.storage, region).latest()
        for sst in sorted(m.sstables, key=lambda s: s.generation):
            gen = lance.dataset(table.storage.child_uri(layout.generation_path(region, sst.path))).to_table()
            dead = gen.column("_tombstone")
            gen = gen.drop_columns(["_tombstone"])
            if pc.any(dead).as_py():
                lance.dataset(uri).merge_insert("id").when_matched_delete().execute(gen.filter(dead))
            live = gen.filter(pc.invert(dead))
            ds = lance.dataset(uri)
            live = live.cast(pa.schema([ds.schema.field(n) for n in live.column_names]))
            (
                ds.merge_insert("id")
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .mark_sstables_as_compacted([CompactedSsTable(str(region), sst.generation)])
                .execute(live)
            )
            rows += gen.num_rows
    return rows


def jobs(uri: str, regions: int, gens: int, rows_per_gen: int = 20) -> list[dict]:
    """Time merge, build_index, catch_up_indexes and gc over `gens` generations in `regions` regions."""
    rng = np.random.default_rng(1)
    base = 10 * regions * rows_per_gen
    data = pa.table({"id": pa.array(np.arange(base), pa.int64()), "v": rng.random(base)})
    table = mw.create_table(uri, data, "id", region_spec=mw.bucket("id", regions))
    lance.dataset(uri).create_scalar_index("id", "BTREE")
    t0 = time.perf_counter()
    with table.writer(durable=False) as w:
        for _ in range(gens // regions):  # every flush writes one generation in every region
            ids = rng.choice(base * 2, regions * rows_per_gen, replace=False)
            w.put(pa.table({"id": pa.array(ids, pa.int64()), "v": rng.random(len(ids))}))
            w.flush()
    flushed = sum(len(RegionManifestStore(table.storage, r).latest().sstables) for r in table.region_ids())
    print(f"{flushed} generations in {regions} regions written in {time.perf_counter() - t0:.1f} s")
    zero = timedelta(0)

    def merge() -> str:
        return f"{sum(map(len, table.merge().generations.values()))} generations merged"

    def build() -> str:
        built = table.build_index()
        return f"{built.regions} regions, snapshot {built.location}"

    def catch_up() -> str:
        return f"covers the latest version: {table.catch_up_indexes().indexes[0].covers_latest}"

    def cleanup() -> str:
        removed = lance.dataset(uri).cleanup_old_versions(older_than=zero).old_versions
        return f"{removed} base versions removed"

    def gc() -> str:
        return f"{sum(map(len, table.gc(grace=zero).generations.values()))} generations removed"

    steps = {"merge": merge, "build_index": build, "catch_up_indexes": catch_up}
    steps |= {"cleanup_old_versions": cleanup, "gc": gc}
    out = []
    for name, step in steps.items():
        t0 = time.perf_counter()
        what = step()
        dt = time.perf_counter() - t0
        print(f"  {name:22s} {dt:8.2f} s {dt / flushed * 1e3:8.2f} ms/generation  ({what})")
        out.append({"job": name, "seconds": dt, "generations": flushed, "what": what})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    add_int_args(p, base=1_000_000, rows=200_000, regions=4, gens=3, job_regions=100, job_gens=1000)
    p.add_argument("--json", help="also write the results as JSON to this file")
    a = p.parse_args()
    if a.small:
        a.base, a.rows, a.job_regions, a.job_gens = 100_000, 40_000, 20, 100
    root = tempfile.mkdtemp(prefix="memwal-bench-merge-")
    try:
        src = f"{root}/src"
        build(src, a.base, a.rows, a.regions, a.gens)
        runs = {
            "memwal_df merge (parallel regions)": lambda u: mw.open_table(u).merge(parallel=True).rows,
            "memwal_df merge (serial regions)": lambda u: mw.open_table(u).merge().rows,
            "Lance primitives (serial)": lance_primitives,
        }
        results = {}
        for name, run in runs.items():
            uri = f"{root}/{uuid.uuid4().hex}"
            shutil.copytree(src, uri)
            t0 = time.perf_counter()
            rows = run(uri)
            dt = time.perf_counter() - t0
            results[name] = (rows, dt, sorted(lance.dataset(uri).to_table().column("id").to_pylist()))
        peer = results["Lance primitives (serial)"]
        merges = []
        for name, (rows, dt, ids) in results.items():
            same = "same result" if ids == peer[2] else "DIFFERENT RESULT"
            print(
                f"{name:36s} {rows:8d} rows {dt:7.2f} s {rows / dt / 1e3:8.1f} k rows/s "
                f"x{peer[1] / dt:4.2f} vs Lance  ({same})"
            )
            merges.append({"engine": name, "rows": rows, "seconds": dt, "same_result": ids == peer[2]})
        job_times = jobs(f"{root}/jobs", a.job_regions, a.job_gens)
        if a.json:
            write_json(
                a.json, {"config": config_of(a, leave_out=("json",)), "merge": merges, "jobs": job_times}
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
