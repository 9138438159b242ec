"""The operator interface: a node of a small tree that yields Arrow record batches.

Guarantees: `execute()` is lazy (a generator), so work stops as soon as the consumer stops pulling
(DataFusion does not push LIMIT down); `explain()` shows the tree exactly as it will run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import pyarrow as pa


class ExecNode(ABC):
    """An operator over Arrow batches."""

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
