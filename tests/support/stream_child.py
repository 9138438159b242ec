"""A Spark driver process running the memwal streaming sink, for tests that SIGKILL it: it streams the
Parquet files of an inbox into a table (`delete_column` "deleted", `order_by` "seq", one file per
micro-batch) with a processing-time trigger (`run`: until killed) or drains the inbox with
`availableNow` and exits (`drain`); it prints the query id once the query started.

Usage: python stream_child.py run|drain URI INBOX CHECKPOINT"""

from __future__ import annotations

import sys

from pyspark.sql.types import BooleanType, DoubleType, LongType, StringType, StructField, StructType

from memwal_df import spark as mws

EVENTS = StructType(
    [
        StructField("id", LongType()),
        StructField("category", StringType()),
        StructField("value", DoubleType()),
        StructField("deleted", BooleanType()),
        StructField("seq", LongType()),
    ]
)


def main(mode: str, uri: str, inbox: str, checkpoint: str) -> None:
    spark = mws.session(master="local[2]")
    writer = (
        spark.readStream.schema(EVENTS)
        .option("maxFilesPerTrigger", 1)
        .parquet(inbox)
        .writeStream.format("memwal")
        .option("checkpointLocation", checkpoint)
        .option("delete_column", "deleted")
        .option("order_by", "seq")
    )
    if mode == "run":
        query = writer.trigger(processingTime="0 seconds").start(uri)
        print(f"query {query.id}", flush=True)
        query.awaitTermination()
    else:
        query = writer.trigger(availableNow=True).start(uri)
        print(f"query {query.id}", flush=True)
        query.awaitTermination()
        spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:5])
