"""Spans of the base table's rows by row address, to split a scan across partitions.

Guarantees: `base_spans` covers every row of the fragments given exactly once, in row-address order,
with at most `count` spans of about equal size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BaseSpan", "base_spans", "id_ranges"]


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


def id_ranges(ids: Sequence[int]) -> str:
    """`[0-3,7]`: ids as sorted runs."""
    if not ids:
        return "[]"
    a = np.asarray(sorted(ids))
    breaks = np.flatnonzero(np.diff(a) != 1)
    starts = np.r_[a[0], a[breaks + 1]]
    ends = np.r_[a[breaks], a[-1]]
    return "[" + ",".join(f"{s}" if s == e else f"{s}-{e}" for s, e in zip(starts, ends, strict=True)) + "]"
