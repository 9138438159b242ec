"""Point lookups as a writer's MemTable grows: a writer puts batches of 50 rows (never flushed) into a
table of 20,000 base rows until its MemTable holds 50,000 rows; at each step, `SELECT * FROM t WHERE
id = k` through DataFusion (`MemWalTable(table, writer=w)`: the MemTable is read too) is timed next to
plain Lance's lookup of the same key in the base table (`to_table(filter="id = k")`, blind to the
MemTable) in the same run. Nothing is asserted: the script prints p50 latencies and their ratio.

    python bench/memtable_lookup.py [--base-rows 20000] [--memtable-rows 50000] [--queries 100]
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
from _workload import vector_rows as rows

import memwal_df as mw


def p50_ms(call: Callable[[int], object], keys: np.ndarray) -> float:
    times = []
    for k in keys.tolist():
        t0 = time.perf_counter()
        call(k)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--base-rows", type=int, default=20_000)
    ap.add_argument("--memtable-rows", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=100)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="memwal-memtable-lookup-"))
    rng = np.random.default_rng(7)
    try:
        uri = str(root / "t")
        table = mw.create_table(
            uri, rows(np.arange(args.base_rows), rng), primary_key="id", region_spec=mw.bucket("id", 4)
        )
        base = lance.dataset(uri)
        with table.writer(durable=False, max_memtable_rows=args.memtable_rows + 1) as writer:
            ctx = mw.register(datafusion.SessionContext())
            ctx.register_table("t", mw.MemWalTable(table, writer=writer))
            steps = 5
            per_step = args.memtable_rows // steps // 50
            print(f"{'MemTable rows':>13} | {'memwal_df p50':>13} | {'Lance p50':>9} | {'ratio':>5}")
            for step in range(steps + 1):
                keys = rng.integers(0, args.base_rows, args.queries)
                ours = p50_ms(lambda k: ctx.sql(f"SELECT * FROM t WHERE id = {k}").to_arrow_table(), keys)
                theirs = p50_ms(lambda k: base.to_table(filter=f"id = {k}"), keys)
                held = step * per_step * 50
                print(f"{held:>13,} | {ours:>10.2f} ms | {theirs:>6.2f} ms | {ours / theirs:>5.2f}")
                for _ in range(per_step if step < steps else 0):
                    writer.put(rows(rng.integers(0, args.base_rows + 10_000, 50), rng))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
