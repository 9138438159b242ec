"""Point lookups and vector search right after a merge, with one long-lived reader.

The reference-workload base (bench/_workload.py: `base-rows` rows, btree on `id`, IVF_PQ on `vec`) is
built once into `--dir`/base and copied for each run. Then, per round: `--upserts` upserts (half
updates of base keys, half new keys) through a durable writer over 4 bucket regions, a flush, and a
merge of every flushed generation (the merger job), so the base index falls behind the merges. After
each round, one `MemWalTable` and one DataFusion `SessionContext` kept for the whole run time the
first point lookup (`SELECT * FROM t WHERE id = k`), then `--lookups` more, the first
`vector_search`, then `--searches` more. Every lookup is checked against the rows written (a model
of the newest row per key); "key rows read" is what the base key index read to follow the merge
(`memwal_df.read.lsm.base_key_index.BASE_KEYS.rows_read`). Nothing is asserted on timings: the script prints
one line per round.

    python bench/after_merge.py --dir /tmp/after-merge [--base-rows 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import datafusion
import lance
import numpy as np
from _cli import add_int_args
from _workload import DIM, NUM_REGIONS, make_rows, make_workload

import memwal_df as mw
from memwal_df.read.lsm.base_key_index import BASE_KEYS as STATS

K = 10


def base_copy(directory: Path, base_rows: int, partitions: int) -> mw.Table:
    """A fresh copy of the indexed base table (built into `directory`/base the first time)."""
    built = directory / f"base-{base_rows}"
    if not built.exists():
        wl = make_workload(base_rows, 0, 1000, 0)
        t = mw.create_table(str(built), wl.base, primary_key="id", region_spec=mw.bucket("id", NUM_REGIONS))
        ds = lance.dataset(t.uri)
        ds.create_scalar_index("id", "BTREE")
        ds.create_index("vec", "IVF_PQ", num_partitions=partitions, num_sub_vectors=16)
    run = directory / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(built, run)
    return mw.Table(str(run))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the base is built once and copied per run")
    add_int_args(
        ap, base_rows=1_000_000, rounds=5, upserts=10_000, lookups=20, searches=10, partitions=256, nprobes=20
    )
    args = ap.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    t = base_copy(directory, args.base_rows, args.partitions)
    print(f"base ready in {time.perf_counter() - t0:.0f} s")
    rng = np.random.default_rng(3)
    vocab = ["ka", "lo", "mi", "ne"]
    model: dict[int, float] = {}  # key -> value of the newest write
    next_id = args.base_rows
    table = mw.MemWalTable(t.uri)
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", table)

    def lookup(k: int) -> float:
        s = time.perf_counter()
        got = ctx.sql(f"SELECT id, value FROM t WHERE id = {k}").to_arrow_table()
        took = time.perf_counter() - s
        want = model.get(k)
        if want is not None and got.column("value").to_pylist() != [want]:
            raise AssertionError(f"lookup of {k}: {got.to_pylist()} but the newest write has value {want}")
        if got.num_rows != 1:
            raise AssertionError(f"lookup of {k}: {got.num_rows} rows")
        return took

    def search() -> float:
        q = rng.standard_normal(DIM, dtype=np.float32)
        lit = "[" + ",".join(f"{x:.7g}" for x in q) + "]"
        s = time.perf_counter()
        got = ctx.sql(
            f"SELECT id FROM vector_search('t', 'vec', {lit}, {K}, named_struct('nprobes', {args.nprobes}))"
        ).to_arrow_table()
        took = time.perf_counter() - s
        if got.num_rows != K:
            raise AssertionError(f"vector_search returned {got.num_rows} rows")
        return took

    columns = ["round", "merge s", "lookup first ms", "lookup p50 ms", "search first ms", "search p50 ms"]
    print("| " + " | ".join([*columns, "key rows read"]) + " |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    lookup(0), search()  # the frozen table, warmed
    for r in range(args.rounds):
        n_upd = args.upserts // 2
        ids = np.concatenate(
            [
                rng.choice(args.base_rows, n_upd, replace=False),
                np.arange(next_id, next_id + args.upserts - n_upd),
            ]
        ).astype(np.int64)
        next_id += args.upserts - n_upd
        rows = make_rows(rng, ids, vocab)
        with t.writer(durable=True, max_memtable_rows=2 * args.upserts) as w:
            w.put(rows)
            w.flush()
        model.update(zip(ids.tolist(), rows.column("value").to_pylist(), strict=True))
        s = time.perf_counter()
        t.merge()
        merge_s = time.perf_counter() - s
        updated = ids[:n_upd]
        probes = rng.choice(updated, args.lookups + 1, replace=False).tolist()
        read = STATS.rows_read
        first = lookup(probes[0])
        rest = [lookup(k) for k in probes[1:]]
        first_search = search()
        searches = [search() for _ in range(args.searches)]
        print(
            f"| {r + 1} | {merge_s:.1f} | {ms(first)} | {ms(float(np.median(rest)))} | "
            f"{ms(first_search)} | {ms(float(np.median(searches)))} | {STATS.rows_read - read} |",
            flush=True,
        )
    print(f"base v{lance.dataset(t.uri).version}")


if __name__ == "__main__":
    main()
