"""What a stored row looks like: the row model shared by WAL entries and flushed generations.

A stored row holds the table's columns, each field carrying its Lance field id as `lance:field_id`
metadata, then `_tombstone: bool not null` (true: the row deletes its primary key).
"""

from __future__ import annotations

import pyarrow as pa

TOMBSTONE = "_tombstone"
FIELD_ID_KEY = b"lance:field_id"


def wal_schema(table_schema: pa.Schema, field_ids: dict[str, int]) -> pa.Schema:
    """The schema of WAL entries (and flushed generations): the table's columns with their
    `lance:field_id` metadata, then `_tombstone: bool not null`."""
    fields = []
    for f in table_schema:
        meta = dict(f.metadata or {})
        meta[FIELD_ID_KEY] = str(field_ids[f.name]).encode()
        fields.append(f.with_metadata(meta))
    fields.append(pa.field(TOMBSTONE, pa.bool_(), nullable=False))
    return pa.schema(fields)
