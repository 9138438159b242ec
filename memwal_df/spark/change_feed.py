"""The change feed in Spark: `spark.readStream.format("memwal")` (a `DataSourceStreamReader`) and
batch reads of it (`spark.read.format("memwal").option("changes_since", ...)`).

Rows: the table's columns plus `_change_type`, `_region`, `_generation`, `_position`
(`memwal_df.read.changes`). Spark does not tell a data source whether a read is a stream (its
`schema()` sees the options only), so a read is a change-feed read when one of its options says so
(`CHANGE_OPTIONS`): `readChangeFeed` = true, or any other option of the feed. Options:

* `startingOffsets` (stream: where a new query starts; batch: as `changes_since`): `earliest` (each
  region's oldest retained change, the default), `latest`, or offsets as JSON;
* `changes_since` / `changes_until` (`endingOffsets`), batch: the changes between two offsets
  (`until`: default every flushed change);
* `maxGenerationsPerTrigger`: at most this many generations per micro-batch, in all regions
  (Spark's `ReadMaxFiles`; `trigger(availableNow=True)` then runs several micro-batches);
* `consumer_id` (and `consumer_expiry_s`, default 7 days): a registered consumer (`Table.register_consumer`):
  a new query starts at its committed offsets, each committed micro-batch records its end offsets,
  and GC keeps the generations it has not read.

Each micro-batch (or batch read) is planned on the driver: one partition per region with changes,
which reads that region's generations in order. Offsets are Spark's JSON form of `ChangeOffsets`;
a restart from a checkpoint resumes from its offsets exactly. `trigger(availableNow=True)` reads
the changes flushed when the query started (`prepareForTriggerAvailableNow`) and stops.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from memwal_df.errors import InvalidConfigError
from memwal_df.format.consumers import DEFAULT_EXPIRY, ChangeOffsets, check_consumer_id, commit_offsets
from memwal_df.format.open_storage import open_storage
from memwal_df.read.changes import (
    EARLIEST,
    LATEST,
    RegionChanges,
    RegionRange,
    change_schema,
    check_retained,
    end_offsets,
    plan,
    read_range,
    region_changes,
    register_consumer,
    resolve,
)
from memwal_df.spark.types import arrow_schema_for_spark, spark_schema, to_spark_batch
from memwal_df.table import Table, open_table

CHANGE_OPTIONS = (
    "startingOffsets",
    "endingOffsets",
    "changes_since",
    "changes_until",
    "maxGenerationsPerTrigger",
    "consumer_id",
    "consumer_expiry_s",
)


def is_change_read(options: Mapping[str, str]) -> bool:
    """Whether a read with these options reads the change feed (see the module docstring)."""
    flag = options.get("readChangeFeed")
    return (flag is not None and flag.lower() == "true") or any(k in options for k in CHANGE_OPTIONS)


def change_spark_schema(table: Table) -> StructType:
    """The Spark schema of the table's change feed."""
    return spark_schema(change_schema(table.schema.schema))


class RegionSlice(InputPartition):
    """The changes of one region in one micro-batch (or batch read)."""

    def __init__(self, index: int, range: RegionRange) -> None:
        super().__init__(index)
        self.range = range


