"""Full-text search with BM25 over the deduplicated table: `Bm25Exec` per level, `GlobalBM25Exec` above.

Corpus: the live, newest rows of the whole table whose text is not NULL (a row a newer level replaces
or deletes does not count, nor does a tombstone). Per query term t and document d:

    score(d) = sum over the query's distinct terms t in d of
               idf(t) * tf(t, d) * (K1 + 1) / (tf(t, d) + K1 * (1 - B + B * len(d) / avgdl))
    idf(t)   = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),   K1 = 1.2, B = 0.75 (Lance's)

with N the number of documents, avgdl their mean length in tokens and df(t) the number of documents
holding t, all over the corpus. `GlobalBM25Exec` sums each level's share of N, of the token count
and of df (its live documents only) and hands the totals to every `Bm25Exec` before it ranks.

Each level keeps an in-memory term index (postings: documents and term frequencies per term, document
lengths, keys), built with pyarrow/numpy from one read of its key and text columns: once per process
for a generation, once per pinned version for the base table (Lance 14 does not expose its inverted
index's postings or statistics through Python). A MemTable's comes from its writer's MemTable index
(`PairTerms`: no text read or tokenized per query) when it was built with the same tokenizer, else it
is built per query. A level's live
documents are those whose key no newer level holds (exact key sets): each newer level's keys are
located among the level's sorted keys, and the answer for a pair of immutable levels (generation or
base version, newer generation) is kept per process.

Guarantees: `Bm25Exec.top(n)` is the level's `n` best live documents that match the filter, best
first, ties by position; scores are float64.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.exec.base import short_id
from memwal_df.read.exec.filter_stale import NewerLevels, level_key_set
from memwal_df.read.exec.keyset import KeySet, key_array
from memwal_df.read.exec.ranked import POSITION, RankedExec, TopKExec, grow
from memwal_df.read.levels import filter_mask, level_cached, read_level, take_rows
from memwal_df.read.predicate import referenced_columns
from memwal_df.read.snapshot import ImmutableCache, Level
from memwal_df.write.memtable_index import TermRows

__all__ = [
    "B",
    "K1",
    "SCORE",
    "Bm25Exec",
    "CorpusStats",
    "FtsQuery",
    "GlobalBM25Exec",
    "PairTerms",
    "TermIndex",
    "Terms",
]

SCORE = "_score"
K1 = 1.2
B = 0.75
_BASE_INDEXES = ImmutableCache(capacity=2)  # term indexes of pinned base versions (large)


@dataclass
class Terms(ABC):
    """A level's documents (by position) and the postings of their terms."""

    doc_len: np.ndarray  # tokens per document (int64)
    in_corpus: np.ndarray  # bool: not a tombstone, text not NULL
    keys: pa.Array  # key of each document
    vocab: Mapping[str, int]
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, kw_only=True)

    @abstractmethod
    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """(documents holding `term`, its frequency in each)."""

    def positions_of(self, key_set: KeySet) -> np.ndarray:
        """Positions of the documents whose key is in `key_set` (one binary search per key of the set
        for integer keys: the sorted keys are computed once per index)."""
        wanted = key_set.to_array()
        if len(wanted) == 0:
            return np.zeros(0, np.int64)
        if not pa.types.is_integer(self.keys.type):
            found = pc.index_in(wanted.cast(self.keys.type), value_set=self.keys).drop_null()
            return found.to_numpy().astype(np.int64)
        if self._sorted is None:
            keys = self.keys.to_numpy(zero_copy_only=False).astype(np.int64)
            order = np.argsort(keys, kind="stable")
            self._sorted = keys[order], order
        sorted_keys, order = self._sorted
        probe = wanted.to_numpy(zero_copy_only=False).astype(np.int64)
        at = np.minimum(np.searchsorted(sorted_keys, probe), len(sorted_keys) - 1)
        return order[at[sorted_keys[at] == probe]] if len(sorted_keys) else np.zeros(0, np.int64)


