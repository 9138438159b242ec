"""Ranked searches in two phases: candidates per level, then rows for the global winners only.

A `RankedExec` searches one level. `top(n)` returns its best `n` candidates, best first, as a small
table: `_pos` (the row's position, meaningful to that operator's `rows()`), the score column, and the
primary-key columns when a `FilterStaleExec` needs them. No row is read yet. `rows(positions)` reads
the table's columns of those candidates afterwards.

`TopKExec` collects every arm's `top(k)`, orders all candidates by score (ties: arm order, then
position), keeps `k`, and reads the winners' rows (one read per arm that has winners), so a search
over many levels reads at most `k` rows. Arms whose search runs in Lance (`native`: native code that
releases the GIL) run on a pool thread while the calling thread searches the other arms, so the base
table's index search overlaps the in-memory levels' numpy work.

Guarantees: TopKExec's output is at most `k` rows with the table's columns plus the score column,
best first; every row is the row the arm ranked.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait

import numpy as np
import pyarrow as pa

from memwal_df.pools import shared_pool
from memwal_df.read.exec.base import ExecNode

__all__ = ["POSITION", "RankedExec", "TopKExec", "grow"]

POSITION = "_pos"


class RankedExec(ExecNode):
    """One level's search (see the module docstring); `execute()` yields `top(k)`."""

    k: int
    score: str  # the score column
    descending: bool = False  # best = smallest score unless set
    native: bool = False  # `top` spends its time in native code that releases the GIL (a Lance search)

    @abstractmethod
    def top(self, n: int) -> pa.Table:
        """The best `n` candidates, best first (fewer only when the level has no more)."""

    @abstractmethod
    def rows(self, positions: np.ndarray) -> pa.Table:
        """The table's columns of the candidates at `positions` (from the last `top`), in that order."""

    def execute(self) -> Iterator[pa.RecordBatch]:
        yield from self.top(self.k).to_batches()


def grow(
    fetch: Callable[[int], pa.Table], keep: Callable[[pa.Table], pa.Table], want: int, start: int
) -> pa.Table:
    """`keep(fetch(n))` for n = start, 4*start, ... until it has `want` rows or `fetch(n)` returned
    fewer than `n` (the source is exhausted); the first `want` of them."""
    n = max(start, want, 1)
    while True:
        rows = fetch(n)
        kept = keep(rows)
        if kept.num_rows >= want or rows.num_rows < n:
            return kept.slice(0, want)
        n *= 4


class TopKExec(ExecNode):
    """The best `k` candidates of all arms by their score, then their rows."""

    schema: pa.Schema  # always known: set by the constructor

    def __init__(
        self, arms: Sequence[RankedExec], k: int, by: str, schema: pa.Schema, descending: bool = False
    ) -> None:
        self.arms = list(arms)
        self.k = k
        self.by = by
        self.schema = schema
        self.descending = descending

    @property
    def children(self) -> list[ExecNode]:
        return list(self.arms)

    def describe(self) -> str:
        return f"TopKExec: k={self.k}, order_by=[{self.by} {'DESC' if self.descending else 'ASC'}]"

    def execute(self) -> Iterator[pa.RecordBatch]:
        if self.k <= 0 or not self.arms:
            return
        found = _tops(self.arms)
        scores = np.concatenate([c.column(self.by).to_numpy() for c in found])
        arm_of = np.concatenate([np.full(c.num_rows, i) for i, c in enumerate(found)])
        pos = np.concatenate([c.column(POSITION).to_numpy() for c in found])
        if len(scores) == 0:
            return
        best = np.lexsort((pos, arm_of, -scores if self.descending else scores))[: self.k]
        parts, order = [], []
        for i in np.unique(arm_of[best]):
            mine = best[arm_of[best] == i]
            parts.append(self.arms[i].rows(pos[mine]))
            order.append(mine)
        read = np.concatenate(order)  # the candidate index of each row read, in read order
        sorter = np.argsort(read)
        at = sorter[np.searchsorted(read, best, sorter=sorter)]  # where each winner's row was read
        table_schema = pa.schema(list(self.schema)[:-1])
        rows = pa.concat_tables([p.select(table_schema.names).cast(table_schema) for p in parts])
        rows = rows.take(pa.array(at))
        out = rows.append_column(self.by, pa.array(scores[best], self.schema.field(self.by).type))
        yield from out.cast(self.schema).combine_chunks().to_batches()


_OVERLAP_THREADS = 4  # pool threads for native arms; more concurrent queries queue (no nesting)


def _native(node: ExecNode) -> bool:
    return bool(getattr(node, "native", False)) or any(_native(c) for c in node.children)


def _tops(arms: Sequence[RankedExec]) -> list[pa.Table]:
    """Every arm's `top(arm.k)`, in arm order: native arms on the pool, the rest here meanwhile."""
    native = [i for i, arm in enumerate(arms) if _native(arm)]
    if not native or len(arms) == 1:
        return [arm.top(arm.k) for arm in arms]
    pool = shared_pool("ranked", _OVERLAP_THREADS)
    futures = {i: pool.submit(arms[i].top, arms[i].k) for i in native}
    found: dict[int, pa.Table] = {}
    try:
        for i, arm in enumerate(arms):
            if i not in futures:
                found[i] = arm.top(arm.k)
    finally:
        wait(futures.values())  # never leave an arm running after an error here
    found.update((i, f.result()) for i, f in futures.items())
    return [found[i] for i in range(len(arms))]
