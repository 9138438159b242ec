"""memwal_df: Lance tables as streaming-upsert LSM trees (the Lance MemTable & WAL spec).

Write path (this release): `create_table` / `open_table`, routed `Table.writer()` and per-region
`Table.region_writer()`, durable WAL, MemTable flushes into generations that Lance 14 reads natively.
"""

from memwal_df import errors
from memwal_df.region import RegionWriter, WriterConfig
from memwal_df.region_spec import (
    bucket,
    day,
    expression,
    hour,
    identity,
    month,
    multi_bucket,
    truncate,
    unsharded,
    year,
)
from memwal_df.table import RegionStatus, Table, create_table, open_table
from memwal_df.writer import TableWriter

__all__ = [
    "RegionStatus",
    "RegionWriter",
    "Table",
    "TableWriter",
    "WriterConfig",
    "bucket",
    "create_table",
    "day",
    "errors",
    "expression",
    "hour",
    "identity",
    "month",
    "multi_bucket",
    "open_table",
    "truncate",
    "unsharded",
    "year",
]
