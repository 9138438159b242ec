"""UnionExec: the children's outputs one after another.

Guarantees: children run in order, each only after the previous one is exhausted, and only while the
consumer keeps pulling; batches pass through unchanged (cast to `schema` when one is given). No
deduplication: the children must not overlap (point lookups hand each key to exactly one child).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa

from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.batches import conform_batch

__all__ = ["UnionExec"]


class UnionExec(ExecNode):
    """Concatenates its children's batches lazily, child by child."""

    def __init__(self, children: Sequence[ExecNode], schema: pa.Schema | None = None) -> None:
        self._children = list(children)
        self.schema = schema

    @property
    def children(self) -> list[ExecNode]:
        return list(self._children)

    def describe(self) -> str:
        return f"UnionExec: inputs={len(self._children)}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        for child in self._children:
            for batch in child.execute():
                if batch.num_rows:
                    yield conform_batch(batch, self.schema)
