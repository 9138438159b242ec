"""Spark Structured Streaming: change events -> a memwal table -> fresh SQL, and the table's change
feed -> a mirror table.

Change events (`id`, `qty`, `deleted`, `seq`) arrive as Parquet files in an inbox directory (a Kafka
topic works the same way). One streaming query writes them into a memwal table
(`writeStream.format("memwal")`: `delete_column` marks deletes, `order_by` picks the newest event of
a key within a micro-batch) on a processing-time trigger. After each file, a DataFusion context
registered once polls the table until the file's events are visible and prints a point lookup and an
aggregate, with how long the events took to become visible. A second streaming query reads the
table's change feed (`readStream.format("memwal")`) and applies it to a mirror table in
`foreachBatch`. At the end the table, the mirror and a model of the events must agree.

Usage: python examples/spark_streaming.py [DIRECTORY]   (recreated; default: a temporary directory, removed
afterwards)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import datafusion
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession

import memwal_df as mw
from memwal_df import spark as mws

FILES, EVENTS, KEYS = 4, 400, 1_000
TABLE = pa.schema([("id", pa.int64()), ("qty", pa.float64())])
EVENT = "id BIGINT, qty DOUBLE, deleted BOOLEAN, seq BIGINT"
TRIGGER = "500 milliseconds"
VISIBLE_WITHIN_S = 120  # a generous bound for a loaded machine; the printed times are the figures


def events(rng: np.random.Generator, file: int) -> pa.Table:
    """One file of change events: upserts and some deletes, keys repeating within the file."""
    return pa.table(
        {
            "id": pa.array(rng.integers(0, KEYS, EVENTS), pa.int64()),
            "qty": pa.array(rng.random(EVENTS).round(3)),
            "deleted": pa.array(rng.random(EVENTS) < 0.15),
            "seq": pa.array(np.arange(EVENTS) + file * EVENTS, pa.int64()),
        }
    )


def apply(model: dict[int, float], batch: pa.Table) -> None:
    """What the sink does with one file: per key, the event with the greatest `seq` wins."""
    for row in sorted(batch.to_pylist(), key=lambda r: r["seq"]):
        if row["deleted"]:
            model.pop(row["id"], None)
        else:
            model[row["id"]] = row["qty"]


def publish(batch: pa.Table, inbox: Path, file: int) -> None:
    """Write a file atomically: Spark's file source skips names starting with a dot."""
    hidden = inbox / f".events-{file:04}.parquet"
    pq.write_table(batch, hidden)
    hidden.rename(inbox / f"events-{file:04}.parquet")


def rows_of(uri: str) -> dict[int, float]:
    return {r["id"]: r["qty"] for r in mw.MemWalTable(uri).to_table().to_pylist()}


def sql(ctx: datafusion.SessionContext, query: str) -> list[dict[str, Any]]:
    return ctx.sql(query).to_arrow_table().to_pylist()


def sink(spark: SparkSession, inbox: Path, uri: str, checkpoint: Path) -> Any:
    """The streaming query that upserts the inbox's events into table `uri`."""
    return (
        spark.readStream.schema(EVENT)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(inbox))
        .writeStream.format("memwal")
        .option("checkpointLocation", str(checkpoint))
        .option("delete_column", "deleted")
        .option("order_by", "seq")
        .trigger(processingTime=TRIGGER)
        .start(uri)
    )


def mirror(spark: SparkSession, uri: str, mirror_uri: str, checkpoint: Path) -> Any:
    """The streaming query that applies table `uri`'s change feed to table `mirror_uri`."""
    target = mw.open_table(mirror_uri)

    def each_batch(changes: DataFrame, _batch_id: int) -> None:
        upserts, deletes = mw.net_changes(changes.toArrow(), ["id"])  # per key its last change
        with target.writer() as w:
            w.put(upserts.select(TABLE.names))
            w.delete(deletes)

    return (
        spark.readStream.format("memwal")
        .option("startingOffsets", "earliest")
        .load(uri)
        .writeStream.foreachBatch(each_batch)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime=TRIGGER)
        .start()
    )


def main(root: str, spark: SparkSession | None = None) -> int:
    spark = spark or mws.session()
    mws.register(spark)
    base = Path(root)
    inbox = base / "inbox"
    inbox.mkdir(parents=True)
    uri, mirror_uri = str(base / "orders"), str(base / "orders-mirror")
    mw.create_table(uri, TABLE, "id", region_spec=mw.bucket("id", 4))
    mw.create_table(mirror_uri, TABLE, "id", region_spec=mw.bucket("id", 2))

    ctx = mw.register(datafusion.SessionContext())  # one context, registered once, read throughout
    ctx.register_table("orders", mw.MemWalTable(uri))
    writes = sink(spark, inbox, uri, base / "checkpoints" / "sink")
    feed = mirror(spark, uri, mirror_uri, base / "checkpoints" / "mirror")  # consumes while writes go on
    rng = np.random.default_rng(11)
    model: dict[int, float] = {}
    ok = True
    try:
        for file in range(FILES):
            batch = events(rng, file)
            apply(model, batch)
            probe = int(batch.column("id")[-1].as_py())
            started = time.monotonic()
            publish(batch, inbox, file)
            while (seen := rows_of(uri)) != model:  # visible to a reader in any process
                if time.monotonic() - started > VISIBLE_WITHIN_S:
                    raise TimeoutError(f"file {file} not visible after {VISIBLE_WITHIN_S} s")
                time.sleep(0.05)
            waited = time.monotonic() - started
            (count,) = sql(ctx, "SELECT count(*) AS n FROM orders")[0].values()
            found = sql(ctx, f"SELECT id, qty FROM orders WHERE id = {probe}")
            print(f"file {file}: visible after {waited:.2f} s; {count} rows; id {probe}: {found}")
            expected = [{"id": probe, "qty": model[probe]}] if probe in model else []
            ok &= count == len(seen) and found == expected
        writes.processAllAvailable()
        feed.processAllAvailable()  # every flushed change applied to the mirror
    finally:
        writes.stop()
        feed.stop()

    table, copy = rows_of(uri), rows_of(mirror_uri)
    print(f"{len(table)} rows in the table, {len(copy)} in the mirror kept by the change feed")
    if not ok or table != model or copy != model:
        print("the table, the mirror and the model differ: FAILED")
        return 1
    print("table == mirror == model: OK")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory(prefix="memwal-spark-streaming-") as tmp:
        code = main(tmp)
    sys.exit(code)
