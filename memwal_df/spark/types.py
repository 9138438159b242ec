"""Arrow <-> Spark types for memwal tables.

Spark has no fixed-size lists: a vector column (`fixed_size_list<float32>[d]`) is a Spark
`array<float>`. Reads turn vectors into variable-size lists; writes cast them back (a row whose
array does not have `d` elements is a `SchemaMismatchError`, raised by `memwal_df.format.schema.conform`).
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import StructField, StructType

from memwal_df.errors import SchemaMismatchError


def _sparkable(t: pa.DataType) -> pa.DataType:
    """`t` with fixed-size lists (at any depth) as variable-size lists."""
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(t.value_field.with_type(_sparkable(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_sparkable(f.type)) for f in t])
    return t


def spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema of a table's Arrow schema; `SchemaMismatchError` for a type Spark lacks."""
    fields = []
    for f in schema:
        try:
            spark_type = from_arrow_type(_sparkable(f.type))
        except Exception as e:  # pyspark raises its own error classes for unsupported types
            raise SchemaMismatchError(f"column {f.name!r} of type {f.type} has no Spark type: {e}") from e
        fields.append(StructField(f.name, spark_type, f.nullable))
    return StructType(fields)


def arrow_schema_for_spark(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects of batches of `schema`."""
    return to_arrow_schema(schema, prefers_large_types=False)


def to_spark_batch(batch: pa.RecordBatch, target: pa.Schema) -> pa.RecordBatch:
    """`batch` (table types) cast to `target` (what Spark expects): vectors become lists."""
    columns = [col.cast(field.type) for col, field in zip(batch.columns, target, strict=True)]
    return pa.RecordBatch.from_arrays(columns, schema=target)
