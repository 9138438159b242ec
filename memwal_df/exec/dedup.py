"""DeduplicateExec: the live, newest rows of one region's unmerged levels, as an anti-join by level.

Levels are read newest first. Each level already holds at most one row per key, so a row of level L
is the newest version of its key exactly when no newer level of the region holds that key (a
tombstone included). The operator therefore keeps the keys of the levels it has read in a `KeySet`
and drops older rows whose key is in it; tombstones are dropped from the output but shadow older
levels. This is the spec's "newest by (_gen, _rowaddr)" without hashing or sorting any level whole.

The pushed filter is applied to each level's rows after the anti-join decision is made from the
level's full key set, so a stale row that matches the filter can never stand in for a newer row that
does not (filtering before deduplication would resurrect it).

Guarantees: output rows are live (not deleted), newest per key, match `filter`, and carry exactly
`columns`; levels whose directory was garbage-collected are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.exec.base import ExecNode
from memwal_df.exec.keyset import KeySet, key_array
from memwal_df.predicate import referenced_columns, split_for_lance
from memwal_df.snapshot import RegionLevels
from memwal_df.wal import TOMBSTONE


class DeduplicateExec(ExecNode):
    """Newest live rows of one region's levels (not the base table)."""

    def __init__(
        self,
        region: RegionLevels,
        primary_key: Sequence[str],
        key_type: pa.DataType,
        columns: Sequence[str],
        filter: Any = None,
        schema: pa.Schema | None = None,
    ) -> None:
        self.region = region
        self.schema = schema
        self.primary_key = list(primary_key)
        self.key_type = key_type
        self.columns = list(columns)
        self.filter = filter

    def describe(self) -> str:
        gens = ", ".join(f"{lv.kind[0]}{lv.generation}" for lv in self.region.levels)
        f = "" if self.filter is None else f", filter={self.filter}"
        return f"DeduplicateExec: region {self.region.region_id} levels=[{gens}] (newest first){f}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        needed = list(dict.fromkeys([*self.columns, *self.primary_key, TOMBSTONE]))
        newer: list[pa.Array] = []
        shadow = KeySet.union([], self.key_type)
        levels = self.region.levels
        for i, level in enumerate(levels):
            rows = level.to_table(needed, self.filter, self.schema)
            if rows is None:
                continue  # garbage-collected: its rows are in the base table
            row_keys = key_array([rows.column(c) for c in self.primary_key])
            if self.filter is None:
                level.set_keys(row_keys)  # every key of the level: no second read
            if rows.num_rows:
                keep = pc.invert(rows.column(TOMBSTONE)).to_numpy(zero_copy_only=False)
                if len(shadow):
                    keep &= ~shadow.contains(row_keys)
                if not self.columns:  # count(*): only the number of rows matters
                    if n := int(keep.sum()):
                        yield pa.record_batch([pa.nulls(n)], names=["n"]).select([])
                else:
                    out = rows.filter(pa.array(keep)) if not keep.all() else rows
                    yield from out.select(self.columns).to_batches()
            if i + 1 < len(levels):  # the oldest level shadows nothing
                keys = level.keys(self.primary_key)
                if keys is not None:
                    newer.append(keys)
                    shadow = KeySet.union(newer, self.key_type)


class AntiJoinScanExec(ExecNode):
    """Rows of base-table fragments whose key is in no newer level (the `shadow` key set).

    The base table holds one row per key, so the pushed filter goes into the Lance scan itself."""

    def __init__(
        self,
        base: Any,
        fragment_ids: Sequence[int],
        primary_key: Sequence[str],
        columns: Sequence[str],
        filter: Any,
        shadow: Any,
    ) -> None:
        self.base = base
        self.fragment_ids = list(fragment_ids)
        self.primary_key = list(primary_key)
        self.columns = list(columns)
        self.filter = filter
        self.shadow = shadow  # a zero-argument callable returning the KeySet (computed once, shared)

    def describe(self) -> str:
        f = "" if self.filter is None else f", filter={self.filter}"
        return (
            f"AntiJoinScanExec: base v{self.base.version} fragments={_ranges(self.fragment_ids)}"
            f" minus keys of newer levels{f}"
        )

    def execute(self) -> Iterator[pa.RecordBatch]:
        shadow: KeySet = self.shadow()
        sql, residual = split_for_lance(self.filter, self.base.schema)
        extra = [*self.primary_key] if len(shadow) or not self.columns else []
        if residual is not None:
            extra += sorted(referenced_columns(residual))
        needed = list(dict.fromkeys([*self.columns, *extra]))
        fragments = [self.base.get_fragment(i) for i in self.fragment_ids]
        scanner = self.base.scanner(columns=needed, filter=sql, fragments=fragments)
        for batch in scanner.to_batches():
            if batch.num_rows and residual is not None:
                batch = batch.filter(residual)
            if batch.num_rows and len(shadow):
                hit = shadow.contains(key_array([batch.column(c) for c in self.primary_key]))
                if hit.any():
                    batch = batch.filter(pa.array(~hit))
            if batch.num_rows:
                yield batch.select(self.columns) if needed != self.columns else batch


def _ranges(ids: Sequence[int]) -> str:
    if not ids:
        return "[]"
    a = np.asarray(sorted(ids))
    breaks = np.flatnonzero(np.diff(a) != 1)
    starts = np.r_[a[0], a[breaks + 1]]
    ends = np.r_[a[breaks], a[-1]]
    return "[" + ",".join(f"{s}" if s == e else f"{s}-{e}" for s, e in zip(starts, ends, strict=True)) + "]"
