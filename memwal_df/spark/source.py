"""The "memwal" Spark data source: reads the durable levels of a table, writes routed rows.

Options (both directions): `path` (the table URI, `load(uri)` / `save(uri)`) and `storage_options`
(a JSON object of Lance-style storage options, e.g. S3 endpoint and keys).

Read: the driver takes one snapshot of the durable levels (the base version and every region's
latest manifest; no MemTables) and plans it with `memwal_df.read.scan.planner.plan_scan`, as `MemWalTable`
does: region pruning from the pushed filters, one partition per region with unmerged generations
(deduplicated newest first) and per span of the base table (anti-joined against the newer levels).
Each Spark task re-plans the pinned snapshot (`memwal_df.read.lsm.snapshot.pin` / `restore`) and runs its
partition's operator tree. Pushed filters (`memwal_df.spark.filters`) are applied exactly, after
deduplication. Option `base_partitions` (default: this machine's cores) sets the base spans.

Change feed (`memwal_df.spark.change_feed`): `spark.readStream.format("memwal")` with a change-feed
option (`startingOffsets`, `readChangeFeed` ...), and `spark.read` with `changes_since`.

Write (mode "append"), option `operation` = "upsert" (default) or "delete" (rows are primary keys),
option `durable` (default true: one fsync'd WAL entry per batch and region), option `partial`
(default false; "true": upserts carry the primary key and any other columns, each row updating only
those, `TableWriter.put(partial=True)`), option
`allow_non_key_region_columns` (default false: a table whose region spec, made elsewhere, reads
columns outside the primary key is refused with `NonKeyRegionColumnError`, see `Table.writer`):
* routed rows (column `__memwal_region`, one partition per region: `memwal_df.spark.route`, used by
  `memwal_df.spark.write` / `delete`) are written by `MemWalWriter`: each task writes its rows
  through a `TableWriter`, which claims each of its regions (fencing every earlier writer of the
  region, including a failed or still running attempt of the same task) and flushes and closes them
  at the end, so a finished task's rows are in flushed generations. A retry replays what a failed
  attempt wrote durably and writes the same rows again (upserts and deletes are idempotent);
* any other DataFrame is written by `StagedWriter`: each task stages its rows per region and writes
  one region at a time under a per-job region lease (`memwal_df.spark.staging`; options
  `stage_memory_bytes`, `spill_dir`, `lease_ttl_s`).

Streaming write (`df.writeStream.format("memwal").start(uri)`): `memwal_df.spark.stream_sink`.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    Filter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from memwal_df.errors import InvalidConfigError
from memwal_df.format.open_storage import open_storage
from memwal_df.format.storage import Storage
from memwal_df.read.expr.predicate import column_predicates
from memwal_df.read.lsm.snapshot import PinnedSnapshot, pin, restore, take_snapshot
from memwal_df.read.scan.planner import Partition, plan_scan
from memwal_df.spark.change_feed import ChangesReader, ChangeStreamReader, change_spark_schema, is_change_read
from memwal_df.spark.filters import conjunction, to_expression
from memwal_df.spark.routing import ROUTE, check_routable
from memwal_df.spark.staging import (
    RegionStage,
    StagedJob,
    partial_option,
    stage_batches,
    stage_schema,
    write_regions,
)
from memwal_df.spark.stream_sink import MemWalStreamWriter
from memwal_df.spark.types import arrow_schema_for_spark, spark_schema, to_spark_batch
from memwal_df.table import Table, open_table
from memwal_df.write.staged import remove_leases

OPERATIONS = ("upsert", "delete")


@dataclass(frozen=True)
class TableRef:
    """Where a table is, as data a task can open it from."""

    uri: str
    storage_options: dict[str, str] | None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> TableRef:
        uri = options.get("path")
        if not uri:
            raise InvalidConfigError('the "memwal" data source needs a table URI: load(uri) / save(uri)')
        raw = options.get("storage_options")
        try:
            storage = json.loads(raw) if raw else None
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"storage_options is not a JSON object: {e}") from e
        if storage is not None and not isinstance(storage, dict):
            raise InvalidConfigError("storage_options must be a JSON object")
        return cls(uri, storage)

    def open(self) -> Table:
        return open_table(self.uri, self.storage_options)

    def storage(self) -> Storage:
        return open_storage(self.uri, self.storage_options)


class MemWalDataSource(DataSource):
    """`spark.read.format("memwal").load(uri)` and `df.write.format("memwal").mode("append").save(uri)`."""

    @classmethod
    def name(cls) -> str:
        return "memwal"

    def schema(self) -> StructType:
        table = TableRef.from_options(self.options).open()
        if is_change_read(self.options):
            return change_spark_schema(table)
        return spark_schema(table.schema.schema)

    def reader(self, schema: StructType) -> MemWalReader | ChangesReader:
        ref = TableRef.from_options(self.options)
        if is_change_read(self.options):  # option("changes_since", ...): the change feed
            return ChangesReader(ref.uri, ref.storage_options, schema, self.options)
        return MemWalReader(ref, schema, self.options)

    def streamReader(self, schema: StructType) -> ChangeStreamReader:
        """`spark.readStream.format("memwal")`: the change feed (`memwal_df.spark.change_feed`)."""
        if not is_change_read(self.options):
            raise InvalidConfigError(
                'a "memwal" stream reads the change feed: set option("startingOffsets", "earliest") '
                '(or "latest", or offsets) or option("readChangeFeed", "true"), so that its schema '
                "carries _change_type, _region, _generation and _position"
            )
        ref = TableRef.from_options(self.options)
        return ChangeStreamReader(ref.uri, ref.storage_options, schema, self.options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> MemWalStreamWriter:
        """`df.writeStream.format("memwal").start(uri)`: every micro-batch upserted (or deleted)
        with exactly-once effect (`memwal_df.spark.stream_sink`); output mode "append" only."""
        if overwrite:
            raise InvalidConfigError('the "memwal" stream sink only upserts: use outputMode("append")')
        return MemWalStreamWriter(TableRef.from_options(self.options), schema, self.options)

    def writer(self, schema: StructType, overwrite: bool) -> MemWalWriter:
        if overwrite:
            raise InvalidConfigError('the "memwal" data source only appends (upserts): use mode("append")')
        ref = TableRef.from_options(self.options)
        if ROUTE in schema.names:
            return MemWalWriter(ref, self.options)
        return StagedWriter(ref, schema, self.options)


# ------------------------------------------------------------------------------------------ read


class ScanPartition(InputPartition):
    """Partition `index` of the scan plan of `snapshot` under `filter` (labelled `label`)."""

    def __init__(
        self, index: int, label: str, snapshot: PinnedSnapshot, filter: pc.Expression | None, spans: int
    ) -> None:
        super().__init__(index)
        self.index, self.label, self.snapshot, self.filter, self.spans = index, label, snapshot, filter, spans


def plan(table: Table, snapshot: Any, filter: pc.Expression | None, spans: int) -> list[Partition]:
    """The scan plan `MemWalTable` makes for this snapshot and filter (`spans` base partitions), with
    one partition per region (each may run on another executor)."""
    predicates = column_predicates(filter) if filter is not None else {}
    return plan_scan(snapshot, table.specs, filter, predicates, partitions=spans, one_region_partition=False)


class MemWalReader(DataSourceReader):
    def __init__(self, ref: TableRef, schema: StructType, options: Mapping[str, str]) -> None:
        self.ref = ref
        self.columns = [f.name for f in schema.fields]
        self.arrow_schema = arrow_schema_for_spark(schema)
        self.spans = int(options.get("base_partitions") or os.cpu_count() or 1)
        if self.spans < 1:
            raise InvalidConfigError(f"base_partitions must be >= 1, got {self.spans}")
        self.pushed: list[pc.Expression] = []

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        """Take every filter `to_expression` can express (applied exactly); yield the others."""
        table_schema = self.ref.open().schema.schema
        for f in filters:
            expression = to_expression(f, table_schema)
            if expression is None:
                yield f
            else:
                self.pushed.append(expression)

    def partitions(self) -> Sequence[InputPartition]:
        table = self.ref.open()
        snapshot = take_snapshot(table, "latest")
        filter = conjunction(self.pushed)
        planned = plan(table, snapshot, filter, self.spans)  # raises for an unreadable region it needs
        pinned = pin(snapshot)
        return [ScanPartition(i, p.label, pinned, filter, self.spans) for i, p in enumerate(planned)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ScanPartition)
        table = self.ref.open()
        partitions = plan(table, restore(table, partition.snapshot), partition.filter, partition.spans)
        if partition.index >= len(partitions) or partitions[partition.index].label != partition.label:
            raise InvalidConfigError(f"the pinned snapshot planned differently in a task ({partition.label})")
        node = partitions[partition.index].make(self.columns)
        for batch in node.execute():
            if batch.num_rows:
                yield to_spark_batch(batch, self.arrow_schema)


# ----------------------------------------------------------------------------------------- write


@dataclass(frozen=True)
class WriteReport(WriterCommitMessage):
    """What one task wrote: region id -> the epoch it wrote with, and the row count."""

    partition: int
    attempt: int
    regions: dict[uuid.UUID, int]
    rows: int

    @classmethod
    def of_task(cls, regions: dict[uuid.UUID, int], rows: int) -> WriteReport:
        """The report of the running Spark task (partition 0, attempt 0 outside a task)."""
        ctx = TaskContext.get()
        return cls(_partition(), ctx.attemptNumber() if ctx else 0, regions, rows)


def _partition() -> int:
    ctx = TaskContext.get()
    return ctx.partitionId() if ctx else 0


class MemWalWriter(DataSourceArrowWriter):
    def __init__(self, ref: TableRef, options: Mapping[str, str]) -> None:
        self.ref = ref
        self.operation = options.get("operation", "upsert")
        if self.operation not in OPERATIONS:
            raise InvalidConfigError(f"operation must be one of {OPERATIONS}, got {self.operation!r}")
        self.durable = options.get("durable", "true").lower() != "false"
        self.allow_non_key = options.get("allow_non_key_region_columns", "false").lower() == "true"
        self.partial = partial_option(options)
        ref.open().check_writable(self.allow_non_key)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteReport:
        """Write this task's routed rows (see the module docstring); its regions are flushed at the end."""
        table = self.ref.open()
        rows = 0
        with table.writer(durable=self.durable, allow_non_key_region_columns=self.allow_non_key) as writer:
            for batch in iterator:
                data = pa.Table.from_batches([batch.drop_columns([ROUTE])])
                if self.operation == "delete":
                    writer.delete(data)
                else:
                    writer.put(data, partial=self.partial)
                rows += batch.num_rows
            regions = {rid: w.epoch for rid, w in writer.writers.items()}
        return WriteReport.of_task(regions, rows)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to publish: every task flushed its regions before reporting (per-region
        durability, as `TableWriter`; a job is not atomic across regions)."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """The job failed: claim every region whose WAL holds unflushed entries (`Table.recover`),
        which fences any attempt of this job still running and flushes what failed attempts wrote
        durably, so the table shows a settled state (rows of finished tasks and failed attempts'
        durable writes; a re-run of the job writes the rest)."""
        self.ref.open().recover()


class StagedWriter(MemWalWriter):
    """Writes rows that are not routed: each task stages its rows per region and writes one region
    at a time under the job's lease on it (`memwal_df.spark.staging`); commit and abort remove the
    job's leases (abort then recovers, as `MemWalWriter.abort`)."""

    def __init__(self, ref: TableRef, schema: StructType, options: Mapping[str, str]) -> None:
        super().__init__(ref, options)
        check_routable(ref.open(), schema.names, keys_only=self.operation == "delete", partial=self.partial)
        self.job = StagedJob.from_options(self.operation, self.durable, options, self.allow_non_key)
        self.columns = list(schema.names)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteReport:
        """Stage this task's rows, then write them region by region (module `staging`)."""
        table, job = self.ref.open(), self.job
        partial_columns = self.columns if job.partial else None
        schema = stage_schema(table, job.operation, partial_columns)
        with RegionStage(schema, job.memory_bytes, job.spill_dir) as stage:
            rows = stage_batches(table, iterator, job.operation, stage, job.partial)
            regions = write_regions(table, stage, job, job.holder(_partition()))
        return WriteReport.of_task(regions, rows)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Remove the job's leases (every task flushed its regions before reporting)."""
        remove_leases(self.ref.storage(), self.job.job)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Remove the job's leases (a task still running then gives up after its next fence), then
        recover every region with unflushed WAL entries (`MemWalWriter.abort`)."""
        remove_leases(self.ref.storage(), self.job.job)
        super().abort(messages)
