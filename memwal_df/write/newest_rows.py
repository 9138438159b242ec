"""Newest-first resolution of a write's keys over a stack of levels, for the current rows of partial and
conditional writes (`memwal_df.write.partial`).

Guarantees: each asked key is answered by the newest level that holds it; a tombstone there means the
key has no live row, and older levels are not asked for it. Each level is asked only for the keys the
newer ones did not hold, in one vectorized call (`KeyedLevel.find`), so a write of n keys over m levels
costs m calls, not n. The rows returned are live rows only, one per key held, conformed to the asked
schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE


class KeyedLevel(Protocol):
    """One level of a region as a writer's lookup asks it."""

    def find(
        self, keys: pa.Table | None, asked: pa.Array, columns: Sequence[str]
    ) -> tuple[pa.Table, np.ndarray]:
        """(the level's newest row of each asked key it holds, tombstones included: `columns` and
        `_tombstone`, other columns allowed; one bool per asked key: whether the level holds it).
        `asked` are the keys `pk_index_key`-encoded, `keys` the same keys as key columns (None when
        the caller has none: in-memory levels do not need them); both may repeat a key."""
        ...


def newest_rows(
    levels: Sequence[KeyedLevel], asked: pa.Array, schema: pa.Schema, keys: pa.Table | None = None
) -> tuple[pa.Table, np.ndarray]:
    """(the live rows of the asked keys, `schema`'s columns and types, from the newest of `levels`
    (newest first) holding each key; one bool per asked key: whether a level held it, live or
    deleted)."""
    wanted = pa.schema([*schema, pa.field(TOMBSTONE, pa.bool_())])
    resolved = np.zeros(len(asked), dtype=bool)
    found: list[pa.Table] = []
    for level in levels:
        pending = np.flatnonzero(~resolved)
        if len(pending) == 0:
            break
        if len(pending) == len(asked):
            rows, hit = level.find(keys, asked, schema.names)
        else:
            at = pa.array(pending)
            rows, hit = level.find(None if keys is None else keys.take(at), asked.take(at), schema.names)
        resolved[pending[hit]] = True
        if rows.num_rows:
            found.append(_conformed(rows, wanted))
    if not found:
        return schema.empty_table(), resolved
    rows = found[0] if len(found) == 1 else pa.concat_tables(found)
    deleted = rows.column(TOMBSTONE)
    if pc.any(deleted).as_py():  # (a NULL flag counts as live)
        rows = rows.filter(pc.invert(pc.fill_null(deleted, False)))
    return rows.drop_columns([TOMBSTONE]), resolved


def _conformed(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` with exactly `schema`'s columns and types."""
    if rows.schema == schema:
        return rows
    rows = rows.select(schema.names)
    return rows if rows.schema == schema else rows.cast(schema)
