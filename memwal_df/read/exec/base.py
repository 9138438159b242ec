"""The operator interface: a node of a small tree that yields Arrow record batches.

Guarantees: `execute()` is lazy (a generator), so work stops as soon as the consumer stops pulling
(DataFusion does not push LIMIT down); `explain()` shows the tree exactly as it will run. The
point-lookup operators (TakeLastExec, BloomFilterGuardExec, CoalesceFirstExec, UnionExec) also keep:

* Construction does no I/O: a plan can be built, explained and thrown away for free.
* `execute()` yields only non-empty batches; an operator that knows its output schema sets `schema`
  (then `to_table()` works on an empty result too).
* `describe()` is one line. After `execute()` it may also report what happened (for example how many
  keys a bloom filter let through).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import pyarrow as pa

__all__ = ["ExecNode"]


class ExecNode(ABC):
    """An operator over Arrow batches."""

    schema: pa.Schema | None = None  # the output schema, when the operator knows it

    @abstractmethod
    def execute(self) -> Iterator[pa.RecordBatch]:
        """The operator's output, produced lazily."""

    @abstractmethod
    def describe(self) -> str:
        """One line naming the operator and what it works on."""

    @property
    def children(self) -> list[ExecNode]:
        return []

    def explain(self, indent: int = 0) -> list[str]:
        """The tree below this node as indented lines."""
        lines = ["  " * indent + self.describe()]
        for child in self.children:
            lines.extend(child.explain(indent + 1))
        return lines

    def to_table(self) -> pa.Table:
        """Run the operator to the end and gather its output (convenience for tests and small results)."""
        batches = list(self.execute())
        if self.schema is not None:
            return pa.Table.from_batches(batches, schema=self.schema)
        if not batches:
            raise ValueError(f"{type(self).__name__} produced no rows and knows no schema")
        return pa.Table.from_batches(batches)
