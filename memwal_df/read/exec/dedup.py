"""DeduplicateExec: the live, newest rows of one region's unmerged levels, as an anti-join by level.

Levels are read newest first. Each level already holds at most one row per key, so a row of level L
is the newest version of its key exactly when no newer level of the region holds that key (a
tombstone included). The operator therefore probes each level's rows against the keys of the newer
levels (`LevelKeys`: one `KeySet` grown level by level, shared with the base table's shadow) and drops
the rows whose key is there; tombstones are dropped from the output but shadow older levels. This is
the spec's "newest by (_gen, _rowaddr)" without hashing or sorting any level whole.

The pushed filter is applied to each level's rows after the anti-join decision is made from the
level's full key set, so a stale row that matches the filter can never stand in for a newer row that
does not (filtering before deduplication would resurrect it).

Guarantees: output rows are live (not deleted), newest per key, match `filter`, and carry exactly
`columns`; unmerged levels whose directory was garbage-collected are skipped (their rows are in the
base), a collected gap level of a catch-up plan raises `MissingGenerationError`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.keyset import KeySet, key_array
from memwal_df.read.predicate import referenced_columns, split_for_lance
from memwal_df.read.snapshot import RegionLevels

__all__ = ["AntiJoinScanExec", "BaseSpan", "DeduplicateExec", "LevelKeys", "base_spans", "id_ranges"]


class LevelKeys:
    """The keys of a region's first `i` levels (newest first), built level by level and shared by the
    region's `DeduplicateExec` (which needs them for i = 1, 2, ...) and the base table's shadow (which
    needs all of them). Each level's keys are merged into the previous prefix once; the newest prefix
    is kept, so consumers that go forward, as both do, never rebuild it. Thread-safe."""

    def __init__(self, region: RegionLevels, primary_key: Sequence[str], key_type: pa.DataType) -> None:
        self.region = region
        self.primary_key = list(primary_key)
        self._type = key_type
        self._lock = threading.Lock()
        self._count = 0
        self._keys = KeySet.union([], key_type)

    def upto(self, count: int) -> KeySet:
        """The keys of `levels[:count]` (levels that are gone hold none)."""
        with self._lock:
            if count < self._count:
                self._count, self._keys = 0, KeySet.union([], self._type)
            while self._count < count:
                keys = self.region.levels[self._count].keys(self.primary_key)
                if keys is not None:
                    self._keys = self._keys.add(keys)
                self._count += 1
            return self._keys

    def all(self) -> KeySet:
        return self.upto(len(self.region.levels))


class DeduplicateExec(ExecNode):
    """Newest live rows of one region's levels (not the base table). The last `gap` levels are
    generations merged into the base but not covered by the index a catch-up plan reads the base
    through (see `memwal_df.read.catchup`): they stand in for base rows, so they must be readable."""

    def __init__(
        self,
        keys: LevelKeys,
        columns: Sequence[str],
        filter: Any = None,
        schema: pa.Schema | None = None,
        gap: int = 0,
        gap_index: str = "",
    ) -> None:
        self.keys = keys
        self.region = keys.region
        self.schema = schema
        self.primary_key = keys.primary_key
        self.columns = list(columns)
        self.filter = filter
        self.gap = gap
        self.gap_index = gap_index

    def describe(self) -> str:
        names = [f"{lv.kind[0]}{lv.generation}" for lv in self.region.levels]
        split = len(names) - self.gap
        line = f"DeduplicateExec: region {self.region.region_id} levels=[{', '.join(names[:split])}]"
        if self.gap:
            line += f" then merged, not in {self.gap_index}: [{', '.join(names[split:])}]"
        f = "" if self.filter is None else f", filter={self.filter}"
        return f"{line} (newest first){f}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        needed = list(dict.fromkeys([*self.columns, *self.primary_key, TOMBSTONE]))
        levels = self.region.levels
        first_gap = len(levels) - self.gap
        for i, level in enumerate(levels):
            rows = level.to_table(needed, self.filter, self.schema)
            if rows is None:
                if i >= first_gap:
                    raise MissingGenerationError(
                        f"{level.name} was garbage-collected while a catch-up plan read it instead of"
                        " the base fragments that hold its rows; run the query again"
                    )
                continue  # garbage-collected: its rows are in the base table
            row_keys = key_array([rows.column(c) for c in self.primary_key])
            if self.filter is None:
                level.set_keys(row_keys)  # every key of the level: no second read
            if not rows.num_rows:
                continue
            keep = pc.invert(rows.column(TOMBSTONE)).to_numpy(zero_copy_only=False)
            if i and len(shadow := self.keys.upto(i)):
                keep &= ~shadow.contains(row_keys)
            if not self.columns:  # count(*): only the number of rows matters
                if n := int(keep.sum()):
                    yield pa.record_batch([pa.nulls(n)], names=["n"]).select([])
            else:
                out = rows.filter(pa.array(keep)) if not keep.all() else rows
                yield from out.select(self.columns).to_batches()


@dataclass(frozen=True)
class BaseSpan:
    """The base rows whose row address (`fragment_id << 32 | offset`) is in `[start, stop)`, read from
    `fragment_ids` (every fragment the span touches). Spans split one large fragment across partitions;
    the `_rowaddr` range is exact (deleted rows stay hidden) and Lance reads only that part of it."""

    fragment_ids: tuple[int, ...]
    start: int
    stop: int

    def sql(self) -> str:
        return f"_rowaddr >= {self.start} AND _rowaddr < {self.stop}"

    def describe(self) -> str:
        def addr(a: int) -> str:
            return f"{a >> 32}:{a & 0xFFFFFFFF}"

        return f"fragments={id_ranges(self.fragment_ids)} rows [{addr(self.start)}, {addr(self.stop)})"


def base_spans(fragments: Sequence[tuple[int, int]], count: int, min_rows: int) -> list[BaseSpan]:
    """At most `count` contiguous spans of about equal size (at least `min_rows` rows each, except the
    last) covering every row of `fragments`, given as (fragment id, physical rows) in any order."""
    frags = sorted((f, n) for f, n in fragments if n > 0)
    total = sum(n for _, n in frags)
    if not total:
        return []
    size = max(-(-total // max(count, 1)), min_rows)
    spans: list[BaseSpan] = []
    ids: list[int] = []
    start, filled = frags[0][0] << 32, 0
    for fid, rows in frags:
        offset = 0
        while offset < rows:
            take = min(rows - offset, size - filled)
            ids.append(fid)
            offset += take
            filled += take
            if filled == size:
                stop = fid << 32 | offset
                spans.append(BaseSpan(tuple(ids), start, stop))
                ids, start, filled = [], stop, 0
    if ids:
        spans.append(BaseSpan(tuple(ids), start, frags[-1][0] << 32 | frags[-1][1]))
    return spans


class AntiJoinScanExec(ExecNode):
    """Rows of a span of the base table whose key is in no newer level (the `shadow` key set).

    The base table holds one row per key, so the pushed filter goes into the Lance scan itself, with
    the span's `_rowaddr` range. Any filter makes Lance read the other columns late, by row address,
    and a `_rowaddr` range over whole fragments makes Lance's scan several times faster than a plain
    scan of a wide base (a vector column). `note` says why these fragments were chosen (index
    coverage), for `explain`."""

    def __init__(
        self,
        base: Any,
        span: BaseSpan,
        primary_key: Sequence[str],
        columns: Sequence[str],
        filter: Any,
        shadow: Any,
        note: str = "",
    ) -> None:
        self.base = base
        self.span = span
        self.primary_key = list(primary_key)
        self.columns = list(columns)
        self.filter = filter
        self.shadow = shadow  # a zero-argument callable returning the KeySet (computed once, shared)
        self.note = note

    @property
    def fragment_ids(self) -> list[int]:
        return list(self.span.fragment_ids)

    def describe(self) -> str:
        line = (
            f"AntiJoinScanExec: base v{self.base.version} {self.span.describe()} minus keys of newer levels"
        )
        if self.filter is not None:
            line += f", filter={self.filter}"
        return line + (f" ({self.note})" if self.note else "")

    def execute(self) -> Iterator[pa.RecordBatch]:
        shadow: KeySet = self.shadow()
        sql, residual = split_for_lance(self.filter, self.base.schema)
        extra = [*self.primary_key] if len(shadow) or not self.columns else []
        if residual is not None:
            extra += sorted(referenced_columns(residual))
        needed = list(dict.fromkeys([*self.columns, *extra]))
        fragments = [self.base.get_fragment(i) for i in self.span.fragment_ids]
        rows = self.span.sql()
        flt = rows if sql is None else f"({rows}) AND ({sql})"
        for batch in self.base.scanner(columns=needed, filter=flt, fragments=fragments).to_batches():
            if batch.num_rows and residual is not None:
                batch = batch.filter(residual)
            if batch.num_rows and len(shadow):
                hit = shadow.contains(key_array([batch.column(c) for c in self.primary_key]))
                if hit.any():
                    batch = batch.filter(pa.array(~hit))
            if batch.num_rows:
                yield batch.select(self.columns) if needed != self.columns else batch


def id_ranges(ids: Sequence[int]) -> str:
    """`[0-3,7]`: ids as sorted runs."""
    if not ids:
        return "[]"
    a = np.asarray(sorted(ids))
    breaks = np.flatnonzero(np.diff(a) != 1)
    starts = np.r_[a[0], a[breaks + 1]]
    ends = np.r_[a[breaks], a[-1]]
    return "[" + ",".join(f"{s}" if s == e else f"{s}-{e}" for s, e in zip(starts, ends, strict=True)) + "]"