@dataclass
class TermIndex(Terms):
    """Postings of one level's text column, built from its rows: per term, in CSR form."""

    offsets: np.ndarray  # postings of term i: [offsets[i], offsets[i + 1])
    docs: np.ndarray
    tf: np.ndarray

    @classmethod
    def build(
        cls, rows: pa.Table, column: str, primary_key: Sequence[str], tokenizer: Tokenizer
    ) -> TermIndex:
        n = rows.num_rows
        text = rows.column(column)
        in_corpus = text.is_valid().to_numpy(zero_copy_only=False) if n else np.zeros(0, bool)
        if TOMBSTONE in rows.column_names:
            in_corpus &= ~rows.column(TOMBSTONE).to_numpy(zero_copy_only=False).astype(bool)
        doc, tokens = tokenizer.tokenize(text)
        vocab_size = max(len(tokens.dictionary), 1)
        pairs = doc.astype(np.int64) * vocab_size + tokens.indices.to_numpy(zero_copy_only=False)
        pairs, tf = np.unique(pairs, return_counts=True)
        term = pairs % vocab_size
        order = np.argsort(term, kind="stable")
        offsets = np.searchsorted(term[order], np.arange(len(tokens.dictionary) + 1))
        return cls(
            doc_len=np.bincount(doc, minlength=n).astype(np.int64),
            in_corpus=in_corpus,
            keys=key_array([rows.column(c) for c in primary_key]),
            vocab={t: i for i, t in enumerate(tokens.dictionary.to_pylist())},
            offsets=offsets,
            docs=(pairs // vocab_size)[order].astype(np.int32 if n < 2**31 else np.int64),
            tf=tf[order].astype(np.int32),
        )

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        i = self.vocab.get(term)
        if i is None:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.docs[lo:hi], self.tf[lo:hi]


@dataclass
class PairTerms(Terms):
    """Postings of a MemTable level from the writer's MemTable index: (document, term, tf) pairs in
    document order, scanned per query term (no per-query sort or tokenization)."""

    pair_doc: np.ndarray
    pair_term: np.ndarray
    pair_tf: np.ndarray

    @classmethod
    def of_memtable(cls, rows: TermRows, positions: np.ndarray | None, keys: pa.Array) -> PairTerms:
        """The postings of the MemTable rows at `positions` (None: every row), as documents 0, 1, ..."""
        pair_doc, pair_term, pair_tf = rows.pair_row, rows.pair_term, rows.pair_tf
        doc_len, in_corpus = rows.doc_len, rows.in_corpus
        if positions is not None:
            doc_of_row = np.full(len(rows.doc_len), -1, np.int32)
            doc_of_row[positions] = np.arange(len(positions), dtype=np.int32)
            pair_doc = doc_of_row[pair_doc]
            kept = pair_doc >= 0
            pair_doc, pair_term, pair_tf = pair_doc[kept], pair_term[kept], pair_tf[kept]
            doc_len, in_corpus = doc_len[positions], in_corpus[positions]
        return cls(doc_len, in_corpus, keys, rows.vocab, pair_doc, pair_term, pair_tf)

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        i = self.vocab.get(term)
        if i is None:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        at = np.flatnonzero(self.pair_term == i)
        return self.pair_doc[at], self.pair_tf[at]


@dataclass(frozen=True)
class CorpusStats:
    """N, avgdl and df per query term over the deduplicated corpus."""

    num_docs: int
    total_len: int
    df: np.ndarray

    @property
    def avgdl(self) -> float:
        return self.total_len / self.num_docs if self.num_docs else 0.0

    def idf(self) -> np.ndarray:
        return np.log1p((self.num_docs - self.df + 0.5) / (self.df + 0.5))


def _live(index: Terms, newer: NewerLevels, owner: str | None) -> np.ndarray:
    """The level's corpus documents whose key no newer level holds. Each newer level's keys are
    located among the level's (one lookup per newer key); when the level is immutable (`owner` names
    it: a generation, or a base version), a newer generation's answer is kept with that generation."""
    live = index.in_corpus.copy()
    for level in newer.levels:
        key_set = level_key_set(level, newer.primary_key, newer.key_type)
        if key_set is None:
            continue
        if owner is not None and level.kind == "generation":
            hits = level.cached(f"hides-in:{owner}", lambda ks=key_set: index.positions_of(ks))
        else:
            hits = index.positions_of(key_set)
        live[hits] = False
    return live


@dataclass(frozen=True)
class FtsQuery:
    """One full-text search: the `k` live documents that best match `terms` (tokenized with
    `tokenizer`) in `column`, among the rows that match `filter`, of a table with `table_schema`."""

    column: str
    tokenizer: Tokenizer
    terms: tuple[str, ...]
    k: int
    filter: pc.Expression | None
    table_schema: pa.Schema

    @property
    def schema(self) -> pa.Schema:
        """The output schema: the table's columns, then `_score`."""
        return self.table_schema.append(pa.field(SCORE, pa.float64()))


class Bm25Exec(RankedExec):
    """BM25 ranking of one level's live documents with the global statistics (set before `top`)."""

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
        live = _live(index, newer, f"{base.uri}:v{base.version}:{column}")

        def take(positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
            return base.take(pa.array(positions, pa.int64()), columns=list(columns))

        label = f"base v{base.version}, live = not in {newer.describe()}"
        return cls(label, index, q.terms, q.k, live, live, take, q.table_schema, q.filter)

    @classmethod
    def for_level(cls, level: Level, q: FtsQuery, newer: NewerLevels, searchable: bool = True) -> Bm25Exec:
        """A level's ranking; `searchable=False` (a region the filter prunes): statistics only."""
        pk, column, tokenizer, filter = newer.primary_key, q.column, q.tokenizer, q.filter

        def build() -> Terms:
            indexed = level.source.terms(column) if level.source is not None else None
            if indexed is not None and indexed.tokenizer == tokenizer:
                assert level.table is not None
                keys = key_array([level.table.column(c) for c in pk])
                return PairTerms.of_memtable(indexed, level.source.positions, keys)  # type: ignore[union-attr]
            return TermIndex.build(read_level(level, [*pk, column, TOMBSTONE]), column, pk, tokenizer)

        index = level_cached(level, f"terms:{column}:{tokenizer}", build)
        live = _live(index, newer, f"{level.uri}:{column}" if level.kind == "generation" else None)
        if not searchable:
            eligible = np.zeros_like(live)
        elif filter is None:
            eligible = live
        else:
            eligible = live & filter_mask(level, filter)  # type: ignore[operator]

        def take(positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
            return take_rows(level, positions, columns)

        where = f"{level.kind} {level.generation} of region {short_id(level.region_id)}"
        label = f"{where}, live = not in {newer.describe()}" + ("" if searchable else " (statistics only)")
        return cls(label, index, q.terms, q.k, live, eligible, take, q.table_schema)

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
