"""Spark pipeline benchmark: ingest and read rows/s through Spark next to the single-process peers.

On the reference workload's data (docs/performance.md: id, category, value, text, vec float32x64;
4 bucket regions), in one run and on the same disk:

* ingest: `--rows` upserts (half updates of base keys, half new keys) into a table whose base holds
  `--base` rows, (a) through Spark, `memwal_df.spark.write` (routing, shuffle, one task per region,
  durable writes, a flush per region at the end), (b) through Spark, the unrouted
  `df.write.format("memwal").mode("append").save(uri)` (no shuffle: each task stages its partition
  per region and writes the regions one at a time under the job's region leases; a generation per
  task and region), and (c) through one process's `TableWriter` (durable, `--batch`-row puts, closed
  at the end). The Spark DataFrame is cached and counted before the clock starts, so no side pays
  for producing its input, and both write paths run once on a scratch table first (Python workers
  started); all end with everything flushed, and the three tables are checked equal.
* read: every live row of the ingested table (base + unmerged generations, all columns), (a) through
  `spark.read.format("memwal")` into Spark's no-op sink and (b) through `MemWalTable` with DataFusion
  (`SELECT *`), read back fully.

Spark runs as `local[2]` (the machine has 2 cores); its per-job overhead (planning, Python workers,
shuffle) is part of what it measures. No timing is asserted: the script reports, with ratios
between figures of the same run.

    python bench/spark.py --small            # base 20k, 20k upserts
    python bench/spark.py                    # base 100k, 100k upserts
    python bench/spark.py --partitions 8     # the input in 8 partitions (unrouted: 8 tasks)
    python bench/spark.py --json bench/results/spark.json

`--stream` measures the streaming sink instead (`bench/_spark_stream.py`): a `rate` source into
`df.writeStream.format("memwal")`, sustained rows/s and the latency from a row entering the source
to a `MemWalTable` reader seeing it (p50 / p99):

    python bench/spark.py --stream               # 30 s at 2000 rows/s, 1 s trigger
    python bench/spark.py --stream --stream-full # 120 s at 10000 rows/s
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import datafusion
import pyarrow as pa
import pyarrow.compute as pc
from _spark_stream import region_write_costs, stream_benchmark
from _workload import NUM_REGIONS, git_state, make_workload, scratch_root

import memwal_df as mw
from memwal_df import spark as mws


def spark_frame(spark, table: pa.Table, partitions: int | None = None):
    """`table` as a cached Spark DataFrame (vectors as array<float>; `partitions` round-robin
    partitions, else Spark's default), materialized."""
    columns = [
        c.cast(pa.list_(c.type.value_type)) if pa.types.is_fixed_size_list(c.type) else c
        for c in table.columns
    ]
    df = spark.createDataFrame(pa.Table.from_arrays(columns, names=table.column_names))
    df = (df.repartition(partitions) if partitions else df).cache()
    df.count()
    return df


def warm_up(spark, path: Path, schema: pa.Schema, rows: pa.Table) -> None:
    """Both Spark write paths once on a scratch table, so that neither timed job pays for starting
    Python workers and importing memwal_df / pylance in them."""
    for way in ("routed", "unrouted"):
        uri = str(path / way)
        mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", NUM_REGIONS))
        small = spark_frame(spark, rows)
        if way == "routed":
            mws.write(small, uri)
        else:
            small.write.format("memwal").mode("append").save(uri)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--base", type=int, default=100_000)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=10_000, help="TableWriter put size (Spark's Arrow batch)")
    p.add_argument("--partitions", type=int, default=None, help="input partitions (default: Spark's)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--stream", action="store_true", help="measure the streaming sink instead")
    p.add_argument("--stream-full", action="store_true", help="the full streaming run (120 s, 10k rows/s)")
    p.add_argument("--stream-seconds", type=float, default=30.0)
    p.add_argument("--stream-rate", type=int, default=2000, help="rows per second entering the source")
    p.add_argument("--stream-trigger", default="1 second", help="the processing-time trigger interval")
    p.add_argument("--stream-warmup", type=float, default=5.0, help="seconds left out after 3 batches")
    args = p.parse_args()
    if args.stream or args.stream_full:
        return stream_main(args)
    if args.small:
        args.base, args.rows = 20_000, 20_000
    work = make_workload(args.base, args.rows, args.batch, singles=0)
    upserts = pa.concat_tables(work.batches).combine_chunks()
    root = scratch_root(args.dir, "spark-")
    spark = mws.session(master="local[2]", conf={"spark.sql.execution.arrow.maxRecordsPerBatch": args.batch})
    try:
        uris = {}
        for name in ("spark", "unrouted", "writer"):
            uris[name] = str(root / name)
            mw.create_table(uris[name], work.base, "id", region_spec=mw.bucket("id", NUM_REGIONS))
        df = spark_frame(spark, upserts, args.partitions)
        partitions = df.rdd.getNumPartitions()
        warm_up(spark, root / "warm-up", work.base.schema, upserts.slice(0, 1000))

        def python_ingest() -> None:
            with mw.open_table(uris["writer"]).writer(durable=True) as w:
                for batch in work.batches:
                    w.put(batch)

        def unrouted_ingest() -> None:
            df.write.format("memwal").mode("append").save(uris["unrouted"])

        ingest = {
            "spark": timed(lambda: mws.write(df, uris["spark"])),
            "unrouted": timed(unrouted_ingest),
            "writer": timed(python_ingest),
        }
        # keys upserted twice (in two batches) may end with either row in Spark: compare the others
        values, counts = pc.value_counts(upserts.column("id")).flatten()
        twice = values.filter(pc.greater(counts, 1))
        tables = {name: mw.MemWalTable(uri).to_table().sort_by("id") for name, uri in uris.items()}
        for name, got in tables.items():
            assert got.column("id").equals(tables["writer"].column("id")), name
            once = pc.invert(pc.is_in(got.column("id"), twice))
            assert got.filter(once).equals(tables["writer"].filter(once)), name
        live = tables["spark"].num_rows
        generations = {
            name: sum(len(r.flushed_generations) for r in mw.open_table(uri).status()["regions"])
            for name, uri in uris.items()
        }

        def spark_read() -> None:
            spark.read.format("memwal").load(uris["spark"]).write.format("noop").mode("overwrite").save()

        def datafusion_read() -> None:
            ctx = datafusion.SessionContext()
            ctx.register_table("t", mw.MemWalTable(uris["spark"]))
            assert ctx.sql("SELECT * FROM t").to_arrow_table().num_rows == live

        read = {"spark": timed(spark_read), "memwaltable": timed(datafusion_read)}
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "git": git_state(),
        "base_rows": args.base,
        "upsert_rows": args.rows,
        "live_rows": live,
        "ingest_rows_per_s": {k: args.rows / v for k, v in ingest.items()},
        "ingest_spark_over_writer": ingest["writer"] / ingest["spark"],
        "ingest_unrouted_over_spark": ingest["spark"] / ingest["unrouted"],
        "spark_partitions": partitions,
        "generations": generations,
        "read_rows_per_s": {k: live / v for k, v in read.items()},
        "read_spark_over_memwaltable": read["memwaltable"] / read["spark"],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def stream_main(args: argparse.Namespace) -> int:
    if args.stream_full:
        args.stream_seconds, args.stream_rate = 120.0, 10_000
    root = scratch_root(args.dir, "spark-stream-")
    conf = {"spark.sql.streaming.numRecentProgressUpdates": 10_000}
    spark = mws.session(master="local[2]", conf=conf)
    try:
        figures = stream_benchmark(
            spark, root, args.stream_seconds, args.stream_rate, args.stream_trigger, args.stream_warmup
        )
        figures["region_write"] = region_write_costs(root)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    result = {"git": git_state(), "trigger": args.stream_trigger, **figures}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
