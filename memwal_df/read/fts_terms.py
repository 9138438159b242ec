"""Full-text search machinery: BM25 term statistics over the deduplicated table, and per level the
postings of its text column.

Corpus: the live, newest rows of the whole table whose text is not NULL (a row a newer level replaces
or deletes does not count, nor does a tombstone). Per query term t and document d:

    score(d) = sum over the query's distinct terms t in d of
               idf(t) * tf(t, d) * (K1 + 1) / (tf(t, d) + K1 * (1 - B + B * len(d) / avgdl))
    idf(t)   = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),   K1 = 1.2, B = 0.75 (Lance's)

with N the number of documents, avgdl their mean length in tokens and df(t) the number of documents
holding t, all over the corpus (`CorpusStats`, summed over the levels' shares).

Each level keeps an in-memory term index (postings: documents and term frequencies per term, document
lengths, keys): `TermIndex`, built with pyarrow/numpy from one read of its key and text columns (Lance
14 does not expose its inverted index's postings or statistics through Python), or for a MemTable
`PairTerms`, from its writer's MemTable index (no text read or tokenized per query). A level's live
documents (`live_documents`) are those whose key no newer level holds (exact key sets): each newer
level's keys are located among the level's sorted keys, and the answer for a pair of immutable levels
(generation or base version, newer generation) is kept per process.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.keys import KeySet, key_array
from memwal_df.read.levels import GenerationLevel
from memwal_df.read.newer_levels import NewerLevels
from memwal_df.write.memtable_index import TermRows

__all__ = [
    "B",
    "K1",
    "SCORE",
    "CorpusStats",
    "FtsQuery",
    "PairTerms",
    "TermIndex",
    "Terms",
    "live_documents",
]

SCORE = "_score"
K1 = 1.2
B = 0.75


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


def live_documents(index: Terms, newer: NewerLevels, owner: str | None) -> np.ndarray:
    """The level's corpus documents whose key no newer level holds. Each newer level's keys are
    located among the level's (one lookup per newer key); when the level is immutable (`owner` names
    it: a generation, or a base version), a newer generation's answer is kept with that generation."""
    live = index.in_corpus.copy()
    for level in newer.levels:
        key_set = level.key_set(newer.primary_key, newer.key_type)
        if key_set is None:
            continue
        if owner is not None and isinstance(level, GenerationLevel):
            hits = level.cached(f"hides-in:{owner}", functools.partial(index.positions_of, key_set))
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