class ChangeReading:
    """What both readers share: the table, the feed's Arrow schema and Spark's, planning and reading."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None, schema: StructType) -> None:
        self.uri, self.storage_options = uri, storage_options
        self.change_schema = change_schema(self.open().schema.schema)
        if schema.names != self.change_schema.names:
            raise InvalidConfigError(
                f"a change-feed read has the columns {self.change_schema.names}, not {schema.names}"
            )
        self.spark_arrow = arrow_schema_for_spark(schema)

    def open(self) -> Table:
        return open_table(self.uri, self.storage_options)

    def slices(
        self, start: ChangeOffsets, end: ChangeOffsets, regions: Mapping[uuid.UUID, RegionChanges]
    ) -> list[RegionSlice]:
        """One partition per region with changes from `start` to `end`; `ChangesExpiredError` if
        GC removed changes `start` needs."""
        check_retained(start, regions)
        return [RegionSlice(i, rng) for i, rng in enumerate(plan(start, end, regions))]

    def read_slice(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RegionSlice):
            return  # a batch read planned no partition: Spark reads one placeholder partition
        storage = open_storage(self.uri, self.storage_options)
        for batch, _ in read_range(storage, partition.range, self.change_schema):
            yield to_spark_batch(batch, self.spark_arrow)


def _option_int(options: Mapping[str, str], name: str) -> int | None:
    raw = options.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidConfigError(f"{name} must be an integer >= 1, got {raw!r}")
    return value


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("memwal")`: the change feed, one micro-batch per trigger."""

    def __init__(
        self, uri: str, storage_options: dict[str, str] | None, schema: StructType, options: Mapping[str, str]
    ) -> None:
        self.reading = ChangeReading(uri, storage_options, schema)
        self.starting = options.get("startingOffsets", EARLIEST)
        consumer = options.get("consumer_id")
        self.consumer = None if consumer is None else check_consumer_id(consumer)
        expiry = _option_int(options, "consumer_expiry_s")
        self.expiry = None if expiry is None else timedelta(seconds=expiry)  # None: as registered
        self.max_generations = _option_int(options, "maxGenerationsPerTrigger")
        self.target: ChangeOffsets | None = None  # availableNow: where the query stops
        self.recorded: dict | None = None  # the consumer's offsets as this reader last committed them

    def initialOffset(self) -> dict:
        """A new query's start: the consumer's committed offsets (registered at `startingOffsets`
        if new), else `startingOffsets`."""
        table = self.reading.open()
        if self.consumer is not None:
            expiry = self.expiry or DEFAULT_EXPIRY
            return register_consumer(table, self.consumer, self.starting, expiry).offsets.to_dict()
        regions = region_changes(table)
        start = resolve(self.starting, regions)
        check_retained(start, regions)
        return start.to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable() if self.max_generations is None else ReadMaxFiles(self.max_generations)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """After the newest flushed change (or the availableNow target), at most `limit.max_files`
        generations past `start`."""
        self._record(start)  # Spark plans a micro-batch once the one before it is committed
        regions = region_changes(self.reading.open())
        most = limit.max_files if isinstance(limit, ReadMaxFiles) else None
        return end_offsets(ChangeOffsets.parse(start), regions, self.target, most).to_dict()

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = resolve(LATEST, region_changes(self.reading.open()))

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        regions = region_changes(self.reading.open())
        return self.reading.slices(ChangeOffsets.parse(start), ChangeOffsets.parse(end), regions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self.reading.read_slice(partition)

    def commit(self, end: dict) -> None:
        self._record(end)

    def _record(self, processed: dict) -> None:
        """Record `processed` (offsets every change before which the query has processed) as the
        consumer's offsets, when they moved: GC then releases what it has read."""
        if self.consumer is not None and processed != self.recorded:
            storage = open_storage(self.reading.uri, self.reading.storage_options)
            commit_offsets(storage, self.consumer, ChangeOffsets.parse(processed), self.expiry)
            self.recorded = processed


class ChangesReader(DataSourceReader):
    """`spark.read.format("memwal").option("changes_since", ...)`: the changes between two offsets,
    planned once on the driver."""

    def __init__(
        self, uri: str, storage_options: dict[str, str] | None, schema: StructType, options: Mapping[str, str]
    ) -> None:
        self.reading = ChangeReading(uri, storage_options, schema)
        self.since = options.get("changes_since") or options.get("startingOffsets") or EARLIEST
        self.until = options.get("changes_until") or options.get("endingOffsets") or LATEST

    def partitions(self) -> Sequence[InputPartition]:
        regions = region_changes(self.reading.open())
        start = resolve(self.since, regions)
        until = None if self.until == LATEST else ChangeOffsets.parse(self.until)
        return self.reading.slices(start, end_offsets(start, regions, until), regions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self.reading.read_slice(partition)
