"""Query planning time in `consistency="snapshot"` against `"latest"`, on a local disk and on a moto S3
server started by this script (127.0.0.1). Nothing is asserted: it prints medians in milliseconds.

The table has `--regions` bucket regions, each with one flushed generation, and a MemWAL index
snapshot built by `build_index` (inline up to 100 regions, an `_indices/` file above). "plan" is
`MemWalTable.get_fragments(filter)` (what DataFusion calls once per query): the base version, the
region states (every region manifest, or the index snapshot) and the operator plan. Both modes are
timed alternately in the same run, so the ratio is meaningful on a loaded machine.

    python bench/snapshot_mode.py [--regions 200] [--queries 30] [--no-s3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import memwal_df as mw
from memwal_df.read.lsm.snapshot import take_snapshot


def build(uri: str, regions: int, options: dict[str, str] | None) -> mw.Table:
    ids = np.arange(20 * regions, dtype=np.int64)
    data = pa.table({"id": ids, "v": ids.astype(np.float64)})
    t = mw.create_table(uri, data, "id", region_spec=mw.bucket("id", regions), storage_options=options)
    with t.writer(durable=False) as w:
        w.put(data.slice(0, 10 * regions))
    start = time.perf_counter()
    built = t.build_index()
    took = time.perf_counter() - start
    print(
        f"  build_index: {took * 1e3:.0f} ms, {built.regions} regions, "
        f"{built.snapshot_bytes} B, {built.location}"
    )
    return t


def timed_plans(t: mw.Table, queries: int) -> dict[str, float]:
    """Median planning ms per (mode, query shape), modes interleaved."""
    shapes = {"scan": None, "lookup": pc.field("id") == 7}
    tables = {m: mw.MemWalTable(t, consistency=m) for m in ("latest", "snapshot")}
    assert take_snapshot(t, "snapshot").consistency == "snapshot"
    times: dict[str, list[float]] = {f"{m} {s}": [] for m in tables for s in shapes}
    for _ in range(queries):
        for s, flt in shapes.items():
            for m, table in tables.items():
                start = time.perf_counter()
                table.get_fragments(flt)
                times[f"{m} {s}"].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def report(where: str, medians: dict[str, float]) -> None:
    for shape in ("scan", "lookup"):
        latest, snap = medians[f"latest {shape}"], medians[f"snapshot {shape}"]
        print(
            f"  {where:5} {shape:6}  latest {latest:8.1f} ms   snapshot {snap:8.1f} ms   "
            f"ratio {latest / snap:5.1f}x"
        )


def moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(
        [*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", type=int, default=200)
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    print(f"regions={args.regions} queries={args.queries} cpus={os.cpu_count()}")
    root = tempfile.mkdtemp(prefix="memwal-snapmode-")
    try:
        t = build(os.path.join(root, "t"), args.regions, None)
        report("local", timed_plans(t, args.queries))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.no_s3:
        return
    import boto3

    proc, endpoint = moto()
    try:
        options = {
            "aws_endpoint": endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "aws_region": "us-east-1",
            "allow_http": "true",
        }
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        t = build(f"s3://{bucket}/t", args.regions, options)
        report("s3", timed_plans(t, args.queries))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
