"""The main job of `make demo`: a MemWAL table in a local directory, streamed upserts and deletes
through several regions, flushed into generations, then read back through DataFusion SQL and checked.

Usage: python examples/demo.py [DIRECTORY]   (default: ./demo-data, recreated on every run)
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import datafusion
import numpy as np
import pyarrow as pa

import memwal_df as mw

ROWS, BATCH = 50_000, 1_000


def batch(rng: np.random.Generator, ids: np.ndarray, round_: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "category": pa.array([f"cat{i % 7}" for i in ids]),
            "value": pa.array(rng.random(len(ids))),
            "round": pa.array(np.full(len(ids), round_, np.int32)),
        }
    )


def read_back(root: Path) -> tuple[dict[int, dict], datafusion.SessionContext]:
    """Every live row through DataFusion SQL: MemWalTable merges the base table and all generations."""
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(str(root)))
    rows = ctx.sql("SELECT * FROM t").to_arrow_table().to_pylist()
    return {r["id"]: r for r in rows}, ctx


def main(directory: str) -> int:
    root = Path(directory).resolve()
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(7)
    base = batch(rng, np.arange(0, 10_000), 0)
    t0 = time.perf_counter()
    table = mw.create_table(str(root), base, primary_key="id", region_spec=mw.bucket("id", 4))
    took = time.perf_counter() - t0
    print(f"created {root} with {base.num_rows} base rows, region spec bucket(id, 4) in {took:.2f}s")

    model = {r["id"]: r for r in base.to_pylist()}
    t0 = time.perf_counter()
    written = deleted = 0
    with table.writer(durable=True, max_memtable_rows=20_000) as w:
        for round_ in range(1, ROWS // BATCH + 1):
            ids = rng.choice(60_000, BATCH, replace=False)
            b = batch(rng, ids, round_)
            w.put(b)
            model.update({r["id"]: r for r in b.to_pylist()})
            written += BATCH
            if round_ % 10 == 0:
                gone = rng.choice(60_000, 100, replace=False)
                w.delete(pa.array(gone, pa.int64()))
                for k in gone.tolist():
                    model.pop(k, None)
                deleted += len(gone)
    elapsed = time.perf_counter() - t0
    rate = written / elapsed
    print(f"streamed {written} upserts and {deleted} deletes durably in {elapsed:.2f}s ({rate:,.0f} rows/s)")

    print("\nregion                                epoch  manifest v  generations  WAL replay-after")
    for st in table.status()["regions"]:
        gens = ",".join(str(g) for g, _ in st.flushed_generations)
        replay = st.replay_after_wal_entry_position
        print(f"{st.region_id}  {st.writer_epoch:>5}  {st.manifest_version:>10}  {gens:>11}  {replay:>16}")

    t0 = time.perf_counter()
    got, ctx = read_back(root)
    print(f"\nread back {len(got)} live rows with SELECT * in {time.perf_counter() - t0:.2f}s")
    if got != model:
        missing = set(model) - set(got)
        print(f"MISMATCH: {len(missing)} keys missing, {len(set(got) - set(model))} unexpected")
        return 1
    sample = sorted(got)[:3]
    for k in sample:
        print(f"  id={k}: {got[k]}")
    query = f"SELECT * FROM t WHERE id IN ({', '.join(map(str, sample))})"
    t0 = time.perf_counter()
    looked_up = ctx.sql(query).to_arrow_table().to_pylist()
    print(f"{query}: {len(looked_up)} rows in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    print(
        "plan:",
        *ctx.sql("SELECT * FROM memwal_explain('t', 'id = 0')").to_arrow_table()["line"].to_pylist()[:4],
        sep="\n  ",
    )
    if {r["id"]: r for r in looked_up} != {k: model[k] for k in sample}:
        print("MISMATCH in the point lookup")
        return 1
    print("read-back equals the model of every write: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "demo-data"))
