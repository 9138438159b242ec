"""Unrouted Spark writes: a task stages its rows per region, then writes one region at a time.

A task of `df.write.format("memwal").save(uri)` without the routing column may hold rows of any
region, and so may every other task of the job. Each task

1. **stages** its partition: every Arrow batch is validated as `TableWriter.put` / `delete` validate
   (`memwal_df.write.staged.staged_rows`: every column, keys, NULLs) and grouped by
   region with the table writer's vectorized routing
   (`memwal_df.write.table_writer.group_by_region`); the groups
   are kept per region in memory up to `stage_memory_bytes`, beyond that the largest region's rows
   are spilled to an Arrow IPC stream file in a private temporary directory (`RegionStage`);
2. **writes** each staged region under the job's lease on that region
   (`memwal_df.write.staged.RegionLeases`, holder = job + partition): free regions first, waiting
   without a lease while every region left is busy, at most one lease held while it writes, so tasks
   never deadlock; a retried attempt of the partition (the same holder) takes its predecessor's
   leases over at once, and a dead task's leases expire after `lease_ttl_s`. A region is written
   through a `TableWriter` (claim, replay, puts or deletes, flush, close): one generation per task
   and region.

A task whose writer is fenced fails if the job's leases are gone (the job committed or aborted) or a
newer attempt of its own partition holds the region's lease; otherwise it takes the lease again and
writes all its rows of the region again (`RegionLeases`).

A job type may change how a region's staged rows are written (`StagedJob.write_region`) and stop a
stale task before each claim (`StagedJob.check_live`): the streaming sink
(`memwal_df.spark.stream_sink`) does both.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Self

import pyarrow as pa

from memwal_df.errors import InvalidConfigError
from memwal_df.table import Table
from memwal_df.write.partial import partial_schema
from memwal_df.write.staged import RegionLeases, lease_dir, staged_rows
from memwal_df.write.table_writer import TableWriter, group_by_region

DEFAULT_STAGE_MEMORY_BYTES = 256 * 1024 * 1024
DEFAULT_LEASE_TTL = timedelta(seconds=60)


@dataclass(frozen=True)
class StagedJob:
    """The settings of one unrouted write job, as the driver sends them to its tasks."""

    job: str
    operation: str  # "upsert" or "delete"
    durable: bool
    memory_bytes: int = DEFAULT_STAGE_MEMORY_BYTES
    lease_ttl: timedelta = DEFAULT_LEASE_TTL
    spill_dir: str | None = None
    allow_non_key_region_columns: bool = False
    partial: bool = False  # upserts carry the key and some columns (`put(partial=True)`)

    @classmethod
    def from_options(
        cls,
        operation: str,
        durable: bool,
        options: Mapping[str, str],
        allow_non_key_region_columns: bool = False,
    ) -> Self:
        """A new job (fresh id) with the data source options `stage_memory_bytes`, `lease_ttl_s`,
        `spill_dir` and `partial`."""
        try:
            memory = int(options.get("stage_memory_bytes") or DEFAULT_STAGE_MEMORY_BYTES)
            ttl = float(options.get("lease_ttl_s") or DEFAULT_LEASE_TTL.total_seconds())
        except ValueError as e:
            raise InvalidConfigError(f"stage_memory_bytes / lease_ttl_s must be numbers: {e}") from e
        if memory < 0 or ttl <= 0:
            raise InvalidConfigError("stage_memory_bytes must be >= 0 and lease_ttl_s > 0")
        spill = options.get("spill_dir") or None
        return cls(
            uuid.uuid4().hex,
            operation,
            durable,
            memory,
            timedelta(seconds=ttl),
            spill,
            allow_non_key_region_columns,
            partial_option(options),
        )

    def lease_dir(self, region: uuid.UUID | None = None) -> str:
        return lease_dir(self.job, region)

    def holder(self, partition: int) -> str:
        """The lease holder name of every attempt of task `partition` (so a retry takes over)."""
        return f"{self.job}:{partition}"

    def check_live(self, table: Table) -> None:
        """Called before each claim of a region: raise `WriterFencedError` if the job no longer
        wants its rows written. A write job's end shows in its leases (`RegionLeases`), so a
        write job always is; a streaming batch checks whether it was committed meanwhile."""

    def write_region(self, writer: TableWriter, stage: RegionStage, region: uuid.UUID) -> None:
        """Write the staged rows of `region` through `writer`: puts or deletes, in staged order."""
        write: Any = writer.delete if self.operation == "delete" else writer.put
        if self.partial and self.operation != "delete":
            write = functools.partial(writer.put, partial=True)
        for chunk in stage.chunks(region, writer.config.max_memtable_rows):
            write(chunk)


class RegionStage:
    """One task's rows grouped by region, in input order per region: in memory up to `memory_bytes`
    in all, beyond that the largest region's rows in memory are appended to its Arrow IPC stream
    file in a private temporary directory under `spill_dir`. `close()` deletes the files."""

    def __init__(self, schema: pa.Schema, memory_bytes: int, spill_dir: str | None = None) -> None:
        self.schema = schema
        self.memory_bytes = memory_bytes
        self.spill_dir = spill_dir
        self.spills = 0  # how many times rows were spilled
        self._memory: dict[uuid.UUID, list[pa.Table]] = {}
        self._bytes: dict[uuid.UUID, int] = {}  # in memory, per region
        self._total = 0  # in memory
        self._files: dict[uuid.UUID, tuple[str, pa.ipc.RecordBatchStreamWriter | None]] = {}
        self._dir: str | None = None

    @property
    def regions(self) -> list[uuid.UUID]:
        """The staged regions (in the order they were first staged)."""
        return list(self._memory)

    def add(self, region: uuid.UUID, rows: pa.Table) -> None:
        """Stage `rows` (of `schema`) of `region`, spilling while memory holds more than allowed."""
        self._memory.setdefault(region, []).append(rows)
        self._bytes[region] = self._bytes.get(region, 0) + rows.nbytes
        self._total += rows.nbytes
        while self._total > self.memory_bytes:
            self._spill(max(self._bytes, key=self._bytes.__getitem__))

    def _spill(self, region: uuid.UUID) -> None:
        path, writer = self._files.get(region, (None, None))
        if path is None:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="memwal-stage-", dir=self.spill_dir)
            path = f"{self._dir}/{region}.arrows"
            writer = pa.ipc.new_stream(path, self.schema)
        assert writer is not None, "rows must be staged before any region is read"
        for rows in self._memory[region]:
            writer.write_table(rows)
        self._files[region] = (path, writer)
        self._memory[region] = []
        self._total -= self._bytes[region]
        self._bytes[region] = 0
        self.spills += 1

    def _batches(self, region: uuid.UUID) -> Iterator[pa.RecordBatch | pa.Table]:
        if region in self._files:
            path, writer = self._files[region]
            if writer is not None:
                writer.close()
                self._files[region] = (path, None)
            with pa.memory_map(path) as source:
                yield from pa.ipc.open_stream(source)
        yield from self._memory[region]

    def chunks(self, region: uuid.UUID, max_rows: int) -> Iterator[pa.Table]:
        """The rows of `region` in their staged order, as tables of about `max_rows` rows (staged
        pieces are combined until they reach it). May be read again; stage nothing after reading."""
        yield from _coalesce(self._batches(region), max_rows)

    def close(self) -> None:
        for _, writer in self._files.values():
            if writer is not None:
                writer.close()
        self._files.clear()
        self._memory.clear()
        self._bytes.clear()
        self._total = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RegionStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _coalesce(pieces: Iterable[pa.RecordBatch | pa.Table], max_rows: int) -> Iterator[pa.Table]:
    """`pieces` combined into tables of at least `max_rows` rows (the last one may be shorter)."""
    buffer: list[pa.Table] = []
    rows = 0
    for piece in pieces:
        buffer.append(piece if isinstance(piece, pa.Table) else pa.Table.from_batches([piece]))
        rows += piece.num_rows
        if rows >= max_rows:
            yield pa.concat_tables(buffer)
            buffer, rows = [], 0
    if rows:
        yield pa.concat_tables(buffer)


def partial_option(options: Mapping[str, str]) -> bool:
    """The data source option `partial` ("true" / "false", default false): upserts carry the primary
    key and any subset of the other columns, each row updating only those (`TableWriter.put`)."""
    value = (options.get("partial") or "false").lower()
    if value not in ("true", "false"):
        raise InvalidConfigError(f'option partial must be "true" or "false", got {value!r}')
    return value == "true"


def stage_batches(
    table: Table, batches: Iterable[pa.RecordBatch], operation: str, stage: RegionStage, partial: bool = False
) -> int:
    """Validate every batch as `TableWriter.put` (`partial`: as a partial put) / `delete` does and
    stage its rows by region (the table writer's routing); returns the number of rows."""
    ts = table.schema
    total = 0
    for batch in batches:
        stage_rows(table, staged_rows(ts, batch, operation, partial), stage)
        total += batch.num_rows
    return total


def stage_rows(table: Table, rows: pa.Table, stage: RegionStage) -> None:
    """Stage validated `rows` (the table's columns, maybe more) by region, the table writer's routing."""
    spec = table.spec
    assert spec is not None, "the driver refuses tables without a region spec"
    if rows.num_rows == 0:
        return
    for values, group in group_by_region(spec, table.schema.field_ids, rows):
        stage.add(table.region_id_for(values), group)


def stage_schema(table: Table, operation: str, partial_columns: Sequence[str] | None = None) -> pa.Schema:
    """The schema of staged rows: the table's, its key columns' for deletes, or that of partial rows
    of `partial_columns` (a partial upsert's input columns)."""
    if operation == "delete":
        return table.schema.key_schema
    if partial_columns is not None:
        return partial_schema(table.schema, partial_columns)
    return table.schema.schema


def write_regions(table: Table, stage: RegionStage, job: StagedJob, holder: str) -> dict[uuid.UUID, int]:
    """Write every staged region under the job's lease on it (`RegionLeases.write`); region id -> the
    epoch it was written with."""
    leases = RegionLeases(table.storage, job.job, job.lease_ttl)
    write = functools.partial(_write_region, table, stage, job)
    return leases.write(stage.regions, holder, write, functools.partial(job.check_live, table))


def _write_region(table: Table, stage: RegionStage, job: StagedJob, region: uuid.UUID) -> int:
    """Claim `region` and write all its staged rows, then flush and close; the epoch written with."""
    with table.writer(
        durable=job.durable, allow_non_key_region_columns=job.allow_non_key_region_columns
    ) as writer:
        job.write_region(writer, stage, region)
        return writer.writers[region].epoch
