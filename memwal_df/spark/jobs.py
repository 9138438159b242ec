"""Spark jobs over a memwal table: routed writes and deletes, and merges in parallel tasks."""

from __future__ import annotations

import json
import uuid

from pyspark.sql import DataFrame, SparkSession

from memwal_df.jobs.merger import MergeResult, RegionMerge
from memwal_df.spark.routing import route
from memwal_df.table import Table, open_table


def _open(uri: str | Table, storage_options: dict[str, str] | None) -> Table:
    return uri if isinstance(uri, Table) else open_table(uri, storage_options)


def _save(
    df: DataFrame, table: Table, operation: str, durable: bool, allow_non_key: bool, partial: bool = False
) -> None:
    table.check_writable(allow_non_key)  # here, not wrapped in a Spark error
    writer = df.write.format("memwal").mode("append").option("operation", operation)
    writer = writer.option("partial", str(partial).lower())
    if table.storage_options:
        writer = writer.option("storage_options", json.dumps(table.storage_options))
    writer = writer.option("allow_non_key_region_columns", str(allow_non_key).lower())
    writer.option("durable", str(durable).lower()).save(table.uri)


def write(
    df: DataFrame,
    uri: str | Table,
    storage_options: dict[str, str] | None = None,
    *,
    durable: bool = True,
    allow_non_key_region_columns: bool = False,
    partial: bool = False,
) -> None:
    """Upsert the rows of `df` (every column of the table: an upsert replaces whole rows, so a
    DataFrame lacking a column raises `MissingColumnsError` before any task runs; with `partial` the
    primary key and any other columns, each row updating only those): route them to their regions
    inside Spark and write each region from one task (see `memwal_df.spark.source`).

    Rows with the same key in one call: one of them wins (Spark does not order rows across
    partitions); write them in separate calls to order them. `allow_non_key_region_columns`: as
    `Table.writer`."""
    table = _open(uri, storage_options)
    _save(route(df, table, partial=partial), table, "upsert", durable, allow_non_key_region_columns, partial)


def delete(
    keys: DataFrame, uri: str | Table, storage_options: dict[str, str] | None = None, *, durable: bool = True
) -> None:
    """Delete the rows whose primary keys are the rows of `keys` (the key columns only); the region
    spec must read key columns only."""
    table = _open(uri, storage_options)
    _save(route(keys, table, keys_only=True), table, "delete", durable, False)


def merge(
    spark: SparkSession,
    uri: str | Table,
    storage_options: dict[str, str] | None = None,
    max_generations: int | None = None,
) -> MergeResult:
    """Merge every region's flushed generations into the base table, one Spark task per region.

    Each task runs `Table.merge(regions=[region])`, the merger of `table.merge()`: generations in
    ascending order, progress re-read before each, a commit conflict or a concurrent merger of the
    same region detected through Lance's stale-marker check. Regions' keys are disjoint, so their
    commits rebase onto each other (as `table.merge(parallel=True)`)."""
    table = _open(uri, storage_options)
    ids = [str(r) for r in table.region_ids()]
    ref_uri, options = table.uri, table.storage_options or None

    def merge_region(region: str) -> RegionMerge:
        return (
            open_table(ref_uri, options)
            .merge(regions=[uuid.UUID(region)], max_generations=max_generations)
            .regions[0]
        )

    done = spark.sparkContext.parallelize(ids, max(1, len(ids))).map(merge_region).collect() if ids else []
    table.refresh()
    return MergeResult(tuple(done), table.dataset.version)
