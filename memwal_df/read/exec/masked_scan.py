"""MaskedScanExec: the base table's rows in one span, minus the rows newer levels shadow, by row address.

The shadowed rows are known by row address (`BaseShadow`, from the base key index), so the scan is a
plain Lance scan of the span with the pushed filter, and each batch drops the rows whose address is
shadowed: no key column is read or compared. `count(*)` without a filter reads nothing when the span's
fragments have no deletions in the part it covers: the live rows are counted from fragment metadata
and the shadowed ones from the shadow's sorted addresses.

Guarantees: every output row is a live base row of the span (`_rowaddr` in `[start, stop)`), matches the
pushed filter, and is not shadowed; output columns are exactly `columns` (for none, batches with a row
count and no column).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from memwal_df.read.base_keys import BaseShadow, fragment_signature
from memwal_df.read.batches import count_batch
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.lance_filter import split_for_lance
from memwal_df.read.predicate import referenced_columns
from memwal_df.read.spans import BaseSpan

__all__ = ["SCAN_BATCH_ROWS", "MaskedScanExec"]

SCAN_BATCH_ROWS = 131_072
"""Rows per batch read from Lance: DataFusion's Python dataset route costs a fixed amount per batch."""

_ADDR = "_rowaddr"


class MaskedScanExec(ExecNode):
    """Rows of a span of the base table that no newer level shadows."""

    def __init__(
        self,
        base: Any,
        span: BaseSpan,
        columns: Sequence[str],
        filter: Any,
        shadow: Callable[[], Sequence[BaseShadow]],
        note: str = "",
    ) -> None:
        self.base = base
        self.span = span
        self.columns = list(columns)
        self.filter = filter
        self.shadow = shadow  # computed once per query, shared by the partitions
        self.note = note  # why these fragments were chosen, for `explain`
        self.counted = False  # set when `count(*)` was answered without a scan

    @property
    def fragment_ids(self) -> list[int]:
        return list(self.span.fragment_ids)

    def describe(self) -> str:
        line = (
            f"MaskedScanExec: base v{self.base.version} {self.span.describe()} minus rows newer levels shadow"
        )
        if self.filter is not None:
            line += f", filter={self.filter}"
        if self.note:
            line += f" ({self.note})"
        return line + (" (counted from metadata)" if self.counted else "")

    def _ranges(self) -> list[tuple[Any, int, int, bool]]:
        """(fragment, first offset, end offset, whole fragment) of each fragment the span covers."""
        out = []
        for fid in self.span.fragment_ids:
            fragment = self.base.get_fragment(fid)
            rows = int(fragment.metadata.physical_rows)
            lo = max(self.span.start, fid << 32) - (fid << 32)
            hi = min(self.span.stop, (fid << 32) | rows) - (fid << 32)
            if hi > lo:
                out.append((fragment, lo, hi, lo == 0 and hi == rows))
        return out

    def _whole_fragments(self) -> bool:
        return all(whole for *_, whole in self._ranges())

    def _live_count(self) -> int:
        """The live rows of the span: from metadata where it tells, else counted by a row-address scan."""
        total = 0
        for fragment, lo, hi, whole in self._ranges():
            sig = fragment_signature(fragment)
            if whole:
                total += sig.physical_rows - sig.deleted_rows
            elif not sig.deleted_rows:
                total += hi - lo
            else:
                fid = fragment.fragment_id
                flt = f"_rowaddr >= {fid << 32 | lo} AND _rowaddr < {fid << 32 | hi}"
                total += self.base.scanner(
                    columns=[], with_row_address=True, fragments=[fragment], filter=flt
                ).count_rows()
        return total

    def execute(self) -> Iterator[pa.RecordBatch]:
        shadow = self.shadow()
        if not self.columns and self.filter is None:
            self.counted = True
            n = self._live_count() - sum(p.count_between(self.span.start, self.span.stop) for p in shadow)
            if n:
                yield count_batch(n)
            return
        sql, residual = split_for_lance(self.filter, self.base.schema)
        needed = list(self.columns)
        if residual is not None:
            needed = list(dict.fromkeys([*needed, *sorted(referenced_columns(residual))]))
        fragments = [self.base.get_fragment(i) for i in self.span.fragment_ids]
        rows = None if self._whole_fragments() else self.span.sql()
        flt = rows if sql is None else (sql if rows is None else f"({rows}) AND ({sql})")
        scanner = self.base.scanner(
            columns=needed,
            filter=flt,
            fragments=fragments,
            with_row_address=bool(shadow) or not needed,  # Lance scans no rows of no column
            batch_size=SCAN_BATCH_ROWS,
        )
        for batch in scanner.to_batches():
            if not batch.num_rows:
                continue
            if shadow:
                addrs = batch.column(_ADDR).to_numpy()
                hidden = shadow[0].hidden(addrs)
                for part in shadow[1:]:
                    hidden |= part.hidden(addrs)
                if hidden.any():
                    batch = batch.filter(pa.array(~hidden))
            if batch.num_rows and residual is not None:
                batch = batch.filter(residual)
            if batch.num_rows:
                yield batch.select(self.columns) if batch.num_columns != len(self.columns) else batch
