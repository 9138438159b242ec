"""The KNN operators' common base: one vector search's query, ranked by `_distance` (smallest first).

The operators: `BruteForceKnnExec` (exact, over generations and MemTables, `brute_force_knn.py`) and
`LanceKnnExec` (Lance's `nearest`, over the base table or a large generation, `lance_knn.py`).
Distances are Lance's (`vectors`); rows with a NULL vector and tombstones are never
candidates.
"""

from __future__ import annotations

import pyarrow as pa

from memwal_df.read.search.ranked import RankedExec
from memwal_df.read.search.vector.vectors import DISTANCE, KnnQuery

__all__ = ["KnnExec"]


class KnnExec(RankedExec):
    """A KNN operator: the query's fields as attributes, scored by `_distance`."""

    schema: pa.Schema  # always known: set by the constructor

    def __init__(self, knn: KnnQuery) -> None:
        self.score = DISTANCE
        self.column, self.query, self.metric, self.k = knn.column, knn.query, knn.metric, knn.k
        self.filter = knn.filter
        self.table_schema = knn.table_schema
        self.primary_key = list(knn.primary_key)
        self.schema = knn.schema
