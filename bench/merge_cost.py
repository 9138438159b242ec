"""Time `create_table` and merges on a local table: a 200,000-row base (`id`, `value`, `vec`
float32x32) in 4 bucket regions, then 8 rounds of one flushed 2,000-row generation (90% existing keys)
merged by `table.merge()`. Prints one JSON line: the create time and the merge p50 in seconds.

Run it from two checkouts in turn to compare them:

    python bench/merge_cost.py
    PYTHONPATH=/path/to/other/checkout python bench/merge_cost.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

import memwal_df as mw


def _rows(rng: np.random.Generator, keys: np.ndarray) -> pa.Table:
    n = len(keys)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 32, dtype=np.float32)), 32)
    return pa.table({"id": pa.array(keys, pa.int64()), "value": rng.random(n), "vec": vec})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2_000)
    ap.add_argument("--dir", help="where the table goes (default: a temp directory)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        base = _rows(rng, np.arange(args.base))
        t0 = time.perf_counter()
        table = mw.create_table(f"{root}/t", base, "id", region_spec=mw.bucket("id", 4))
        create = time.perf_counter() - t0
        merges = []
        for _ in range(args.rounds):
            old = rng.choice(args.base, args.rows * 9 // 10, replace=False)
            new = rng.integers(args.base, 2 * args.base, args.rows - len(old))
            with table.writer() as w:
                w.put(_rows(rng, np.unique(np.concatenate([old, new]))))
            t0 = time.perf_counter()
            table.merge()
            merges.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"create_s": round(create, 4), "merge_p50_s": round(statistics.median(merges), 4)}))


if __name__ == "__main__":
    main()
