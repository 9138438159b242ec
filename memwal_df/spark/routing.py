"""Routing inside Spark: each row gets its region (column `__memwal_region`), then rows are
repartitioned by it so that every region is written by exactly one task.

Two ways, one result (the routing of `memwal_df.write.table_writer.TableWriter`):
* a `bucket` / `multi_bucket` spec over integer, boolean or date columns: Lance's bucket,
  ``(murmur3(x) & 0x7fffffff) % N`` with the Spark-style Murmur3_x86_32 at seed 0, as a Spark
  expression (32-bit arithmetic on bigints; Spark's own `hash()` has seed 42). The route value is
  the bucket number.
* any other spec: `mapInArrow` conforms each batch to the table schema, evaluates the spec with
  `RegionSpec.evaluate` (vectorized) and sets the region id, as the table writer derives it.

Both are pure functions of a row's region values, so rows of one region share a route value and
`repartition` puts them into one partition (a partition may hold several regions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from memwal_df.errors import RegionRoutingError
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.regions.transforms import Bucket, MultiBucket, Unsharded
from memwal_df.format.schema import check_columns, conform
from memwal_df.table import Table
from memwal_df.write.partial import partial_schema
from memwal_df.write.table_writer import region_of_row, value_codes

ROUTE = "__memwal_region"

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_HADD = 0xE6546B64
_INT_TYPES = (pa.types.is_int8, pa.types.is_int16, pa.types.is_int32, pa.types.is_date32, pa.types.is_boolean)


def _hashed_as(t: pa.DataType) -> str | None:
    """The hash kind ("int" or "long") of types whose Lance hash is expressible in Spark, else None."""
    if any(test(t) for test in _INT_TYPES):
        return "int"
    if pa.types.is_int64(t):
        return "long"
    return None


class _Stages:
    """Builds an expression as a chain of projections: each step's value becomes a column, so a
    value used twice is not copied into the expression tree (Murmur3 would grow exponentially)."""

    def __init__(self, df: DataFrame) -> None:
        self.df = df
        self._n = 0

    def let(self, expr: Column) -> Column:
        name = f"__memwal_h{self._n}"
        self._n += 1
        self.df = self.df.withColumn(name, expr)
        return F.col(name)

    def drop(self) -> DataFrame:
        return self.df.drop(*[f"__memwal_h{i}" for i in range(self._n)])


def _mul32(s: _Stages, a: Column, c: int) -> Column:
    """``(a * c) mod 2**32`` for a bigint 0 <= a < 2**32, without overflowing 64 bits."""
    lo = a * F.lit(c & 0xFFFF)
    hi = F.shiftleft((a * F.lit(c >> 16)).bitwiseAND(F.lit(0xFFFF)), 16)
    return s.let((lo + hi).bitwiseAND(F.lit(_M32)))


def _rotl(s: _Stages, x: Column, r: int) -> Column:
    return s.let(F.shiftleft(x, r).bitwiseOR(F.shiftright(x, 32 - r)).bitwiseAND(F.lit(_M32)))


def _mix_k1(s: _Stages, k: Column) -> Column:
    return _mul32(s, _rotl(s, _mul32(s, k, _C1), 15), _C2)


def _mix_h1(s: _Stages, h: Column, k: Column) -> Column:
    x = _mul32(s, _rotl(s, s.let(h.bitwiseXOR(k)), 13), 5)
    return s.let((x + F.lit(_HADD)).bitwiseAND(F.lit(_M32)))


def _fmix(s: _Stages, h: Column, length: int) -> Column:
    h = s.let(h.bitwiseXOR(F.lit(length)))
    h = s.let(h.bitwiseXOR(F.shiftright(h, 16)))
    h = _mul32(s, h, _F1)
    h = s.let(h.bitwiseXOR(F.shiftright(h, 13)))
    h = _mul32(s, h, _F2)
    return s.let(h.bitwiseXOR(F.shiftright(h, 16)))


def _murmur3(s: _Stages, value: Column, kind: str, seed: Column) -> Column:
    """Spark-style Murmur3_x86_32 of a non-NULL int / long `value` with a u32 `seed` (bigints)."""
    if kind == "int":
        return _fmix(s, _mix_h1(s, seed, _mix_k1(s, s.let(value.bitwiseAND(F.lit(_M32))))), 4)
    low = s.let(value.bitwiseAND(F.lit(_M32)))
    high = s.let(F.shiftright(value, 32).bitwiseAND(F.lit(_M32)))
    return _fmix(s, _mix_h1(s, _mix_h1(s, seed, _mix_k1(s, low)), _mix_k1(s, high)), 8)


def _source(table: Table, source_id: int) -> tuple[str, pa.DataType] | None:
    name = table.schema.names_by_id.get(source_id)
    return None if name is None else (name, table.schema.schema.field(name).type)


def _bucket_expression(df: DataFrame, table: Table, spec: RegionSpec) -> DataFrame | None:
    """`df` with the bucket number as `ROUTE`, when the spec is one bucket field over columns whose
    hash Spark can compute; else None."""
    if len(spec.fields) != 1:
        return None
    field = spec.fields[0]
    transform = field.transform
    if not isinstance(transform, Bucket | MultiBucket):
        return None
    sources = [_source(table, sid) for sid in field.source_ids]
    if any(src is None or _hashed_as(src[1]) is None for src in sources):
        return None
    s = _Stages(df)
    h = F.lit(0).cast("bigint")
    for name, arrow_type in sources:  # type: ignore[misc]
        value = s.let(_as_bigint(F.col(name), arrow_type))
        hashed = _murmur3(s, value, _hashed_as(arrow_type), h)  # type: ignore[arg-type]
        h = s.let(F.when(value.isNull(), h).otherwise(hashed))  # NULLs are skipped
    bucket = h.bitwiseAND(F.lit(0x7FFFFFFF)) % F.lit(transform.num_buckets)
    s.df = s.df.withColumn(ROUTE, bucket.cast("int"))
    return s.drop()


def _as_bigint(col: Column, arrow_type: pa.DataType) -> Column:
    """The value Lance hashes, as a bigint: days for dates, 0/1 for booleans."""
    if pa.types.is_date32(arrow_type):
        return F.datediff(col, F.lit("1970-01-01").cast("date")).cast("bigint")
    return col.cast("int" if pa.types.is_boolean(arrow_type) else "bigint").cast("bigint")


def arrow_routes(table: Table) -> Callable[[pa.Table], pa.Array]:
    """A function from rows (every column of the table, or the key columns of keys to delete) to
    each row's region id (strings), exactly as `TableWriter` routes them: rows are conformed to the
    table schema, the spec is evaluated, and each distinct value tuple's region id is derived once."""
    spec, ts = _spec(table), table.schema

    def routes(rows: pa.Table) -> pa.Array:
        keys = set(rows.column_names) <= set(ts.primary_key)  # rows of key columns: keys to delete
        values = spec.evaluate(conform(rows, ts.key_schema if keys else ts.schema, keys=keys), ts.field_ids)
        _, first, inverse = np.unique(
            value_codes(values, rows.num_rows), return_index=True, return_inverse=True
        )
        ids = [str(table.region_id_for(region_of_row(values, int(row)))) for row in first]
        return pa.array(np.asarray(ids, dtype=object)[inverse], type=pa.string())

    return routes


