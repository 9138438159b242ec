"""A full scan over generations Lance's native writer made, against a plain scan of the base.

Table: `--base` rows (`id` int64 primary key, `category` string, `value` float64), 4 bucket regions;
then `--rounds` rounds of `--rows` upserts (keys drawn from twice the base's range: about half
updates) written by Lance 14's own `mem_wal_writer`, one writer per bucket, closed after each round,
so each round leaves one flushed generation per region (`--rounds 2`: 8 generations). Nothing is
merged.

Measured in one process and one SessionContext, the engines taking turns in `--repeat` rounds
(median shown): `SELECT * FROM t` through `MemWalTable(uri)` (base and every generation, newest row
per key) and through Lance's DataFusion provider over the base alone (`lance.FFILanceTableProvider`:
what a plain scan of the base costs). memwal_df's answer is checked against the model of the rows
(the base with each round's upserts applied, newest last): a difference exits 1.

    python bench/native_scan.py                    # base 200k, 2 rounds of 10k rows: 8 generations
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import datafusion
import lance
import numpy as np
import pyarrow as pa
from _workload import NUM_REGIONS, git_state, run_in_scratch
from write import NativeRouter

import memwal_df as mw


def rows(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "category": pa.array([f"c{i}" for i in rng.integers(0, 20, len(ids))]),
            "value": rng.random(len(ids)),
        }
    )


def run(args: argparse.Namespace, root: Path) -> int:
    print(f"memwal_df {git_state()}, lance {lance.__version__}, {root}")
    rng = np.random.default_rng(args.seed)
    uri = str(root / "t")
    base = rows(np.arange(args.base), rng)
    mw.create_table(uri, base, "id", region_spec=mw.bucket("id", NUM_REGIONS))
    model = {"value": dict(zip(base.column("id").to_pylist(), base.column("value").to_pylist(), strict=True))}
    router = NativeRouter(lance.dataset(uri), NUM_REGIONS, durable_write=False)  # a region per bucket
    for _ in range(args.rounds):
        put = rows(rng.choice(2 * args.base, args.rows, replace=False), rng)
        router.put(put)
        router.close()  # flushes each bucket's MemTable: one generation per region
        router.open.clear()  # the next round claims the same regions again
        model["value"].update(zip(put.column("id").to_pylist(), put.column("value").to_pylist(), strict=True))
    generations = sum(len(r.flushed_generations) for r in mw.open_table(uri).status()["regions"])
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    ctx.register_table("plain", lance.FFILanceTableProvider(lance.dataset(uri)))
    got = ctx.sql("SELECT id, value FROM t").to_arrow_table()
    ours = dict(zip(got.column("id").to_pylist(), got.column("value").to_pylist(), strict=True))
    if got.num_rows != len(ours) or ours != model["value"]:
        print(f"WRONG ANSWER: {got.num_rows} rows, {len(ours)} keys, model {len(model['value'])} keys")
        return 1
    times: dict[str, list[float]] = {"memwal_df SQL (base + generations)": [], "plain Lance (base only)": []}
    for _ in range(args.repeat):
        for name, sql in zip(times, ("SELECT * FROM t", "SELECT * FROM plain"), strict=True):
            t0 = time.perf_counter()
            ctx.sql(sql).to_arrow_table()
            times[name].append(time.perf_counter() - t0)
    ours_ms, plain_ms = (statistics.median(v) * 1000 for v in times.values())
    print(f"{args.base:,} base rows, {generations} generations written by Lance's mem_wal_writer")
    print(f"SELECT *: memwal_df {ours_ms:.1f} ms, plain Lance over the base {plain_ms:.1f} ms")
    print(f"ratio {ours_ms / plain_ms:.2f}x (target <= 1.5x); answer checked against the model")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2, help="native writer rounds (a generation each)")
    ap.add_argument("--rows", type=int, default=10_000, help="upserts per round")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", help="where the table goes (default bench/results/)")
    ap.add_argument("--keep", action="store_true", help="keep the table")
    return run_in_scratch(ap.parse_args(argv), "native-scan-", run)


if __name__ == "__main__":
    sys.exit(main())
