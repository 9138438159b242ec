"""GlobalBM25Exec: full-text search with BM25 over the deduplicated table, above one `Bm25Exec` per level.

It sums each level's share of the corpus statistics (N, the token count and df per query term, over
the level's live documents only: see `memwal_df.read.search.fts.terms`), hands the totals to every
`Bm25Exec`, then takes the best `k` of all of them (`TopKExec`).

Guarantees: at most `k` rows, the table's columns plus `_score`, best first, each scored with the
statistics of the whole deduplicated table; nothing when the query has no terms or the corpus is
empty.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from memwal_df.read.search.fts.bm25 import Bm25Exec
from memwal_df.read.search.fts.terms import SCORE, CorpusStats
from memwal_df.read.search.ranked import TopKExec

__all__ = ["GlobalBM25Exec"]


class GlobalBM25Exec(TopKExec):
    """Sums the levels' corpus statistics, gives the totals to each level, then takes the top `k`."""

    def __init__(self, arms: Sequence[Bm25Exec], terms: Sequence[str], k: int, schema: pa.Schema) -> None:
        super().__init__(arms, k, SCORE, schema, descending=True)
        self.bm25_arms = list(arms)
        self.terms = list(terms)
        self.stats: CorpusStats | None = None

    def describe(self) -> str:
        line = f"GlobalBM25Exec: k={self.k}, order_by=[{SCORE} DESC], terms={self.terms}"
        if self.stats is None:
            return line
        df = dict(zip(self.terms, self.stats.df.astype(int).tolist(), strict=True))
        return line + f", docs={self.stats.num_docs}, avgdl={self.stats.avgdl:.3f}, df={df}"

    def execute(self) -> Iterator[pa.RecordBatch]:
        parts = [arm.corpus() for arm in self.bm25_arms]
        df = np.sum([p.df for p in parts], axis=0) if parts else np.zeros(len(self.terms))
        self.stats = CorpusStats(sum(p.num_docs for p in parts), sum(p.total_len for p in parts), df)
        if not self.terms or self.stats.num_docs == 0:
            return
        for arm in self.bm25_arms:
            arm.stats = self.stats
        yield from super().execute()
