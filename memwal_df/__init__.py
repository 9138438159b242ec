"""Lance tables as streaming-upsert LSM trees (the Lance MemTable & WAL spec), queried from Apache
DataFusion SQL.

```python
import memwal_df as mw
```

Every class and function a user works with is importable from `memwal_df` and listed below; the
typed errors are in `memwal_df.errors` (all derive from `memwal_df.errors.MemWalError`), and the
Spark data source is `memwal_df.spark` (the `spark` extra).

**Tables.** `create_table(uri, data_or_schema, primary_key, region_spec=...)` creates a table,
`open_table(uri)` opens one (also one Lance 14 initialized for MemWAL); both return a `Table`. A
region spec maps rows to regions: `bucket`, `identity`, `year`, `month`, `day`, `hour`, `truncate`,
`multi_bucket`, `expression`, `unsharded`, combined with `+` (an `UnboundRegionSpec`; the table
holds it as a `RegionSpec`).

**Writing.** `Table.writer()` returns a `TableWriter` that routes rows to their regions;
`Table.region_writer()` a `RegionWriter` for one region. Both `put` (upsert), `delete` by primary
key, `insert_if_absent` (returning which rows were `Applied`) and `flush` MemTables into
generations; `WriterConfig` holds their settings.

**Reading.** `MemWalTable(uri)` is the table as a dataset DataFusion scans:
`ctx.register_table("t", MemWalTable(uri))`; with `writer=w` a query also sees the rows `w` has not
flushed yet. `register(ctx)` adds the SQL functions `vector_search`, `fts`, `memwal_explain` and
`memwal_explain_search`; `query(ctx, sql)` runs SQL and raises memwal_df's errors with their types.
`Table.changes()` reads the change feed (`ChangeFeed`, resumed from `ChangeOffsets`, committed by
a `Consumer`); `net_changes` turns a set of changes into the upserts and deletes they come to.

**Background jobs and status.** `Table.merge()` (`MergeResult`), `Table.build_index()`
(`BuildResult`), `Table.catch_up_indexes()` (`CatchUpResult`), `Table.compact()`
(`CompactionResult`), `Table.gc()` (`GcResult`) or all of them in a loop, `Table.maintain()` (a
`Round` each); `Table.status()` (`RegionStatus`, `RegionProblem`, `Health`), `Table.recover()`
and `Table.repair_region()` (`RepairPlan`).

**Serving.** `serve(tables, ...)` starts an Arrow Flight SQL server over tables and returns its
`Server`; `memwal_df.server.Limits` sets the server's limits (docs/serving.md).

The guides (`docs/` in the repository) describe regions, consistency modes, search, the jobs and
the command line `memwal`.
"""

from importlib import metadata as _metadata

from memwal_df import _lance_log, errors, server  # noqa: F401  (_lance_log first: before `lance` loads)
from memwal_df.format.consumers import ChangeOffsets, Consumer
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.regions.spec import (
    RegionField,
    RegionSpec,
    UnboundRegionField,
    UnboundRegionSpec,
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
from memwal_df.format.regions.transforms import Transform
from memwal_df.format.schema import TableSchema
from memwal_df.format.table_handle import TableHandle
from memwal_df.jobs.compaction import CompactionDebt, CompactionResult, CompactionSettings
from memwal_df.jobs.garbage import GcResult, RegionGc
from memwal_df.jobs.health import CompactionHealth, Health, IndexHealth, JobError
from memwal_df.jobs.index_builder import BuildResult
from memwal_df.jobs.index_catchup import CatchUpResult, IndexCatchUp
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings
from memwal_df.jobs.maintain import Round
from memwal_df.jobs.merger import MergeResult, RegionMerge
from memwal_df.jobs.repair import GenerationFix, RegionProblem, RepairPlan, SetAside
from memwal_df.read.changes import ChangeFeed, net_changes
from memwal_df.read.dataset import MemWalTable
from memwal_df.read.sql import query, register
from memwal_df.server import Server, serve
from memwal_df.table import RegionStatus, Table, create_table, open_table
from memwal_df.write.partial import Applied
from memwal_df.write.region_writer import RegionWriter
from memwal_df.write.table_writer import TableWriter
from memwal_df.write.writer_config import WriterConfig


def _version() -> str:
    """The version of the installed `memwal_df` distribution; "0+unknown" only when the package is
    imported from a source tree that was never installed (no distribution metadata to read)."""
    try:
        return _metadata.version("memwal_df")
    except _metadata.PackageNotFoundError:
        return "0+unknown"


__version__: str = _version()

__all__ = [
    "__version__",
    "Applied",
    "BuildResult",
    "CatchUpResult",
    "ChangeFeed",
    "ChangeOffsets",
    "CompactionDebt",
    "CompactionHealth",
    "CompactionResult",
    "CompactionSettings",
    "Consumer",
    "GcResult",
    "GenerationFix",
    "Health",
    "IndexCatchUp",
    "IndexHealth",
    "IndexUpkeepSettings",
    "JobError",
    "MaintainedIndex",
    "MemWalTable",
    "MergeResult",
    "RegionField",
    "RegionGc",
    "RegionMerge",
    "RegionProblem",
    "RegionSpec",
    "RegionStatus",
    "RegionWriter",
    "RepairPlan",
    "Round",
    "Server",
    "SetAside",
    "Table",
    "TableHandle",
    "TableSchema",
    "TableWriter",
    "Transform",
    "UnboundRegionField",
    "UnboundRegionSpec",
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
    "net_changes",
    "open_table",
    "query",
    "register",
    "serve",
    "server",
    "truncate",
    "unsharded",
    "year",
]
