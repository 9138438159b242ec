"""FilterExec: applies the query's filter (pyarrow semantics) and projection to its child's rows.

Used above operators that select rows by key only (point lookups), so that the rest of the pushed
filter still holds exactly. Guarantees: every output row matches `filter`; output columns are exactly
`columns`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from memwal_df.read.exec.base import ExecNode


class FilterExec(ExecNode):
    """Rows of `child` that match `filter`, projected to `columns`."""

    def __init__(self, child: ExecNode, filter: Any, columns: Sequence[str]) -> None:
        self.child = child
        self.filter = filter
        self.columns = list(columns)

    @property
    def children(self) -> list[ExecNode]:
        return [self.child]

    def describe(self) -> str:
        return f"FilterExec: {self.filter}, columns={self.columns}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        for batch in self.child.execute():
            if self.filter is not None and batch.num_rows:
                batch = batch.filter(self.filter)
            if batch.num_rows:
                yield batch.select(self.columns)
