"""The streaming sink: `df.writeStream.format("memwal").option("checkpointLocation", c).start(uri)`.

**Writing a micro-batch.** Each task writes its partition as an unrouted write does
(`memwal_df.spark.staging`): it validates and stages its rows per region, then writes one region at
a time under a lease and flushes each region it wrote into a generation before it reports. So when
Spark calls `commit(messages, batch_id)` on the driver, every row of the batch is durable in a
flushed generation, visible to `MemWalTable(uri)` in any process; `commit` then records the batch
(`memwal_df.write.staged.StreamCommits`) and returns. A row is visible one trigger interval plus the
batch's write time after it entered the source.

**Exactly-once effect.** A task reads its query id (`sql.streaming.queryId`, kept across restarts
from the same checkpoint) and batch id (`streaming.sql.batchId`) from Spark's local properties. A
batch that the table already recorded for the query is skipped: that is the batch Spark re-runs
when its driver died after the sink committed but before Spark logged the commit, and writing it
again could overwrite newer writes of another writer. A batch not yet recorded is written again
when Spark replays it (task retry, restarted query): upserts and deletes are idempotent, and the
batch is applied before any later batch of the query. Before each claim of a region a task checks
that its batch is still not recorded, so a stale attempt (a task of a batch that another attempt
has committed) fails instead of writing late.

**Order inside a micro-batch.** Per key and input partition the newest row wins: the one with the
greatest `order_by` value (option; nulls lose to any value, ties go to the later row), else the last
one in the partition. Rows of one key in different partitions of one batch are applied in an
undefined order: `repartition` the stream by the key columns to make the result defined. Batches are
applied in batch order.

**Deletes.** Option `operation` = "delete" (rows are primary keys) or `delete_column` (a boolean
column of the stream, not stored: true rows delete their key, false rows upsert; a NULL flag fails
the task with `NullDeleteFlagError` before any of its rows is written).

**Partial upserts.** Option `partial` = "true": the stream carries the key and some columns, each
upsert updating only those (`TableWriter.put(partial=True)`); keys deleted in a batch are deleted
before its upserts are written, so a key deleted then updated starts from no row.

**Concurrent queries.** Every streaming query of a table takes the same per-region leases
(`_mem_wal/_write_leases/streams/{region}`, holder = query:batch:partition), so tasks of different
queries take turns on a region instead of fencing each other; a retried attempt of a task takes its
predecessor's leases over at once.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BooleanType, StructType

from memwal_df.errors import (
    InvalidConfigError,
    MissingColumnsError,
    NullDeleteFlagError,
    SchemaMismatchError,
    WriterFencedError,
)
from memwal_df.format.storage import Storage
from memwal_df.read.lsm.keys import last_per_key
from memwal_df.spark.routing import check_routable
from memwal_df.spark.staging import RegionStage, StagedJob, stage_rows, write_regions
from memwal_df.spark.types import arrow_schema_for_spark
from memwal_df.table import Table
from memwal_df.write.staged import StreamCommits, staged_rows, stream_query_id, tombstones
from memwal_df.write.table_writer import TableWriter

STREAM_LEASES = "streams"  # the lease group every streaming query of a table shares
KEEP_COMMITS = 10  # records kept per query (one is enough to answer `committed`)
QUERY_ID, BATCH_ID = "sql.streaming.queryId", "streaming.sql.batchId"  # Spark's local properties
DELETE, SEQ, ORDER = "__memwal_delete", "__memwal_seq", "__memwal_order"  # staged columns


class TableLocation(Protocol):
    """Where the table is (`memwal_df.spark.source.TableRef`)."""

    def open(self) -> Table: ...

    def storage(self) -> Storage: ...


@dataclass(frozen=True)
class StreamBatch(StagedJob):
    """One micro-batch of one streaming query, as its tasks write it (see the module docstring)."""

    query: str = ""
    batch: int = -1
    delete_column: str | None = None
    order_by: str | None = None
    order_type: pa.DataType | None = None
    columns: tuple[str, ...] = ()  # the table columns the stream carries (every one unless `partial`)

    def holder(self, partition: int) -> str:
        return f"{self.query}:{self.batch}:{partition}"

    def check_live(self, table: Table) -> None:
        if StreamCommits(table.storage, self.query).committed(self.batch):
            raise WriterFencedError(
                f"micro-batch {self.batch} of streaming query {self.query} was committed by another "
                "attempt: this attempt is stale"
            )

    def write_region(self, writer: TableWriter, stage: RegionStage, region: uuid.UUID) -> None:
        """Write the newest staged row per key of `region`: deletes, then upserts. Whole-row upserts
        and deletes have disjoint keys. Partial upserts (`partial`): every row of a stream carries
        the same columns, so a key's newest upsert holds all its updates, but it must start from no
        row when the key was deleted earlier in the batch: every key deleted in the batch is deleted
        first."""
        ts = writer.table.schema
        staged = pa.concat_tables(stage.chunks(region, max_rows=sys.maxsize))  # all of them
        rows = newest_per_key(staged, ts.primary_key, self.order_by)
        deleted = rows.column(DELETE)
        keys = rows.filter(deleted).select(list(ts.primary_key))
        if self.partial:
            any_delete = staged.filter(staged.column(DELETE)).select(list(ts.primary_key))
            keys = any_delete.group_by(list(ts.primary_key), use_threads=False).aggregate([])
        if keys.num_rows:
            writer.delete(keys)
        puts = rows.filter(pc.invert(deleted)).select(list(self.columns))
        if puts.num_rows:
            writer.put(puts, partial=self.partial)

    def stage_schema(self, table: Table) -> pa.Schema:
        """Staged rows: the table columns the stream carries (all nullable: deletes carry keys
        only), the delete flag, the row's position in the partition and the `order_by` value."""
        fields = [table.schema.schema.field(c).with_nullable(True) for c in self.columns]
        fields += [pa.field(DELETE, pa.bool_()), pa.field(SEQ, pa.int64())]
        if self.order_type is not None:
            fields.append(pa.field(ORDER, self.order_type))
        return pa.schema(fields)


