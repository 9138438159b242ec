"""Bm25Exec: BM25 ranking of one level's live documents (the base table, a generation or a MemTable).

Scores use the corpus statistics of the whole deduplicated table (`memwal_df.read.fts_terms`), which
`GlobalBM25Exec` sums from every level's share (`corpus()`) and sets before `top`. The level's term
index is built once per process for a generation, once per pinned version for the base table (the
last two kept), once per query for a MemTable.

Guarantees: `top(n)` is the level's `n` best live documents that match the filter, best first, ties
by position; scores are float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.cache import ImmutableCache
from memwal_df.read.exec.ranked import POSITION, RankedExec, grow
from memwal_df.read.fts_terms import (
    K1,
    SCORE,
    B,
    CorpusStats,
    FtsQuery,
    PairTerms,
    TermIndex,
    Terms,
    live_documents,
)
from memwal_df.read.keys import key_array
from memwal_df.read.levels import GenerationLevel, Level, MemTableLevel
from memwal_df.read.newer_levels import NewerLevels
from memwal_df.read.predicate import referenced_columns

__all__ = ["Bm25Exec"]

_BASE_INDEXES = ImmutableCache(capacity=2)  # term indexes of pinned base versions (large)


class Bm25Exec(RankedExec):
    """BM25 ranking of one level's live documents with the global statistics (set before `top`)."""

    schema: pa.Schema  # always known: set by the constructor

    def __init__(
        self,
        label: str,
        index: Terms,
        terms: Sequence[str],
        k: int,
        live: np.ndarray,
        eligible: np.ndarray,
        take: Callable[[np.ndarray, Sequence[str]], pa.Table],
        schema: pa.Schema,
        post_filter: pc.Expression | None = None,
    ) -> None:
        self.label = label
        self.index = index
        self.terms = list(terms)
        self.k = k
        self.score = SCORE
        self.descending = True
        self.live = live  # documents of the corpus (statistics)
        self.eligible = eligible  # documents that may be returned (live, and matching the filter)
        self._take = take
        self.schema = schema.append(pa.field(SCORE, pa.float64()))
        self.post_filter = post_filter
        self.stats: CorpusStats | None = None

    @classmethod
    def for_base(cls, base: lance.LanceDataset, q: FtsQuery, newer: NewerLevels) -> Bm25Exec:
        """The base table's ranking; its live documents are those whose key no level in `newer` holds."""
        pk, column, tokenizer = newer.primary_key, q.column, q.tokenizer

        def build() -> TermIndex:
            return TermIndex.build(base.to_table(columns=[*pk, column]), column, pk, tokenizer)

        index = _BASE_INDEXES.get(base.uri, f"terms:v{base.version}:{column}:{tokenizer}", build)
        live = live_documents(index, newer, f"{base.uri}:v{base.version}:{column}")

        def take(positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
            return base.take(pa.array(positions, pa.int64()), columns=list(columns))

        label = f"base v{base.version}, live = not in {newer.describe()}"
        return cls(label, index, q.terms, q.k, live, live, take, q.table_schema, q.filter)

    @classmethod
    def for_level(cls, level: Level, q: FtsQuery, newer: NewerLevels, searchable: bool = True) -> Bm25Exec:
        """A level's ranking; `searchable=False` (a region the filter prunes): statistics only."""
        pk, column, tokenizer, filter = newer.primary_key, q.column, q.tokenizer, q.filter

        def build() -> Terms:
            source = level.source if isinstance(level, MemTableLevel) else None
            indexed = source.terms(column) if source is not None else None
            if indexed is not None and indexed.tokenizer == tokenizer:
                assert isinstance(level, MemTableLevel) and source is not None
                keys = key_array([level.table.column(c) for c in pk])
                return PairTerms.of_memtable(indexed, source.positions, keys)
            return TermIndex.build(level.read([*pk, column, TOMBSTONE]), column, pk, tokenizer)

        index = level.memo(f"terms:{column}:{tokenizer}", build)
        owner = f"{level.uri}:{column}" if isinstance(level, GenerationLevel) else None
        live = live_documents(index, newer, owner)
        if not searchable:
            eligible = np.zeros_like(live)
        elif filter is None:
            eligible = live
        else:
            eligible = live & level.filter_mask(filter)

        label = f"{level.label}, live = not in {newer.describe()}"
        label += "" if searchable else " (statistics only)"
        return cls(label, index, q.terms, q.k, live, eligible, level.take, q.table_schema)

    def describe(self) -> str:
        f = "" if self.post_filter is None else f", filter={self.post_filter}"
        return f"Bm25Exec: {self.label}{f}"

    def corpus(self) -> CorpusStats:
        """This level's share of the corpus statistics (its live documents)."""
        df = np.array([int(self.live[self.index.postings(t)[0]].sum()) for t in self.terms], dtype=np.float64)
        return CorpusStats(int(self.live.sum()), int(self.index.doc_len[self.live].sum()), df)

    def _ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """(eligible documents holding a query term, their scores), best first."""
        assert self.stats is not None, "GlobalBM25Exec sets the statistics first"
        stats, index = self.stats, self.index
        parts_docs, parts_scores = [], []
        norm = K1 * (1 - B + B * index.doc_len / stats.avgdl) if stats.num_docs else None
        for idf, term in zip(stats.idf(), self.terms, strict=True):
            docs, tf = index.postings(term)
            alive = self.eligible[docs]
            docs, tf = docs[alive], tf[alive]
            if len(docs):
                assert norm is not None
                parts_docs.append(docs)
                parts_scores.append(idf * tf * (K1 + 1) / (tf + norm[docs]))
        if not parts_docs:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        docs = np.concatenate(parts_docs)
        unique, inverse = np.unique(docs, return_inverse=True)
        total = np.bincount(inverse, weights=np.concatenate(parts_scores), minlength=len(unique))
        order = np.lexsort((unique, -total))
        return unique[order], total[order]

    def top(self, n: int) -> pa.Table:
        docs, scores = self._ranked()
        if self.post_filter is None:
            return pa.table({POSITION: docs[:n], SCORE: scores[:n]})
        needed = sorted(referenced_columns(self.post_filter))

        def fetch(m: int) -> pa.Table:
            rows = self._take(docs[:m], needed)
            return rows.append_column(POSITION, pa.array(docs[:m])).append_column(SCORE, pa.array(scores[:m]))

        def keep(rows: pa.Table) -> pa.Table:
            return rows.filter(self.post_filter)

        return grow(fetch, keep, n, n).select([POSITION, SCORE])

    def rows(self, positions: np.ndarray) -> pa.Table:
        return self._take(positions, self.schema.names[:-1])
