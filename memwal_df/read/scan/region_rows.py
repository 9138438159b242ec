"""RegionRowsExec: the live, newest rows of one region's unmerged levels, read from its region view.

The region's flushed generations are deduplicated once per process and patched as generations are
flushed and merged (`memwal_df.read.scan.region_view`); a writer's MemTable copies, when the query has them,
are deduplicated per query and hide the view's rows of the same keys. The pushed filter is applied
after deduplication, so a stale row that matches it never stands in for a newer row that does not.

Guarantees: output rows are live (no tombstone), the newest version of their key among the region's
levels, match `filter`, and carry exactly `columns` (for none, batches with a row count and no column).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.batches import count_batch
from memwal_df.read.scan.state import RegionRows

__all__ = ["RegionRowsExec"]


class RegionRowsExec(ExecNode):
    """Newest live rows of one region (not the base table), from its view and MemTable copies."""

    def __init__(
        self, label: str, rows: Callable[[], RegionRows], columns: Sequence[str], filter: Any = None
    ) -> None:
        self.label = label
        self.rows = rows
        self.columns = list(columns)
        self.filter = filter
        self._described = ""

    def describe(self) -> str:
        f = "" if self.filter is None else f", filter={self.filter}"
        return f"RegionRowsExec: region {self.label}{self._described}{f}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        region = self.rows()
        gens = [g for g, _ in region.view.generations]
        self._described = f" view of generations {gens}" + (" under MemTable copies" if region.top else "")
        for view, keep in region.live:
            if not keep.any():
                continue
            if not self.columns and self.filter is None:
                yield count_batch(int(np.count_nonzero(keep)))
                continue
            rows = view.rows if keep.all() else view.rows.filter(pa.array(keep))
            if self.filter is not None:
                rows = rows.filter(self.filter)
            if not rows.num_rows:
                continue
            if not self.columns:
                yield count_batch(rows.num_rows)
                continue
            yield from rows.select(self.columns).combine_chunks().to_batches()
