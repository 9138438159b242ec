"""Distributed ingest with Spark: a MemWAL table fed by Spark jobs, read back through Spark.

Creates a table with 4 bucket regions, upserts 20,000 events (vectors included) from a Spark
DataFrame (routed), updates half of them (a plain `df.write.format("memwal")` save) and deletes
some in later jobs, merges the regions in parallel Spark tasks, then reads the table with
`spark.read.format("memwal")` and checks it against a model. The same code runs on a cluster:
see docs/spark.md (an `s3://` URI plus storage options).

Usage: python examples/spark_ingest.py [DIRECTORY]   (recreated; default: a temporary directory, removed
afterwards)
"""

from __future__ import annotations

import shutil
import sys
import tempfile

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import memwal_df as mw
from memwal_df import spark as mws

ROWS, DIM = 20_000, 8


def events(spark: SparkSession, first: int, count: int, version: int) -> DataFrame:
    """Events `first`..`first + count - 1`, generated inside Spark (vectors as array<float>)."""
    return spark.range(first, first + count).select(
        F.col("id"),
        F.concat(F.lit("cat"), (F.col("id") % 7).cast("string")).alias("category"),
        (F.col("id") * 0.5 + version).alias("value"),
        F.array(*[(F.col("id") + i + version).cast("float") for i in range(DIM)]).alias("vec"),
    )


def model_of(first: int, count: int, version: int) -> dict[int, dict]:
    return {
        i: {
            "id": i,
            "category": f"cat{i % 7}",
            "value": i * 0.5 + version,
            "vec": [float(i + j + version) for j in range(DIM)],
        }
        for i in range(first, first + count)
    }


def main(uri: str, spark: SparkSession | None = None) -> int:
    spark = spark or mws.session()
    mws.register(spark)
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("category", pa.string()),
            ("value", pa.float64()),
            ("vec", pa.list_(pa.float32(), DIM)),
        ]
    )
    mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", 4))

    mws.write(events(spark, 0, ROWS, 0), uri)  # routed: one Spark task per region (the fast path)
    # any DataFrame, not routed: each task stages its rows per region and writes them region by
    # region, taking turns with the other tasks; updates half, inserts ROWS // 2 new
    events(spark, ROWS // 2, ROWS, 1).write.format("memwal").mode("append").save(uri)
    mws.delete(spark.range(0, 2 * ROWS, 100).select("id"), uri)
    merged = mws.merge(spark, uri)  # regions merged in parallel tasks

    model = {**model_of(0, ROWS, 0), **model_of(ROWS // 2, ROWS, 1)}
    for k in range(0, 2 * ROWS, 100):
        model.pop(k, None)
    got = spark.read.format("memwal").load(uri).toArrow().to_pylist()
    rows = {r["id"]: r for r in got}
    print(f"{len(rows)} rows read through Spark; merged {merged.rows} rows in {len(merged.regions)} regions")
    if len(got) != len(rows) or rows != model:
        print("read-back differs from the model: FAILED")
        return 1
    print("read-back equals the model: OK")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory(prefix="memwal-spark-") as tmp:
        code = main(f"{tmp}/events")
    sys.exit(code)
