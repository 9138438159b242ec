"""Bm25Exec: BM25 ranking of one level's live documents (the base table, a generation or a MemTable).

Scores use the corpus statistics of the whole deduplicated table (`memwal_df.read.search.fts.terms`), which
`GlobalBM25Exec` sums from every level's share (`corpus()`) and sets before `top`. A level's
documents come in `TermPart`s: one for a generation (term index built once per process) or a
MemTable (once per query), one per fragment for the base table (`memwal_df.read.search.fts.base_terms`: term
indexes kept per fragment across base versions; positions are row addresses).

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
from memwal_df.format.storage import Storage
from memwal_df.read.expr.predicate import referenced_columns
from memwal_df.read.lsm.fragments import take_addresses
from memwal_df.read.lsm.levels import GenerationLevel, Level, MemTableLevel
from memwal_df.read.search.fts.base_terms import base_parts
from memwal_df.read.search.fts.terms import (
    K1,
    SCORE,
    B,
    CorpusStats,
    FtsQuery,
    PairTerms,
    TermIndex,
    TermPart,
    Terms,
    live_documents,
)
from memwal_df.read.search.ranked import POSITION, RankedExec, grow
from memwal_df.read.search.staleness import NewerLevels

__all__ = ["Bm25Exec"]


class Bm25Exec(RankedExec):
    """BM25 ranking of one level's live documents with the global statistics (set before `top`)."""

    schema: pa.Schema  # always known: set by the constructor

    def __init__(
        self,
        label: str,
        newer: NewerLevels,
        parts: Sequence[TermPart],
        terms: Sequence[str],
        k: int,
        take: Callable[[np.ndarray, Sequence[str]], pa.Table],
        schema: pa.Schema,
        post_filter: pc.Expression | None = None,
    ) -> None:
        self.label = label
        self.newer = newer
        self.parts = list(parts)
        self.terms = list(terms)
        self.k = k
        self.score = SCORE
        self.descending = True
        self._take = take
        self.schema = schema.append(pa.field(SCORE, pa.float64()))
        self.post_filter = post_filter
        self.stats: CorpusStats | None = None

    @classmethod
    def for_base(
        cls, base: lance.LanceDataset, storage: Storage, q: FtsQuery, newer: NewerLevels
    ) -> Bm25Exec:
        """The base table's ranking; its live documents are those whose key no level in `newer` holds."""
        parts = base_parts(base, storage, q.column, q.tokenizer, newer)

        def take(addresses: np.ndarray, columns: Sequence[str]) -> pa.Table:
            return take_addresses(base, addresses, columns)

        label = f"base v{base.version} ({len(parts)} fragments)"
        return cls(label, newer, parts, q.terms, q.k, take, q.table_schema, q.filter)

    @classmethod
    def for_level(cls, level: Level, q: FtsQuery, newer: NewerLevels, searchable: bool = True) -> Bm25Exec:
        """A level's ranking; `searchable=False` (a region the filter prunes): statistics only."""
        pk, column, tokenizer, filter = newer.primary_key, q.column, q.tokenizer, q.filter

        def build() -> Terms:
            source = level.source if isinstance(level, MemTableLevel) else None
            indexed = source.terms(column) if source is not None else None
            if indexed is not None and indexed.tokenizer == tokenizer:
                assert isinstance(level, MemTableLevel) and source is not None
                keys = level.keys(pk)
                return PairTerms.of_memtable(indexed, source.positions, keys)
            return TermIndex.build(level.read([*pk, column, TOMBSTONE]), column, pk, tokenizer)

        index = level.memo(f"terms:{column}:{tokenizer}", build)
        owner = level if isinstance(level, GenerationLevel) else None
        live = live_documents(index, newer, owner, column)
        if not searchable:
            eligible = np.zeros_like(live)
        elif filter is None:
            eligible = live
        else:
            eligible = live & level.filter_mask(filter)

        label = level.label + ("" if searchable else " (statistics only)")
        part = TermPart(index, live, eligible)
        return cls(label, newer, [part], q.terms, q.k, level.take, q.table_schema)

    def describe(self) -> str:
        f = "" if self.post_filter is None else f", filter={self.post_filter}"
        return f"Bm25Exec: {self.label}, live = not in {self.newer.describe()}{f}"

    def corpus(self) -> CorpusStats:
        """This level's share of the corpus statistics (its live documents)."""
        shares = [part.corpus(self.terms) for part in self.parts]
        df = np.sum([s.df for s in shares], axis=0) if shares else np.zeros(len(self.terms))
        return CorpusStats(sum(s.num_docs for s in shares), sum(s.total_len for s in shares), df)

    def _scored(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions of the eligible documents holding a query term, their scores), unordered. Each
        part contributes its eligible postings; the scores are computed per term over all parts."""
        stats = self.stats
        assert stats is not None, "GlobalBM25Exec sets the statistics first"
        positions_of, scores_of = [], []
        for i, idf in enumerate(stats.idf()):
            positions, tfs, lengths = [], [], []
            for part in self.parts:
                docs, tf = part.postings(self.terms)[i]
                if len(docs) == 0:
                    continue
                alive = part.eligible[docs]
                docs = docs[alive]
                positions.append(docs + np.int64(part.first))
                tfs.append(tf[alive])
                lengths.append(part.index.doc_len[docs])
            if positions and stats.avgdl:  # avgdl 0: no live document holds any term
                tf = _joined(tfs).astype(np.float64)
                norm = K1 * (1 - B + B * _joined(lengths) / stats.avgdl)
                positions_of.append(_joined(positions))
                scores_of.append(idf * tf * (K1 + 1) / (tf + norm))
        if len(positions_of) <= 1:
            return (positions_of[0], scores_of[0]) if positions_of else (np.zeros(0, np.int64), np.zeros(0))
        unique, inverse = np.unique(np.concatenate(positions_of), return_inverse=True)
        return unique, np.bincount(inverse, weights=np.concatenate(scores_of), minlength=len(unique))

    def _ranked(self, n: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(positions, scores) of the `n` best eligible documents holding a query term (None: all of
        them), best first, ties by position."""
        positions, scores = self._scored()
        if n is not None and n < len(scores):
            threshold = np.partition(scores, len(scores) - n)[len(scores) - n]
            best = scores >= threshold  # the n best and every tie of the n-th
            positions, scores = positions[best], scores[best]
        order = np.lexsort((positions, -scores))[:n]
        return positions[order], scores[order]

    def top(self, n: int) -> pa.Table:
        docs, scores = self._ranked(n if self.post_filter is None else None)
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


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays one after the other (the array itself when there is one: no copy)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
