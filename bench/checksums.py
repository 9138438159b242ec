"""What the generation checksums cost: the first reads of generations (their files verified against
the checksum sidecar), a merge (every generation verified before it is read), a generation write
(the sidecar: every file read back and checksummed), each with verification on and off.

One region, `--rows` rows in `--gens` generations of equal size (id, a float, a 40-character string)
over a base of `--base` rows. Every measurement runs in a fresh process (nothing verified yet, no
reader cache), on the same files (in the page cache: the extra reads are memory reads here); the
variants take turns, `--reps` times each; the figures are medians. "off" is the code without
verification (`checksums.verify_generation` answers at once, no sidecar is written).

    PYTHONPATH=. python bench/checksums.py [--rows N] [--gens N] [--base N] [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

VARIANTS = ("off", "on")
TASKS = {
    "lookup_oldest": "first point lookup of a key of the oldest generation (every generation's bloom filter)",
    "lookup_newest": "first point lookup of a key of the newest generation (one generation)",
    "lookup_warm": "a second point lookup of the oldest generation, same process",
    "scan": "first full scan, SELECT sum(v), count(s)",
    "merge": "merge of every generation into the base",
    "write": "writing one generation (write_generation)",
    "verify": "checksums.verify_generation of every generation, alone",
}
REGION = uuid.UUID(int=7)


def rows(keys: np.ndarray, tag: float) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(keys, pa.int64()),
            "v": keys.astype(np.float64) + tag,
            "s": pa.array([f"{k:040d}" for k in keys]),
        }
    )


def patch(variant: str) -> None:
    """Turn verification off for the "off" variant."""
    if variant == "off":
        from memwal_df.format import checksums
        from memwal_df.write import generation

        checksums.verify_generation = lambda *a, **k: checksums.VERIFIED  # type: ignore[assignment]
        generation.write_checksums = lambda *a, **k: None  # type: ignore[assignment]


def build(uri: str, args: argparse.Namespace) -> None:
    import memwal_df as mw

    table = mw.create_table(uri, rows(np.arange(args.base) + 10_000_000, 0.0), "id")
    per = args.rows // args.gens
    with table.region_writer(REGION, durable=False) as w:
        for g in range(args.gens):
            w.put(rows(np.arange(g * per, (g + 1) * per), 0.5))
            w.flush()


def child(task: str, uri: str, args: argparse.Namespace) -> tuple[float, float]:
    """(wall, CPU) seconds of one `task` on the table at `uri` (this process has read nothing yet)."""
    import datafusion

    import memwal_df as mw

    per = args.rows // args.gens
    if task == "verify":
        from memwal_df.format import checksums, layout
        from memwal_df.format.manifest import RegionManifestStore

        table = mw.open_table(uri)
        m = RegionManifestStore(table.storage, REGION).latest()
        assert m is not None
        rels = [(s.generation, layout.generation_path(REGION, s.path)) for s in m.sstables]
        return timed(lambda: [checksums.verify_generation(table.storage, REGION, g, rel) for g, rel in rels])
    if task == "merge":
        table = mw.open_table(uri)
        return timed(table.merge)
    if task == "write":
        from memwal_df.format.open_storage import open_storage
        from memwal_df.write.generation import write_generation
        from memwal_df.write.memtable import MemTable

        table = mw.open_table(uri)
        memtable = MemTable(args.gens + 1, table.schema.wal, table.schema.primary_key)
        data = rows(np.arange(per) + 5_000_000, 0.5)
        data = data.append_column("_tombstone", pa.array(np.zeros(per, bool)))
        for batch in data.cast(table.schema.wal).to_batches():
            memtable.append(batch)
        memtable.seal()
        memtable.newest()
        storage = open_storage(uri, None)
        return timed(lambda: write_generation(storage, REGION, memtable, table.data_storage_version))
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri))
    sql = {
        "lookup_oldest": "SELECT * FROM t WHERE id = 17",
        "lookup_newest": f"SELECT * FROM t WHERE id = {(args.gens - 1) * per + 17}",
        "lookup_warm": "SELECT * FROM t WHERE id = 18",
        "scan": "SELECT sum(v), count(s) FROM t",
    }[task]
    if task == "lookup_warm":
        mw.query(ctx, "SELECT * FROM t WHERE id = 17")
    return timed(lambda: mw.query(ctx, sql))


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of the process) of `fn()`."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def run_child(variant: str, task: str, uri: str, argv: list[str]) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, task, uri, *argv],
        check=True,
        capture_output=True,
        text=True,
    )
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--gens", type=int, default=4)
    p.add_argument("--base", type=int, default=100_000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json")
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "TASK", "URI"))
    args = p.parse_args()
    if args.child:
        variant, task, uri = args.child
        patch(variant)
        if task == "build":
            build(uri, args)
            print(json.dumps([0.0, 0.0]))
        else:
            print(json.dumps(child(task, uri, args)))
        return
    argv = ["--rows", str(args.rows), "--gens", str(args.gens), "--base", str(args.base)]
    root = Path(tempfile.mkdtemp(prefix="memwal-checksums-"))
    try:
        tables = {v: str(root / v) for v in VARIANTS}
        for v in VARIANTS:
            run_child(v, "build", tables[v], argv)
        times: dict[str, dict[str, list[tuple[float, float]]]] = {t: {v: [] for v in VARIANTS} for t in TASKS}
        for rep in range(args.reps):
            for task in TASKS:
                for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                    uri = tables[v]
                    if task in ("merge", "write"):  # they change the table: a fresh copy each time
                        uri = str(root / f"{v}-copy")
                        shutil.rmtree(uri, ignore_errors=True)
                        shutil.copytree(tables[v], uri)
                    times[task][v].append(run_child(v, task, uri, argv))
        result = {
            t: {v: [statistics.median(x[i] for x in times[t][v]) for i in (0, 1)] for v in VARIANTS}
            for t in TASKS
        }
        print(f"{args.rows:,} rows in {args.gens} generations, base {args.base:,}; medians of {args.reps}")
        print(f"{'':15}{'wall off':>9}{'on':>7}{'on/off':>7}{'cpu off':>9}{'on':>7}{'on/off':>7}  (ms)  what")
        for t, what in TASKS.items():
            (w0, c0), (w1, c1) = ([x * 1e3 for x in result[t][v]] for v in VARIANTS)
            if t == "verify":  # nothing to compare: off does not verify
                print(f"{t:15}{'-':>9}{w1:7.1f}{'':7}{'-':>9}{c1:7.1f}{'':7}        {what}")
                continue
            print(f"{t:15}{w0:9.1f}{w1:7.1f}{w1 / w0:7.2f}{c0:9.1f}{c1:7.1f}{c1 / c0:7.2f}        {what}")
        gens = root / "on" / "_mem_wal" / str(REGION)
        size = sum(f.stat().st_size for d in gens.glob("*_gen_*") for f in d.rglob("*") if f.is_file())
        wall, cpu = result["verify"]["on"]
        mb = size / 1e6
        print(f"verification reads {mb:.1f} MB: {mb / wall:,.0f} MB/s wall, {mb / cpu:,.0f} MB/s CPU")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "medians_s": result, "runs_s": times}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
