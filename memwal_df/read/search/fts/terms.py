"""Full-text search machinery: BM25 term statistics over the deduplicated table, and per level the
postings of its text column.

Corpus: the live, newest rows of the whole table whose text is not NULL (a row a newer level replaces
or deletes does not count, nor does a tombstone). Per query term t and document d:

    score(d) = sum over the query's distinct terms t in d of
               idf(t) * tf(t, d) * (K1 + 1) / (tf(t, d) + K1 * (1 - B + B * len(d) / avgdl))
    idf(t)   = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),   K1 = 1.2, B = 0.75 (Lance's)

with N the number of documents, avgdl their mean length in tokens and df(t) the number of documents
holding t, all over the corpus (`CorpusStats`, summed over every `TermPart`'s share).

Each level keeps in-memory postings (documents and term frequencies per term, document lengths,
keys): a generation a `TermIndex`, built with pyarrow/numpy from one read of its key and text
columns (Lance 14 does not expose its inverted index's postings or statistics through Python), a
MemTable `PairTerms`, from its writer's MemTable index (no text read or tokenized per query), the
base table one index per fragment (`memwal_df.read.search.fts.base_terms`). A level's live documents
(`live_documents`) are those whose key no newer level holds (exact key sets): each newer level's
keys are located among the level's sorted keys (`KeyPositions`), and the answer for a generation and
a newer generation is kept per process.
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.lsm.levels import GenerationLevel, Level
from memwal_df.read.search.staleness import NewerLevels
from memwal_df.write.memtable_index import TermRows

__all__ = [
    "B",
    "K1",
    "SCORE",
    "CorpusStats",
    "FtsQuery",
    "KeyPositions",
    "LevelTerms",
    "PairTerms",
    "TermIndex",
    "TermPart",
    "Terms",
    "compact_uint",
    "doc_term_counts",
    "generations_digest",
    "hidden_by_memtables",
    "live_documents",
]

SCORE = "_score"
K1 = 1.2
B = 0.75


def compact_uint(values: np.ndarray) -> np.ndarray:
    """`values` (non-negative integers) in the smallest unsigned type that holds them."""
    top = int(values.max()) if len(values) else 0
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32 if top < 2**32 else np.uint64
    return values.astype(dtype)


def doc_term_counts(
    doc: np.ndarray, term: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, term, frequency) of each distinct pair of one token stream (term ids below
    `width`), ordered by document then term."""
    pairs, tf = np.unique(doc.astype(np.int64) * max(width, 1) + term, return_counts=True)
    return pairs // max(width, 1), pairs % max(width, 1), tf


@dataclass
class KeyPositions:
    """Where keys sit among a level's documents. Integer keys: sorted once with their positions (one
    binary search per probed key); other keys: the key array (one hash lookup per document)."""

    sorted_keys: np.ndarray | None  # int64, ascending
    order: np.ndarray | None  # position of each sorted key (int32, or int64 beyond 2^31 documents)
    duplicates: bool  # some key is held by several documents
    keys: pa.Array | None  # non-integer keys

    @classmethod
    def of(cls, keys: pa.Array) -> KeyPositions:
        if not pa.types.is_integer(keys.type):
            return cls(None, None, False, keys)
        values = keys.to_numpy(zero_copy_only=False).astype(np.int64)
        order = np.argsort(values, kind="stable")
        sorted_keys = values[order]
        duplicates = bool(len(values) > 1 and (sorted_keys[1:] == sorted_keys[:-1]).any())
        index_type = np.int32 if len(values) < 2**31 else np.int64
        return cls(sorted_keys, order.astype(index_type), duplicates, None)

    @property
    def nbytes(self) -> int:
        if self.keys is not None:
            return int(self.keys.nbytes)
        assert self.sorted_keys is not None and self.order is not None
        return int(self.sorted_keys.nbytes + self.order.nbytes)

    def positions(self, key_set: KeySet) -> np.ndarray:
        """Every position (int64, unordered) whose key is in `key_set`."""
        wanted = key_set.to_array()
        if len(wanted) == 0:
            return np.zeros(0, np.int64)
        if self.keys is not None:
            hit = pc.is_in(self.keys, value_set=wanted.cast(self.keys.type))
            return np.flatnonzero(hit.to_numpy(zero_copy_only=False))
        sorted_keys, order = self.sorted_keys, self.order
        assert sorted_keys is not None and order is not None
        if len(sorted_keys) == 0:
            return np.zeros(0, np.int64)
        probe = wanted.to_numpy(zero_copy_only=False).astype(np.int64)
        lo = np.searchsorted(sorted_keys, probe)
        if not self.duplicates:
            at = np.minimum(lo, len(sorted_keys) - 1)
            return order[at[sorted_keys[at] == probe]].astype(np.int64)
        count = np.searchsorted(sorted_keys, probe, side="right") - lo
        starts = np.repeat(lo - (np.cumsum(count) - count), count)
        return order[starts + np.arange(int(count.sum()))].astype(np.int64)