def newest_per_key(rows: pa.Table, primary_key: Sequence[str], order_by: str | None) -> pa.Table:
    """One row per key of staged `rows`: the greatest `ORDER` value (if `order_by`; nulls first),
    then the greatest position in the partition."""
    seq = rows.column(SEQ).to_numpy()
    if order_by is None:
        return last_per_key(rows, primary_key, seq)
    order = rows.column(ORDER).combine_chunks()
    rank = pc.rank(order, "ascending", tiebreaker="dense").to_numpy().astype(np.int64)
    if order.null_count:
        rank[order.is_null().to_numpy(zero_copy_only=False)] = 0  # nulls lose to every value
    position = np.empty(len(seq), dtype=np.int64)
    position[np.lexsort((seq, rank))] = np.arange(len(seq))
    return last_per_key(rows, primary_key, position)


def stage_stream(
    table: Table, batches: Iterable[pa.RecordBatch], job: StreamBatch, stage: RegionStage
) -> int:
    """Validate each batch of a stream (upserts as `TableWriter.put`, deletes as `delete`) and stage
    its rows by region with their delete flag, position and order value; the number of rows."""
    schema, start = stage.schema, 0
    for batch in batches:
        data = pa.Table.from_batches([batch])
        flags = _delete_flags(data, job)
        order = data.column(job.order_by).cast(job.order_type) if job.order_by else None
        parts = []
        for deleted in (False, True):
            where = np.flatnonzero(flags == deleted)
            if len(where):
                picked = data if len(where) == data.num_rows else data.take(pa.array(where))
                rows = _tombstones(table, picked, job) if deleted else _upserts(table, picked, job)
                extra = [pa.array(np.full(len(where), deleted)), pa.array(where + start)]
                if order is not None:
                    extra.append(order.take(pa.array(where)))
                parts.append(pa.Table.from_arrays([*rows.columns, *extra], schema=schema))
        if parts:
            stage_rows(table, pa.concat_tables(parts), stage)
        start += data.num_rows
    return start


def _delete_flags(data: pa.Table, job: StreamBatch) -> np.ndarray:
    if job.operation == "delete":
        return np.ones(data.num_rows, dtype=bool)
    if job.delete_column is None:
        return np.zeros(data.num_rows, dtype=bool)
    column = data.column(job.delete_column)
    if column.null_count:
        raise NullDeleteFlagError(
            f"the delete column {job.delete_column!r} is NULL in {column.null_count} rows: true deletes "
            "the row's key, false upserts the row"
        )
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=bool)


def _upserts(table: Table, data: pa.Table, job: StreamBatch) -> pa.Table:
    """`data` as `TableWriter.put` takes it (`partial`: as a partial put), without the sink's own
    columns (the delete flag, an `order_by` column the table lacks)."""
    names = table.schema.schema.names
    own = [n for n in (job.delete_column, job.order_by) if n and n not in names]
    return staged_rows(table.schema, data.drop_columns(own), "upsert", job.partial)


def _tombstones(table: Table, data: pa.Table, job: StreamBatch) -> pa.Table:
    """Delete rows of `data`'s keys in the staged columns: the key, NULL elsewhere."""
    ts = table.schema
    return tombstones(ts, data.select(list(ts.primary_key))).select(list(job.columns))


@dataclass(frozen=True)
class StreamReport(WriterCommitMessage):
    """What one task of a micro-batch did: the regions it wrote (id -> the epoch it wrote with) and
    its rows, or that it skipped the batch (the table had recorded it)."""

    query: str
    batch: int
    partition: int
    regions: dict[uuid.UUID, int]
    rows: int
    skipped: bool


