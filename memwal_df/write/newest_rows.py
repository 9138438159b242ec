"""Newest-first resolution of a write's keys over a stack of levels, for the current rows of partial and
conditional writes (`memwal_df.write.partial`).

Guarantees: each asked key is answered by the newest level that holds it; a tombstone there means the
key has no live row, and older levels are not asked for it. Each level is asked only for the keys the
newer ones did not hold, in one vectorized call (`KeyedLevel.find`), so a write of n keys over m levels
costs m calls, not n. The answer (`Found`) points each asked key at its live row, so the merge reads
the current rows in the write's order with one take per column and no second key lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from memwal_df.format.rows import TOMBSTONE


class KeyedLevel(Protocol):
    """One level of a region as a writer's lookup asks it."""

    def find(
        self, keys: pa.Table | None, asked: pa.Array, columns: Sequence[str]
    ) -> tuple[pa.Table, np.ndarray]:
        """(rows of the level: at least `columns` and `_tombstone`; for each asked key, the position in
        those rows of the level's newest row of the key, tombstones included, or -1 where the level
        does not hold it). `asked` are the keys `pk_index_key`-encoded, `keys` the same keys as key
        columns (None when the caller has none: in-memory levels do not need them); both may repeat
        a key."""
        ...


@dataclass(frozen=True)
class Found:
    """The current rows of asked keys: `rows` (the asked columns), `at[i]` the position in `rows` of
    asked key i's live row or -1 (no live row: absent or deleted), `resolved[i]` whether a level held
    key i (live or deleted)."""

    rows: pa.Table
    at: np.ndarray
    resolved: np.ndarray

    def live(self) -> pa.Table:
        """The live rows, one per key."""
        return self.rows.take(pa.array(np.unique(self.at[self.at >= 0])))

    def then(self, older: Found) -> Found:
        """These answers, and `older`'s for the keys these do not resolve (`older` answers exactly
        those keys, in asked order)."""
        at, resolved = self.at.copy(), self.resolved.copy()
        pending = np.flatnonzero(~resolved)
        at[pending] = np.where(older.at >= 0, older.at + self.rows.num_rows, -1)
        resolved[pending] = older.resolved
        if not self.rows.num_rows or not older.rows.num_rows:
            return Found(self.rows if self.rows.num_rows else older.rows, at, resolved)
        return Found(pa.concat_tables([self.rows, older.rows]), at, resolved)


def newest_rows(
    levels: Sequence[KeyedLevel], asked: pa.Array, schema: pa.Schema, keys: pa.Table | None = None
) -> Found:
    """The live row of each asked key (`schema`'s columns and types) from the newest of `levels`
    (newest first) holding the key."""
    wanted = pa.schema([*schema, pa.field(TOMBSTONE, pa.bool_())])
    at = np.full(len(asked), -1, np.int64)
    resolved = np.zeros(len(asked), dtype=bool)
    found: list[pa.Table] = []
    offset = 0
    for level in levels:
        pending = np.flatnonzero(~resolved)
        if len(pending) == 0:
            break
        if len(pending) == len(asked):
            rows, where = level.find(keys, asked, schema.names)
        else:
            idx = pa.array(pending)
            rows, where = level.find(None if keys is None else keys.take(idx), asked.take(idx), schema.names)
        hit = where >= 0
        resolved[pending[hit]] = True
        at[pending[hit]] = where[hit] + offset
        if rows.num_rows:
            found.append(_conformed(rows, wanted))
            offset += rows.num_rows
    if not found:
        return Found(schema.empty_table(), at, resolved)
    rows = found[0] if len(found) == 1 else pa.concat_tables(found)
    deleted = rows.column(TOMBSTONE)  # (a NULL flag counts as live)
    flags = (deleted.fill_null(False) if deleted.null_count else deleted).to_numpy()
    held = at[resolved]
    at[resolved] = np.where(flags[held], -1, held)
    return Found(rows.drop_columns([TOMBSTONE]), at, resolved)


def _conformed(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` with exactly `schema`'s columns, types and nullability."""
    if rows.schema == schema:
        return rows
    rows = rows.select(schema.names)
    if rows.schema == schema:
        return rows
    if rows.schema.types == schema.types:  # (only nullability differs: no cast)
        return pa.Table.from_arrays(rows.columns, schema=schema)
    return rows.cast(schema)
