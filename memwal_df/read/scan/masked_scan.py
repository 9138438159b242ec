"""MaskedScanExec: the base table's rows in one span, minus the rows newer levels shadow, by row address.

The shadowed rows are known by row address (`BaseShadow`, from the base key index), so the scan is a
plain Lance scan of the span with the pushed filter, and each batch drops the rows whose address is
shadowed: no key column is read or compared.

Spans: without a filter a span counts live rows (`live=True`: positions among a fragment's rows its
deletion file keeps), read with Lance's offset and limit; with a filter it counts physical rows, read
with a `_rowaddr` range (Lance applies offset and limit after the filter, so live positions cannot
split a filtered scan). A span that covers whole fragments reads them with neither.

Fragments with a deletion file (every fragment a merge updated or deleted rows of) of at least
`DIRECT_MIN_ROWS` rows are read from their data file directly (`lance.file.LanceFileReader`, one
Lance v2 file holding every column), minus the rows the deletion file lists (read by
`memwal_df.format.deletion_files`), the pushed filter applied in Arrow: Lance's own scan of such a
fragment costs several times that of one without, however few rows it deletes. Other fragments (and
every fragment when the exec has no storage) are read through Lance's scanner. The first rows of a
Lance scan come from a small scan of their own (`HEAD_ROWS`), so a query that stops early (`LIMIT`
without `ORDER BY`, which DataFusion does not push down) does not wait for a large batch.

`count(*)` without a filter (no column, no filter) is arithmetic: the live rows of every fragment
(fragment metadata) minus the shadowed rows (every shadowed address is a live row), answered whole
by the partition marked `counts_all` while the others answer nothing.

Guarantees: every output row is a live base row of the span, matches the pushed filter, and is not
shadowed; output columns are exactly `columns` (for none, batches with a row count and no column).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

from memwal_df.format.deletion_files import deleted_offsets
from memwal_df.format.storage import Storage
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.batches import count_batch
from memwal_df.read.expr.lance_filter import split_for_lance
from memwal_df.read.expr.predicate import referenced_columns
from memwal_df.read.lsm.base_key_index import ShadowSet, fragment_signatures
from memwal_df.read.scan.spans import BaseSpan

__all__ = ["SCAN_BATCH_ROWS", "MaskedScanExec", "fragment_rows"]

SCAN_BATCH_ROWS = 131_072
"""Rows per batch read from Lance: DataFusion's Python dataset route costs a fixed amount per batch."""
DIRECT_MIN_ROWS = 65_536
"""A fragment with a deletion file and at least this many physical rows is read from its data file
directly: below it, opening the file costs more than Lance's handling of its deletion file."""
HEAD_ROWS = 8_192
"""Rows of a scan's first, separate Lance scan: its first batch arrives in a fraction of the time a
`SCAN_BATCH_ROWS` batch takes."""

_ADDR = "_rowaddr"


def fragment_rows(base: Any, live: bool) -> dict[int, int]:
    """Each fragment's live rows (`live`) or physical rows, from its metadata, in fragment id order."""
    return {
        fid: sig.physical_rows - sig.deleted_rows if live else sig.physical_rows
        for fid, sig in fragment_signatures(base).items()
    }


