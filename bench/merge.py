"""Merge throughput: `Table.merge()` (regions in parallel, and serially) against the same merge done
with Lance's own primitives (one `merge_insert` per generation with `mark_sstables_as_compacted`, a
`when_matched_delete` pass for tombstones), in the same run on copies of one table.

    PYTHONPATH=. python bench/merge.py [--small] [--base N] [--rows N] [--regions N] [--gens N]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.mem_wal import CompactedSsTable

import memwal_df as mw
from memwal_df import layout
from memwal_df.manifest import RegionManifestStore


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    p.add_argument("--base", type=int, default=1_000_000)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--gens", type=int, default=3)
    a = p.parse_args()
    if a.small:
        a.base, a.rows = 100_000, 40_000
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
        for name, (rows, dt, ids) in results.items():
            same = "same result" if ids == peer[2] else "DIFFERENT RESULT"
            print(
                f"{name:36s} {rows:8d} rows {dt:7.2f} s {rows / dt / 1e3:8.1f} k rows/s "
                f"x{peer[1] / dt:4.2f} vs Lance  ({same})"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