class MemWalStreamWriter(DataSourceStreamArrowWriter):
    """The sink of one streaming query (see the module docstring). Options: `operation`,
    `delete_column`, `order_by`, `partial`, and those of unrouted writes (`durable`, `stage_memory_bytes`,
    `spill_dir`, `lease_ttl_s`, `allow_non_key_region_columns`)."""

    def __init__(self, ref: TableLocation, schema: StructType, options: Mapping[str, str]) -> None:
        self.ref = ref
        self.job = stream_job(ref.open(), schema, options)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StreamReport:
        """Stage and write this task's rows, unless the table recorded the batch already."""
        ctx = TaskContext.get()
        query = ctx.getLocalProperty(QUERY_ID) if ctx else None
        batch = ctx.getLocalProperty(BATCH_ID) if ctx else None
        if ctx is None or query is None or batch is None:
            raise InvalidConfigError("the memwal stream writer runs only in a Spark streaming query")
        job = replace(self.job, query=stream_query_id(query), batch=int(batch))
        partition, table = ctx.partitionId(), self.ref.open()
        if StreamCommits(table.storage, job.query).committed(job.batch):
            for _ in iterator:  # the batch is in the table: drop its rows
                pass
            return StreamReport(job.query, job.batch, partition, {}, 0, True)
        with RegionStage(job.stage_schema(table), job.memory_bytes, job.spill_dir) as stage:
            rows = stage_stream(table, iterator, job, stage)
            regions = write_regions(table, stage, job, job.holder(partition))
        return StreamReport(job.query, job.batch, partition, regions, rows, False)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Record the batch as committed (every task flushed its rows before reporting) and prune
        the query's older records; a batch without tasks wrote nothing and records nothing."""
        reports = [m for m in messages if isinstance(m, StreamReport)]
        if not reports:
            return
        queries = {(r.query, r.batch) for r in reports}
        if len(queries) != 1 or reports[0].batch != batchId:
            raise InvalidConfigError(f"tasks of micro-batch {batchId} reported {sorted(queries)}")
        regions = {region for r in reports for region in r.regions}
        commits = StreamCommits(self.ref.storage(), reports[0].query)
        commits.record(batchId, sum(r.rows for r in reports), len(regions), KEEP_COMMITS)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: rows of finished tasks are flushed, a failed attempt's durable WAL
        entries are replayed by the region's next claim (the restarted query's); Spark replays the
        batch when the query restarts. (Not `Table.recover()`: it would fence other queries.)"""


def stream_job(table: Table, schema: StructType, options: Mapping[str, str]) -> StreamBatch:
    """The settings of a query's micro-batches, after checking `schema` (the stream's columns) and
    the options against the table, as `TableWriter` checks its input."""
    operation = options.get("operation", "upsert")
    if operation not in ("upsert", "delete"):
        raise InvalidConfigError(f"operation must be 'upsert' or 'delete', got {operation!r}")
    delete_column, order_by = options.get("delete_column") or None, options.get("order_by") or None
    if delete_column is not None and operation == "delete":
        raise InvalidConfigError("delete_column applies to upserts: drop it or the operation 'delete'")
    allow_non_key = options.get("allow_non_key_region_columns", "false").lower() == "true"
    table.check_writable(allow_non_key)
    for name in (delete_column, order_by):
        if name is not None and name not in schema.names:
            raise MissingColumnsError(f"the stream has no column {name!r}", (name,))
    if delete_column is not None and not isinstance(schema[delete_column].dataType, BooleanType):
        raise SchemaMismatchError(f"the delete column {delete_column!r} must be boolean")
    ignored = {delete_column, order_by} - set(table.schema.schema.names)
    carried = [n for n in schema.names if n not in ignored]
    durable = options.get("durable", "true").lower() != "false"
    job = StreamBatch.from_options(operation, durable, options, allow_non_key)
    check_routable(table, carried, keys_only=operation == "delete", partial=job.partial)
    if delete_column is not None:  # tombstones are routed by their keys
        check_routable(table, list(table.schema.primary_key), keys_only=True)
    order_type = None
    if order_by is not None:
        order_type = arrow_schema_for_spark(StructType([schema[order_by]])).field(0).type
        if pa.types.is_nested(order_type):
            raise SchemaMismatchError(f"the order_by column {order_by!r} must be of a scalar type")
    names = table.schema.schema.names
    columns = tuple(n for n in names if n in carried) if job.partial else tuple(names)
    return replace(
        job,
        job=STREAM_LEASES,
        delete_column=delete_column,
        order_by=order_by,
        order_type=order_type,
        columns=columns,
    )
