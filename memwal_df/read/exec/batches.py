"""Arrow batches and schemas shaped to an operator's declared output."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

__all__ = ["conform_batch", "count_batch", "projected_schema"]


def conform_batch(batch: pa.RecordBatch, schema: pa.Schema | None) -> pa.RecordBatch:
    """`batch` with exactly `schema`'s columns, types and metadata (unchanged when `schema` is None)."""
    if schema is None or batch.schema.equals(schema, check_metadata=True):
        return batch
    arrays = []
    for f in schema:
        col = batch.column(f.name)
        arrays.append(col if col.type == f.type else col.cast(f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def projected_schema(schema: pa.Schema, columns: Sequence[str]) -> pa.Schema:
    """The fields of `schema` named by `columns`, in that order."""
    return pa.schema([schema.field(c) for c in columns])


def count_batch(n: int) -> pa.RecordBatch:
    """A batch of `n` rows and no column: what an operator yields when DataFusion only counts rows."""
    return pa.record_batch([pa.nulls(n)], names=["n"]).select([])