@dataclass
class Terms(ABC):
    """A level's documents (by position) and the postings of their terms."""

    doc_len: np.ndarray  # tokens per document (unsigned)
    in_corpus: np.ndarray  # bool: not a tombstone, text not NULL

    @abstractmethod
    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """(documents holding `term`, its frequency in each)."""

    @abstractmethod
    def key_positions(self) -> KeyPositions:
        """Where the documents' keys sit."""

    def positions_of(self, key_set: KeySet) -> np.ndarray:
        """Positions of the documents whose key is in `key_set`."""
        return self.key_positions().positions(key_set)


@dataclass
class LevelTerms(Terms):
    """Terms of a generation or a MemTable: its own vocabulary and key array (the sorted keys are
    computed on the first `positions_of`)."""

    keys: pa.Array  # key of each document
    vocab: Mapping[str, int]
    _positions: KeyPositions | None = field(default=None, repr=False, kw_only=True)

    def key_positions(self) -> KeyPositions:
        if self._positions is None:
            self._positions = KeyPositions.of(self.keys)
        return self._positions


@dataclass
class TermIndex(LevelTerms):
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
        vocab_size = len(tokens.dictionary)
        docs, term, tf = doc_term_counts(doc, tokens.indices.to_numpy(zero_copy_only=False), vocab_size)
        order = np.argsort(term, kind="stable")
        return cls(
            doc_len=compact_uint(np.bincount(doc, minlength=n)),
            in_corpus=in_corpus,
            keys=key_array([rows.column(c) for c in primary_key]),
            vocab={t: i for i, t in enumerate(tokens.dictionary.to_pylist())},
            offsets=np.searchsorted(term[order], np.arange(vocab_size + 1)),
            docs=docs[order].astype(np.int32 if n < 2**31 else np.int64),
            tf=compact_uint(tf[order]),
        )

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        i = self.vocab.get(term)
        if i is None:
            return np.zeros(0, np.int32), np.zeros(0, np.uint8)
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.docs[lo:hi], self.tf[lo:hi]


@dataclass
class PairTerms(LevelTerms):
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


@dataclass
class TermPart:
    """A run of documents one `Bm25Exec` ranks: their postings, which are in the corpus (`live`),
    which may be returned (`eligible`), and `first`, the position of document 0 (positions are
    `first + document`). `num_docs` / `total_len`: the live documents' count and token count when
    the caller knows them (else counted from `live`)."""

    index: Terms
    live: np.ndarray
    eligible: np.ndarray
    first: int = 0
    num_docs: int | None = None
    total_len: int | None = None
    _postings: dict[tuple[str, ...], list[tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=dict, repr=False, kw_only=True
    )

    def postings(self, terms: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The postings of each of `terms` (looked up once per part and list of terms)."""
        key = tuple(terms)
        if key not in self._postings:
            self._postings[key] = [self.index.postings(t) for t in terms]
        return self._postings[key]

    def corpus(self, terms: Sequence[str]) -> CorpusStats:
        """This part's share of the corpus statistics for `terms`."""
        df = np.array([np.count_nonzero(self.live[docs]) for docs, _ in self.postings(terms)], np.float64)
        n = int(np.count_nonzero(self.live)) if self.num_docs is None else self.num_docs
        total = self.total_len
        if total is None:
            total = int(np.sum(self.index.doc_len, where=self.live, dtype=np.int64))
        return CorpusStats(n, total, df)


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


def generations_digest(levels: Sequence[Level]) -> str:
    """What identifies the generations among `levels` (their directories), for cache names."""
    uris = "\n".join(lv.uri for lv in levels if isinstance(lv, GenerationLevel))
    return hashlib.sha256(uris.encode()).hexdigest()[:32]


def hidden_by_memtables(index: Terms, newer: NewerLevels) -> np.ndarray | None:
    """The documents whose key one of the MemTables among `newer` holds (None: no MemTable does)."""
    hits = []
    for level in newer.levels:
        if not isinstance(level, GenerationLevel):
            key_set = level.key_set(newer.primary_key, newer.key_type)
            if key_set is not None and len(hit := index.positions_of(key_set)):
                hits.append(hit)
    return np.concatenate(hits) if hits else None


def live_documents(index: Terms, newer: NewerLevels, owner: GenerationLevel | None, name: str) -> np.ndarray:
    """The level's corpus documents whose key no newer level holds (read-only). Each newer level's
    keys are located among the level's (one lookup per newer key). When the level is a generation
    (`owner`), a newer generation's answer is kept with that newer generation, and the mask under
    all of the newer generations with `owner` (named `name` and the generations), so a query with the
    same newer generations applies only its MemTables."""

    generations = [
        (level, key_set)
        for level in newer.levels
        if isinstance(level, GenerationLevel)
        and (key_set := level.key_set(newer.primary_key, newer.key_type)) is not None
    ]

    def under_generations() -> np.ndarray:
        live = index.in_corpus.copy()
        for level, key_set in generations:
            if owner is not None:
                hits = level.cached(
                    f"hides-in:{owner.uri}:{name}", functools.partial(index.positions_of, key_set)
                )
            else:
                hits = index.positions_of(key_set)
            live[hits] = False
        live.flags.writeable = False
        return live

    if owner is None:
        live = under_generations()
    else:
        digest = generations_digest([level for level, _ in generations])
        live = owner.cached(f"live:{name}:{digest}", under_generations, lambda m: int(m.nbytes))
    hidden = hidden_by_memtables(index, newer)
    if hidden is not None:
        live = live.copy()
        live[hidden] = False
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
