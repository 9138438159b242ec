"""memwal_df on Spark (the `spark` extra): a "memwal" data source, routed writes, parallel merges.

    from memwal_df import spark as mws
    spark = mws.session()                                  # local, headless; "memwal" registered
    mws.write(df, uri)                                     # upsert, one task per region
    df.write.format("memwal").mode("append").save(uri)     # upsert any DataFrame (staged per task)
    mws.delete(keys_df, uri)                               # delete by primary key
    spark.read.format("memwal").load(uri)                  # deduplicated durable levels
    mws.merge(spark, uri)                                  # regions merged in parallel tasks
    df.writeStream.format("memwal").option("checkpointLocation", c).start(uri)  # streaming upserts

See `docs/spark.md`.
"""

from memwal_df.spark.jobs import delete, merge, write
from memwal_df.spark.routing import ROUTE, arrow_routes, route
from memwal_df.spark.session import register, session
from memwal_df.spark.source import MemWalDataSource

__all__ = [
    "ROUTE",
    "MemWalDataSource",
    "arrow_routes",
    "delete",
    "merge",
    "register",
    "route",
    "session",
    "write",
]
