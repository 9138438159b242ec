"""Point-lookup latency: `plan_point_lookup` on a 1,000,000-row base with a btree index on the key and
10 flushed generations per region (4 bucket regions), against Lance 14's `LsmPointLookupPlanner` over
the same levels. Nothing is asserted: the script prints p50/p99 in milliseconds.

Cases, one key each: a key only in the base (every generation's bloom filter of its region is checked,
then the base), a key in the newest generation, a key in the oldest generation, an absent key; and an
IN list of 100 keys. "warm" reuses one snapshot of every region; "cold" takes a point-lookup snapshot
of the keys per query (`take_snapshot(t, keys=...)`: the latest base version and the manifests of the
regions the keys route to; bloom filters, `_pk_index`es and the base key map stay cached across
snapshots); "SQL" is `SELECT * FROM t WHERE id IN (...)` through DataFusion (`MemWalTable`, a snapshot
per query).

    python bench/point_lookup.py [--base-rows 1000000] [--generations 10] [--queries 200]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import datafusion
import lance
import numpy as np
import pyarrow as pa
from _workload import native_snapshots
from lance.mem_wal import LsmPointLookupPlanner

import memwal_df as mw
from memwal_df.read.lookup.planner import plan_point_lookup
from memwal_df.read.lsm.snapshot import take_snapshot


def build(root: Path, base_rows: int, generations: int, batch: int) -> tuple[mw.Table, dict[str, int]]:
    rng = np.random.default_rng(7)
    ids = np.arange(base_rows, dtype=np.int64)
    labels = pa.array(np.char.add("b", ids.astype(str)))
    base = pa.table({"id": ids, "v": labels, "x": ids.astype(np.float64)})
    t = mw.create_table(str(root / "t"), base, "id", region_spec=mw.bucket("id", 4))
    lance.dataset(t.uri).create_scalar_index("id", "BTREE")
    t.refresh()
    newest = oldest = -1
    with t.writer(max_memtable_rows=10 * batch) as w:
        for g in range(generations):
            # Half updates of base keys, half new keys above the base.
            upd = rng.choice(base_rows, batch // 2, replace=False).astype(np.int64)
            new = base_rows + g * batch + np.arange(batch // 2, dtype=np.int64)
            keys = np.concatenate([upd, new])
            w.put(pa.table({"id": keys, "v": [f"g{g}"] * len(keys), "x": keys.astype(np.float64)}))
            w.flush()
            if g == 0:
                oldest = int(new[0])
            newest = int(new[-1])
    return t, {"base only": base_rows // 3 + 1, "newest gen": newest, "oldest gen": oldest, "absent": -5}


def timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    fn()  # first call outside the timing
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    ms = np.array(samples) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-rows", type=int, default=1_000_000)
    ap.add_argument("--generations", type=int, default=10)
    ap.add_argument("--batch", type=int, default=20_000, help="upserted rows per generation round")
    ap.add_argument("--queries", type=int, default=200)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="memwal-lookup-bench-"))
    try:
        t0 = time.perf_counter()
        t, keys = build(root, args.base_rows, args.generations, args.batch)
        snap = take_snapshot(t)
        per_region = sorted({len(r.levels) for r in snap.regions})
        print(
            f"built in {time.perf_counter() - t0:.1f}s: base {args.base_rows} rows (btree on id), "
            f"{len(snap.regions)} regions x {per_region} generations"
        )
        ds = lance.dataset(t.uri)
        planner = LsmPointLookupPlanner(ds, native_snapshots(t))
        ids = t.schema.field_ids

        def ours(k: pa.Table, cold: bool) -> pa.Table:
            s = take_snapshot(t, keys=k) if cold else snap
            return plan_point_lookup(s, t.spec, ids, k, None).to_table()

        ctx = datafusion.SessionContext()
        ctx.register_table("t", mw.MemWalTable(t.uri))

        def sql(k: pa.Table) -> pa.Table:
            listed = ", ".join(str(v) for v in k.column("id").to_pylist())
            return ctx.sql(f"SELECT * FROM t WHERE id IN ({listed})").to_arrow_table()

        cases = {name: pa.table({"id": pa.array([k], pa.int64())}) for name, k in keys.items()}
        cases["IN (100 keys)"] = pa.table({"id": pa.array(np.arange(0, 100 * 9973, 9973), pa.int64())})
        head = f"{'case':<16}{'warm p50':>10}{'p99':>8}{'cold p50':>10}{'p99':>8}{'SQL p50':>10}{'p99':>8}"
        print(f"{head}{'native p50':>12}{'p99':>8}")
        for name, k in cases.items():
            warm = timed(lambda k=k: ours(k, False), args.queries)
            cold = timed(lambda k=k: ours(k, True), max(20, args.queries // 4))
            via_sql = timed(lambda k=k: sql(k), max(20, args.queries // 4))
            if k.num_rows == 1:
                native = timed(lambda k=k: planner.plan_lookup(k.column("id").chunk(0)).to_table(), 50)
                nat = f"{native[0]:>12.2f}{native[1]:>8.2f}"
            else:
                nat = f"{'-':>12}{'-':>8}"
            ms = [*warm, *cold, *via_sql]
            print(f"{name:<16}" + "".join(f"{v:>{w}.2f}" for v, w in zip(ms, [10, 8] * 3, strict=True)) + nat)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
