"""memwal_df: Lance tables as streaming-upsert LSM trees (the Lance MemTable & WAL spec).

Write path: `create_table` / `open_table`, routed `Table.writer()` and per-region
`Table.region_writer()`, durable WAL, MemTable flushes into generations that Lance 14 reads natively.
Read path: `MemWalTable` (a dataset DataFusion scans, merging every level by primary key) and
`register(ctx)` for memwal_df's SQL functions, `query(ctx, sql)` to run SQL with typed errors.
"""

from memwal_df import _lance_log, _moved, errors  # noqa: F401  (_lance_log first: before `lance` loads)
from memwal_df.format.regions import (
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
from memwal_df.read.dataset import MemWalTable
from memwal_df.read.sql import query, register
from memwal_df.table import RegionStatus, Table, create_table, open_table
from memwal_df.write.partial import Applied
from memwal_df.write.region_writer import RegionWriter
from memwal_df.write.table_writer import TableWriter
from memwal_df.write.writer_config import WriterConfig

_moved.install()

__all__ = [
    "Applied",
    "MemWalTable",
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
    "query",
    "register",
    "truncate",
    "unsharded",
    "year",
]