def _spec(table: Table) -> RegionSpec:
    if table.spec is None:
        raise RegionRoutingError("the table has no region spec, so rows cannot be routed")
    return table.spec


def check_routable(table: Table, columns: list[str], keys_only: bool, partial: bool = False) -> RegionSpec:
    """The table's region spec, after checking that rows of `columns` can be written and routed with
    it, as `TableWriter` checks them: the primary-key columns if `keys_only`, the key and any other
    columns if `partial` (`memwal_df.write.partial.partial_schema`), else every column of the table
    (`memwal_df.format.schema.check_columns`: `SchemaMismatchError`, `MissingColumnsError`), and a
    spec that a key alone routes (`RegionRoutingError`)."""
    spec, ts = _spec(table), table.schema
    if keys_only:
        check_columns(columns, ts.key_schema, what="delete keys", keys=True)
    elif partial:
        partial_schema(ts, columns)
        if not spec.reads_only(ts.field_ids[c] for c in columns):
            raise RegionRoutingError("the region spec reads columns the partial rows do not carry")
    else:
        check_columns(columns, ts.schema)
    if keys_only and not spec.reads_only(ts.field_ids[c] for c in ts.primary_key):
        raise RegionRoutingError("the region spec reads non-key columns, so a key alone cannot be routed")
    return spec


def route(df: DataFrame, table: Table, keys_only: bool = False, partial: bool = False) -> DataFrame:
    """`df` with its rows' region in `ROUTE`, repartitioned so each region is in one partition.

    `keys_only`: `df` holds primary keys to delete (the spec must read key columns only); `partial`:
    `df` holds the primary key and some other columns (a partial upsert)."""
    spec = check_routable(table, df.columns, keys_only, partial)
    if isinstance(spec.fields[0].transform, Unsharded) and len(spec.fields) == 1:
        return df.withColumn(ROUTE, F.lit(0)).repartition(1)
    routed = _bucket_expression(df, table, spec)
    if routed is None:
        routed = df.mapInArrow(
            _route_batches(table), StructType([*df.schema.fields, StructField(ROUTE, StringType(), False)])
        )
    partitions = spec.num_regions or int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or 1)
    return routed.repartition(max(1, partitions), ROUTE)


def _route_batches(table: Table) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    uri, options = table.uri, table.storage_options

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from memwal_df.table import open_table

        routes = arrow_routes(open_table(uri, options or None))
        for batch in batches:
            region = routes(pa.Table.from_batches([batch]))
            yield batch.append_column(ROUTE, region)

    return run
