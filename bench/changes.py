"""Change-feed benchmark: how fast `table.changes()` (and Spark's `changes_since` read) delivers changes.

On the reference workload's data (docs/performance.md: id, category, value, text, vec float32x64;
bucket regions), a table whose base holds `--base` rows takes `--rows` upserts through one
`TableWriter` (`--batch`-row puts), flushed every `--flush-every` puts, so the feed holds
rows / batch / flush-every generations per region. Then, each median of `--repeat` runs:

* full read: every change from "earliest" (`table.changes().read_all()`), all columns, and the key
  column only (`columns=[]`);
* empty poll: a read from the latest offsets when nothing new was flushed (planning: one manifest
  read per region), what each trigger of a streaming consumer pays;
* one more flush: one `--batch`-row put and a flush, then the read of just those changes from the
  offsets before them;
* with `--spark`: `spark.read.format("memwal").option("changes_since", "earliest")` into Spark's
  no-op sink on `local[2]` (one warm-up read first); then a streaming query of the feed
  (`--trigger-ms` processing-time trigger, `foreachBatch`) and `--stream-flushes` times one
  `--batch`-row put and a flush: the seconds from the put's start until the query received every
  generation of that flush, p50 and p99.

No timing is asserted: the script reports.

    python bench/changes.py --small          # base 10k, 20k upserts
    python bench/changes.py --spark          # base 20k, 100k upserts, with the Spark read
    python bench/changes.py --json bench/results/changes.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _cli import add_int_args
from _workload import git_state, make_workload, scratch_root

import memwal_df as mw


def timed(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    """Median seconds of `repeat` calls of `fn`, and the row count it returned last."""
    samples, rows = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), rows


def build(uri: str, args: argparse.Namespace) -> tuple[mw.Table, Any]:
    work = make_workload(args.base, args.rows, args.batch, singles=1)
    table = mw.create_table(uri, work.base, "id", region_spec=mw.bucket("id", args.regions))
    with table.writer() as w:
        for i, batch in enumerate(work.batches, 1):
            w.put(batch)
            if i % args.flush_every == 0:
                w.flush()
    return table, work


def spark_read(spark: Any, uri: str, repeat: int) -> float:
    """Median seconds of Spark reading every change into its no-op sink (after one warm-up read)."""

    def read() -> int:
        changes = spark.read.format("memwal").option("changes_since", "earliest").load(uri)
        changes.write.format("noop").mode("overwrite").save()
        return 0

    read()  # Python workers started, JVM warm
    seconds, _ = timed(read, repeat)
    return seconds


def spark_stream_latency(
    spark: Any, table: mw.Table, batches: list[Any], trigger_ms: int, checkpoint: str
) -> list[float]:
    """Seconds from each put's start (a put of one batch, then a flush) until a streaming query of
    the feed (`startingOffsets` latest, a `trigger_ms` processing-time trigger, `foreachBatch`) has
    received every generation that flush made."""
    arrived: dict[tuple[str, int], float] = {}

    def each_batch(df: Any, _: int) -> None:
        now = time.perf_counter()
        for row in df.select("_region", "_generation").distinct().collect():
            arrived.setdefault((row[0], row[1]), now)

    stream = spark.readStream.format("memwal").option("startingOffsets", "latest").load(table.uri)
    query = (
        stream.writeStream.foreachBatch(each_batch)
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=f"{trigger_ms} milliseconds")
        .start()
    )
    query.processAllAvailable()
    latencies = []
    for batch in batches:
        before = table.changes("latest").start
        t0 = time.perf_counter()
        with table.writer() as w:  # closing flushes
            w.put(batch)
        after = table.changes("latest").start
        new = {(str(r), g) for r, (end, _) in after.regions.items() for g in range(before.of(r)[0], end)}
        while not new <= arrived.keys():
            time.sleep(0.005)
        latencies.append(max(arrived[k] for k in new) - t0)
    query.stop()
    return latencies


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_args(parser, base=20_000, rows=100_000, batch=2_000, flush_every=5, regions=4, repeat=3)
    parser.add_argument("--small", action="store_true", help="base 10k, 20k upserts")
    parser.add_argument("--spark", action="store_true", help="also read the feed through Spark")
    parser.add_argument("--stream-flushes", type=int, default=20, help="--spark: flushes timed")
    parser.add_argument("--trigger-ms", type=int, default=500, help="--spark: the stream's trigger")
    parser.add_argument("--dir", help="where the table goes (default bench/results/)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.small:
        args.base, args.rows = 10_000, 20_000
    root = scratch_root(args.dir, "changes-")
    try:
        figures = run(str(root / "t"), args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, value in figures.items():
        print(f"{name:>28}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


def run(uri: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    table, work = build(uri, args)
    figures: dict[str, Any] = {"git": git_state(), "build_s": round(time.perf_counter() - t0, 2)}
    gens = sum(len(s.flushed_generations) for s in table.status(check_wal=False)["regions"])
    figures.update(base=args.base, upserts=args.rows, regions=args.regions, generations=gens)
    seconds, rows = timed(lambda: table.changes().read_all().num_rows, args.repeat)
    figures.update(changes=rows, full_read_s=round(seconds, 3), full_read_rows_per_s=round(rows / seconds))
    seconds, _ = timed(lambda: table.changes(columns=[]).read_all().num_rows, args.repeat)
    figures.update(keys_only_rows_per_s=round(rows / seconds))
    latest = table.changes("latest").start
    seconds, _ = timed(lambda: table.changes(latest).read_all().num_rows, args.repeat)
    figures.update(empty_poll_ms=round(seconds * 1000, 1))
    with table.writer() as w:
        w.put(work.batches[-1])
        w.flush()
    seconds, rows = timed(lambda: table.changes(latest).read_all().num_rows, args.repeat)
    figures.update(one_flush_rows=rows, one_flush_read_ms=round(seconds * 1000, 1))
    if args.spark:
        from memwal_df import spark as mws

        spark = mws.session(master="local[2]")
        seconds = spark_read(spark, uri, args.repeat)
        rows = table.changes().read_all().num_rows
        figures.update(spark_read_s=round(seconds, 2), spark_rows_per_s=round(rows / seconds))
        batches = [work.batches[i % len(work.batches)] for i in range(args.stream_flushes)]
        seen = spark_stream_latency(spark, table, batches, args.trigger_ms, uri + "-checkpoint")
        figures.update(
            stream_trigger_ms=args.trigger_ms,
            stream_flushes=len(seen),
            stream_latency_p50_ms=round(percentile(seen, 0.5) * 1000),
            stream_latency_p99_ms=round(percentile(seen, 0.99) * 1000),
        )
        spark.stop()
    return figures


if __name__ == "__main__":
    sys.exit(main())
