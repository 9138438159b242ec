"""The streaming sink's figures for `bench/spark.py --stream`: sustained rows/s and end-to-end latency.

Spark's `rate` source emits `--stream-rate` rows per second, each stamped with the time it entered the
source (`unix_micros(timestamp)`, stored in the column `entered`); a query writes them into a
`bucket(id, 4)` table with `df.writeStream.format("memwal")` under a processing-time trigger. Every
row is a new key (`id` = the rate source's counter), so a row's visibility is a plain fact. A reader
thread polls `SELECT id, entered FROM t WHERE id >= <oldest id not yet seen>` through `MemWalTable`
(the durable levels: base + flushed generations, as another process sees them) every `POLL_S`; a row's
latency is the start of the first poll that returned it minus its `entered` time (so it is an upper
bound, by at most one poll interval). Measuring starts `--stream-warmup` seconds after the query's
first `WARMUP_BATCHES` batches (Python workers starting, the backlog of the start written) and
lasts `--stream-seconds`; only rows that entered the source after it started count.

Figures: input rate, rows that became visible per second between the first and the last poll that
found rows (sustained), Spark's own rows
per second of batch time (the capacity: `numInputRows / triggerExecution`), the batch time and the
sink's share of it (`addBatch`: staging, a claim, a flush and a generation per task and region, and
the commit record) at p50, and the latency p50 / p99.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import datafusion
import numpy as np
import pyarrow as pa
from _workload import NUM_REGIONS
from pyspark.sql import functions as F

import memwal_df as mw
from memwal_df.write.table_writer import group_by_region

POLL_S = 0.1
WARMUP_BATCHES = 3
SCHEMA = pa.schema(
    [("id", pa.int64()), ("entered", pa.int64()), ("amount", pa.float64()), ("text", pa.string())]
)


class Poller(threading.Thread):
    """Polls the table for rows not seen yet and records each new row's latency (µs)."""

    def __init__(self, uri: str, capacity: int) -> None:
        super().__init__(daemon=True)
        self.ctx = datafusion.SessionContext()
        self.ctx.register_table("t", mw.MemWalTable(uri))
        self.seen = np.zeros(capacity, dtype=bool)
        self.entered = np.zeros(capacity, dtype=np.int64)
        self.visible = np.zeros(capacity, dtype=np.int64)
        self.low = 0
        self.stop = threading.Event()

    def poll(self) -> None:
        start_us = int(time.time() * 1e6)
        got = self.ctx.sql(f"SELECT id, entered FROM t WHERE id >= {self.low}").to_arrow_table()
        ids = got.column("id").to_numpy()
        ids_ok = ids < len(self.seen)
        ids, entered = ids[ids_ok], got.column("entered").to_numpy()[ids_ok]
        new = ~self.seen[ids]
        self.seen[ids[new]] = True
        self.entered[ids[new]] = entered[new]
        self.visible[ids[new]] = start_us
        unseen = np.flatnonzero(~self.seen[self.low :])
        self.low += int(unseen[0]) if len(unseen) else len(self.seen) - self.low

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            time.sleep(POLL_S)


def stream_benchmark(spark: Any, root: Path, seconds: float, rate: int, trigger: str, warmup: float) -> dict:
    """Run the rate -> memwal query for `seconds` (+ `warmup`) and measure it (module docstring)."""
    uri = str(root / "stream")
    mw.create_table(uri, SCHEMA, "id", region_spec=mw.bucket("id", NUM_REGIONS))
    source = spark.readStream.format("rate").option("rowsPerSecond", rate).option("numPartitions", 2).load()
    rows = source.select(
        F.col("value").alias("id"),
        F.unix_micros("timestamp").alias("entered"),
        (F.col("value") * 0.5).alias("amount"),
        F.concat(F.lit("row "), F.col("value").cast("string")).alias("text"),
    )
    began = time.time()
    query = (
        rows.writeStream.format("memwal")
        .option("checkpointLocation", str(root / "checkpoint"))
        .trigger(processingTime=trigger)
        .start(uri)
    )
    while len(query.recentProgress) < WARMUP_BATCHES:  # Python workers started, backlog written
        time.sleep(0.1)
    time.sleep(warmup)
    poller = Poller(uri, int((time.time() - began + seconds + 60) * rate))
    poller.start()
    started_us = int(time.time() * 1e6)
    time.sleep(seconds)
    query.stop()
    poller.stop.set()
    poller.join()
    poller.poll()
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    return summarize(poller, [p for p in progress if p["timestamp"] >= _iso(started_us)], started_us, rate)


def _iso(micros: int) -> str:
    """Spark's progress timestamp format (UTC), comparable as text."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(micros / 1e6)) + f".{micros // 1000 % 1000:03d}Z"


def region_write_costs(root: Path, rows_per_write: int = 250, writes: int = 20) -> dict:
    """Median ms of the three steps a stream task runs per region, in this process: the claim
    (`table.region_writer`), a put of `rows_per_write` rows, and the flush and close."""
    table = mw.create_table(str(root / "costs"), SCHEMA, "id", region_spec=mw.bucket("id", NUM_REGIONS))
    steps: dict[str, list[float]] = {"claim_ms": [], "put_ms": [], "flush_close_ms": []}
    for i in range(writes):
        ids = i * NUM_REGIONS * rows_per_write + np.arange(NUM_REGIONS * rows_per_write)
        data = pa.table({"id": ids, "entered": ids, "amount": ids * 0.5, "text": ids.astype(str)})
        values, rows = group_by_region(table.spec, table.schema.field_ids, data.cast(SCHEMA))[0]
        a = time.perf_counter()
        writer = table.region_writer(values=values)
        b = time.perf_counter()
        writer.put(rows)
        c = time.perf_counter()
        writer.close()
        for name, took in zip(steps, (b - a, c - b, time.perf_counter() - c), strict=True):
            steps[name].append(took * 1000)
    return {name: float(np.median(v)) for name, v in steps.items()}


def summarize(poller: Poller, progress: list[dict], since_us: int, rate: int) -> dict:
    measured = poller.seen & (poller.entered >= since_us)
    latency_ms = (poller.visible[measured] - poller.entered[measured]) / 1000
    polls = np.unique(poller.visible[poller.seen])  # start times of the polls that found rows
    later = poller.seen & (poller.visible > polls[0])  # became visible after the first poll
    window = (polls[-1] - polls[0]) / 1e6
    batches = [p for p in progress if p["durationMs"].get("triggerExecution")]
    rows = sum(p["numInputRows"] for p in batches)
    batch_s = sum(p["durationMs"]["triggerExecution"] for p in batches) / 1000
    return {
        "input_rows_per_s": rate,
        "rows_visible": int(measured.sum()),
        "sustained_rows_per_s": float(later.sum() / window) if window > 0 else 0.0,
        "capacity_rows_per_s": rows / batch_s if batch_s else 0.0,
        "batches": len(batches),
        "batch_ms_p50": float(np.median([p["durationMs"]["triggerExecution"] for p in batches])),
        "sink_ms_p50": float(np.median([p["durationMs"].get("addBatch", 0) for p in batches])),
        "rows_per_batch_p50": float(np.median([p["numInputRows"] for p in batches])),
        "latency_ms_p50": float(np.percentile(latency_ms, 50)) if len(latency_ms) else float("nan"),
        "latency_ms_p99": float(np.percentile(latency_ms, 99)) if len(latency_ms) else float("nan"),
        "poll_interval_ms": POLL_S * 1000,
    }