class MaskedScanExec(ExecNode):
    """Rows of a span of the base table that no newer level shadows."""

    def __init__(
        self,
        base: Any,
        span: BaseSpan,
        columns: Sequence[str],
        filter: Any,
        shadow: Callable[[], ShadowSet],
        *,
        live: bool,
        counts_all: bool,
        note: str = "",
        storage: Storage | None = None,
    ) -> None:
        self.base = base
        self.storage = storage  # the base's, for its deletion files and data files read directly
        self.span = span
        self.columns = list(columns)
        self.filter = filter
        self.shadow = shadow  # computed once per query, shared by the partitions
        self.live = live
        self.counts_all = counts_all
        self.note = note  # why these fragments were chosen, for `explain`
        self.counted = False  # set when `count(*)` was answered without a scan

    @property
    def fragment_ids(self) -> list[int]:
        return list(self.span.fragment_ids)

    def describe(self) -> str:
        rows = "live rows" if self.live else "rows"
        line = f"MaskedScanExec: base v{self.base.version} {self.span.describe()} ({rows})"
        line += " minus rows newer levels shadow"
        if self.filter is not None:
            line += f", filter={self.filter}"
        if self.note:
            line += f" ({self.note})"
        return line + (" (counted from metadata)" if self.counted else "")

    def _pieces(self) -> list[tuple[Any, int, int, bool]]:
        """(fragment, first row, end row, whole fragment) of each fragment the span covers, in the
        span's coordinates (live or physical rows)."""
        out = []
        counts = fragment_rows(self.base, self.live)
        for fid in self.span.fragment_ids:
            fragment = self.base.get_fragment(fid)
            rows = counts[fid]
            lo = max(self.span.start, fid << 32) - (fid << 32)
            hi = min(self.span.stop, (fid << 32) | rows) - (fid << 32)
            if hi > lo:
                out.append((fragment, lo, hi, lo == 0 and hi == rows))
        return out

    def _count(self, shadow: ShadowSet) -> int:
        """The live, unshadowed rows of the whole base version."""
        live = sum(fragment_rows(self.base, True).values())
        return live - len(shadow)

    def execute(self) -> Iterator[pa.RecordBatch]:
        shadow = self.shadow()
        if not self.columns and self.filter is None:
            self.counted = True
            if self.counts_all and (n := self._count(shadow)):
                yield count_batch(n)
            return
        sql, residual = split_for_lance(self.filter, self.base.schema)
        needed = list(self.columns)
        if residual is not None:
            needed = list(dict.fromkeys([*needed, *sorted(referenced_columns(residual))]))
        pieces = self._pieces()
        direct = [p for p in pieces if self._direct_readable(p[0])]
        lance_pieces = [p for p in pieces if not self._direct_readable(p[0])]
        batches = self._scan(lance_pieces, needed, sql, with_addr=bool(len(shadow)) or not needed)
        if direct:  # fragments with deletion files: their data files read directly, the filter in Arrow
            wanted = list(dict.fromkeys([*self.columns, *sorted(referenced_columns(self.filter))]))
            batches = itertools.chain(self._direct(direct, wanted, shadow), batches)
        for batch in batches:
            if not batch.num_rows:
                continue
            if len(shadow) and _ADDR in batch.schema.names:
                hidden = shadow.hidden(batch.column(_ADDR).to_numpy())
                if hidden.any():
                    batch = batch.filter(pa.array(~hidden))
            if batch.num_rows and residual is not None:
                batch = batch.filter(residual)
            if batch.num_rows:
                yield batch.select(self.columns) if batch.num_columns != len(self.columns) else batch

    def _scan(
        self, pieces: list[tuple[Any, int, int, bool]], columns: list[str], sql: str | None, with_addr: bool
    ) -> Iterator[pa.RecordBatch]:
        """The span's rows matching `sql`: whole fragments in one Lance scan, each part of a fragment in
        its own (by offset and limit in live rows, by `_rowaddr` range in physical rows). The first
        `HEAD_ROWS` rows of the first scan that can be split come from a scan of their own, so a query
        that stops early (`LIMIT` without `ORDER BY`, which DataFusion does not push down) does not
        wait for a `SCAN_BATCH_ROWS` batch."""
        options = {"columns": columns, "with_row_address": with_addr, "batch_size": SCAN_BATCH_ROWS}
        whole = [f for f, *_, w in pieces if w]
        ranges: list[tuple[list[Any], int, int | None]] = []
        if whole and self.live and sql is None:  # live rows of all of them, as offsets
            ranges.append((whole, 0, sum(hi for _, _, hi, w in pieces if w)))
        elif whole:
            ranges.append((whole, 0, None))
        ranges.extend(([f], lo, hi) for f, lo, hi, w in pieces if not w)
        head = True
        for fragments, lo, hi in ranges:
            if head and hi is not None and hi - lo > HEAD_ROWS:
                yield from self._range(fragments, lo, lo + HEAD_ROWS, sql, options)
                lo += HEAD_ROWS
            head = head and hi is None
            yield from self._range(fragments, lo, hi, sql, options)

    def _range(
        self, fragments: list[Any], lo: int, hi: int | None, sql: str | None, options: dict[str, Any]
    ) -> Iterator[pa.RecordBatch]:
        """One Lance scan of rows [lo, hi) of `fragments` (every row when `hi` is None): live rows by
        offset and limit, physical rows (one fragment) by `_rowaddr` range."""
        if hi is None:
            scanner = self.base.scanner(fragments=fragments, filter=sql, **options)
        elif self.live:
            scanner = self.base.scanner(fragments=fragments, filter=sql, offset=lo, limit=hi - lo, **options)
        else:
            fid = fragments[0].fragment_id
            rows = f"_rowaddr >= {fid << 32 | lo} AND _rowaddr < {fid << 32 | hi}"
            flt = rows if sql is None else f"({rows}) AND ({sql})"
            scanner = self.base.scanner(fragments=fragments, filter=flt, **options)
        yield from scanner.to_batches()

    def _direct_readable(self, fragment: Any) -> bool:
        """Whether the fragment is read from its data file directly: it has a deletion file (Lance's
        scan of such a fragment costs several times that of one without, whatever it deletes), and
        one Lance v2 data file holding every column."""
        m = fragment.metadata
        if self.storage is None or m.deletion_file is None or m.deletion_file.base_id is not None:
            return False
        if (m.physical_rows or 0) < DIRECT_MIN_ROWS:
            return False
        files = m.files
        return (
            len(files) == 1
            and files[0].base_id is None
            and files[0].file_major_version == 2
            and len(files[0].fields) == len(self.base.schema)
        )

    def _direct(
        self, pieces: list[tuple[Any, int, int, bool]], columns: list[str], shadow: ShadowSet
    ) -> Iterator[pa.RecordBatch]:
        """The pieces' live rows matching the filter: their physical rows minus the deletion file's
        (read from it), `columns` of the data file, with `_rowaddr` when rows are shadowed."""
        assert self.storage is not None and columns
        for fragment, lo, hi, _ in pieces:
            dead = deleted_offsets(self.storage, fragment)
            if self.live:  # live row k is physical row k + (deleted rows at or before it)
                shifted = dead - np.arange(len(dead))
                lo = lo + int(np.searchsorted(shifted, lo, side="right"))
                hi = hi + int(np.searchsorted(shifted, hi - 1, side="right")) if hi > 0 else 0
            if hi <= lo:
                continue
            path = self.storage.child_uri(f"data/{fragment.metadata.files[0].path}")
            reader = LanceFileReader(path, self.storage.storage_options or None, columns=columns)
            start, base = lo, np.uint64(fragment.fragment_id << 32)
            head = min(hi - lo, HEAD_ROWS)  # a small first read, as for Lance scans
            reads = [reader.read_range(lo, head, batch_size=SCAN_BATCH_ROWS)]
            if hi - lo > head:
                reads.append(reader.read_range(lo + head, hi - lo - head, batch_size=SCAN_BATCH_ROWS))
            for batch in (b for r in reads for b in r.to_batches()):
                n = batch.num_rows
                keep = np.ones(n, dtype=bool)
                keep[dead[(dead >= start) & (dead < start + n)] - start] = False
                if len(shadow):
                    batch = batch.append_column(
                        _ADDR, pa.array(np.arange(start, start + n, dtype=np.uint64) | base)
                    )
                start += n
                if not keep.all():
                    batch = batch.filter(pa.array(keep))
                if self.filter is not None and batch.num_rows:
                    batch = batch.filter(self.filter)
                yield batch
