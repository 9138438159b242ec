"""TopKExec: the global top-k of its children's rows by one column.

Guarantees: at most `k` rows, ordered by `by` (ascending, or descending with `descending=True`),
ties broken by the children's order; every row comes from a child unchanged. Output schema: `schema`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa

from memwal_df.exec.base import ExecNode

__all__ = ["TopKExec"]


class TopKExec(ExecNode):
    """The best `k` rows of all children by `by`."""

    def __init__(
        self, children: Sequence[ExecNode], k: int, by: str, schema: pa.Schema, descending: bool = False
    ) -> None:
        self._children = list(children)
        self.k = k
        self.by = by
        self.schema = schema
        self.descending = descending

    @property
    def children(self) -> list[ExecNode]:
        return list(self._children)

    def describe(self) -> str:
        order = "DESC" if self.descending else "ASC"
        return f"TopKExec: k={self.k}, order_by=[{self.by} {order}]"

    def execute(self) -> Iterator[pa.RecordBatch]:
        batches = [b for child in self._children for b in child.execute()]
        rows = pa.Table.from_batches(batches, schema=self.schema)
        if rows.num_rows == 0 or self.k <= 0:
            return
        order = "descending" if self.descending else "ascending"
        yield from rows.sort_by([(self.by, order)]).slice(0, self.k).combine_chunks().to_batches()
