"""AntiJoinScanExec: the base table's rows in one span whose key no newer level holds.

Guarantees: every output row is a base row of the span (`_rowaddr` in `[start, stop)`), matches the
pushed filter, and has a key that is not in the `shadow` key set (the keys of every newer level);
output columns are exactly `columns`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from memwal_df.read.exec.base import ExecNode
from memwal_df.read.expr.lance_filter import split_for_lance
from memwal_df.read.expr.predicate import referenced_columns
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.scan.spans import BaseSpan

__all__ = ["AntiJoinScanExec"]


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
