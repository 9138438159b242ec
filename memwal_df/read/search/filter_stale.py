"""FilterStaleExec: drops search candidates that a newer level of the LSM tree replaces or deletes.

A search ranks the rows of each level on its own (the base table, each region's generations and
MemTables). A candidate from level L is stale when its key exists in a level newer than L: for a
generation or MemTable, the newer levels of its region; for the base table, every unmerged level of
the regions read. `NewerLevels` (`memwal_df.read.search.staleness`) tests the keys exactly.

`FilterStaleExec` makes a level's search exact despite stale rows: it asks its child for the best `n`
candidates (n = k * overfetch at first), drops the stale ones, and asks again with 4n while fewer
than `k` survive and the child has more. Guarantees: `top(k)` is the child's best `k` live candidates
of the last round (all of them when the level holds fewer), best first.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from memwal_df.read.exec.base import ExecNode
from memwal_df.read.search.ranked import RankedExec, grow
from memwal_df.read.search.staleness import NewerLevels

__all__ = ["FilterStaleExec"]


class FilterStaleExec(RankedExec):
    """The best candidates of one level whose key no newer level holds."""

    def __init__(self, child: RankedExec, newer: NewerLevels, overfetch: int = 2) -> None:
        self.child = child
        self.newer = newer
        self.k = child.k
        self.score = child.score
        self.descending = child.descending
        self.overfetch = overfetch
        self.fetched: int | None = None  # candidates asked of the child in the last round (after execute)

    @property
    def children(self) -> list[ExecNode]:
        return [self.child]

    def describe(self) -> str:
        line = f"FilterStaleExec: k={self.k}, newer={self.newer.describe()}"
        return line if self.fetched is None else line + f", fetched={self.fetched}"

    def _fetch(self, n: int) -> pa.Table:
        self.fetched = n
        return self.child.top(n)

    def _live(self, candidates: pa.Table) -> pa.Table:
        stale = self.newer.stale(candidates)
        return candidates.filter(pa.array(~stale)) if stale.any() else candidates

    def top(self, n: int) -> pa.Table:
        return grow(self._fetch, self._live, n, n * self.overfetch)

    def rows(self, positions: np.ndarray) -> pa.Table:
        return self.child.rows(positions)
