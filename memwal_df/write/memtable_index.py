"""MemTable indexes: the maintained vector and full-text indexes of one MemTable's rows, in memory.

Rows are numbered in write order over the MemTable's batches (duplicates and tombstones included);
`MemTableIndexes.catch_up(batches, upto)` indexes `batches[indexed:upto]`, vectorized per batch:

* vector (`VectorRows`): each row's vector as float32, its squared norm, and whether it is usable (not
  a tombstone, not NULL). Vectors are kept exact, not PQ-encoded: a MemTable (at most
  `max_memtable_rows`) is searched exactly, which is both cheaper than decoding PQ codes at that size
  and better for recall; the flush hands the rows to Lance, which encodes them with the base codebook.
* full-text (`TermRows`): for each (row, term) pair of the row's text, the term frequency; per row the
  number of tokens and whether it is a document (not a tombstone, text not NULL). Tokenized with the
  base inverted index's tokenizer (`memwal_df.format.tokenizer`), terms numbered in a vocabulary that only
  grows.

Arrays only grow (amortized doubling) and are never rewritten below their length, so a view of the
first `n` rows taken under the lock stays valid while later batches are indexed. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from memwal_df.errors import InvalidConfigError
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.tokenizer import Tokenizer

__all__ = ["MemTableIndexes", "TermRows", "VectorRows"]


class _Growing:
    """An append-only numpy array (rows of shape `row_shape`), grown by doubling."""

    def __init__(self, dtype: type | np.dtype, row_shape: tuple[int, ...] = ()) -> None:
        self._data = np.zeros((16, *row_shape), dtype=dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self._data):
            grown = np.zeros((max(end, 2 * len(self._data)), *self._data.shape[1:]), self._data.dtype)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : end] = values
        self.size = end

    def view(self, n: int) -> np.ndarray:
        return self._data[:n]


def _tombstones(batch: pa.RecordBatch) -> np.ndarray:
    return batch.column(TOMBSTONE).to_numpy(zero_copy_only=False).astype(bool)


@dataclass(frozen=True, eq=False)
class VectorRows:
    """The vectors of a MemTable's first `len(matrix)` rows (see the module docstring)."""

    matrix: np.ndarray
    sqnorms: np.ndarray
    usable: np.ndarray


class _VectorIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.matrix = _Growing(np.float32, (dim,))
        self.sqnorms = _Growing(np.float32)
        self.usable = _Growing(bool)

    def add(self, values: pa.Array, tombstone: np.ndarray) -> None:
        usable = ~tombstone
        if values.null_count:
            usable &= values.is_valid().to_numpy(zero_copy_only=False)
            values = values.fill_null(pa.scalar([0.0] * self.dim, values.type))
        matrix = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, self.dim)
        self.matrix.extend(matrix)
        self.sqnorms.extend(np.einsum("ij,ij->i", matrix, matrix))
        self.usable.extend(usable)

    def view(self, n: int) -> VectorRows:
        return VectorRows(self.matrix.view(n), self.sqnorms.view(n), self.usable.view(n))


@dataclass(frozen=True, eq=False)
class TermRows:
    """The postings of a MemTable's first `len(doc_len)` rows, as (row, term, tf) pairs in row order."""

    tokenizer: Tokenizer
    vocab: dict[str, int]  # shared and growing: ids of the pairs below are all in it
    pair_row: np.ndarray
    pair_term: np.ndarray
    pair_tf: np.ndarray
    doc_len: np.ndarray
    in_corpus: np.ndarray


class _TermIndex:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab: dict[str, int] = {}
        self.pair_row = _Growing(np.int32)
        self.pair_term = _Growing(np.int32)
        self.pair_tf = _Growing(np.int32)
        self.doc_len = _Growing(np.int64)
        self.in_corpus = _Growing(bool)

    def add(self, text: pa.Array, tombstone: np.ndarray, first_row: int) -> None:
        doc, tokens = self.tokenizer.tokenize(text)
        vocab = self.vocab
        ids = np.fromiter(  # one dict lookup per distinct token of the batch
            (vocab.setdefault(t, len(vocab)) for t in tokens.dictionary.to_pylist()),
            dtype=np.int64,
            count=len(tokens.dictionary),
        )
        term = ids[tokens.indices.to_numpy(zero_copy_only=False)] if len(doc) else np.zeros(0, np.int64)
        width = max(len(vocab), 1)
        pairs, tf = np.unique(doc.astype(np.int64) * width + term, return_counts=True)
        self.pair_row.extend((pairs // width + first_row).astype(np.int32))
        self.pair_term.extend((pairs % width).astype(np.int32))
        self.pair_tf.extend(tf.astype(np.int32))
        self.doc_len.extend(np.bincount(doc, minlength=len(text)).astype(np.int64))
        self.in_corpus.extend(text.is_valid().to_numpy(zero_copy_only=False) & ~tombstone)

    def view(self, n: int) -> TermRows:
        pairs = int(np.searchsorted(self.pair_row.view(self.pair_row.size), n))  # pairs are in row order
        return TermRows(
            self.tokenizer,
            self.vocab,
            self.pair_row.view(pairs),
            self.pair_term.view(pairs),
            self.pair_tf.view(pairs),
            self.doc_len.view(n),
            self.in_corpus.view(n),
        )


def _term_index(index: MaintainedIndex) -> _TermIndex | None:
    """The in-memory index for an inverted index, None when its tokenizer is not one memwal_df
    reproduces (the generation still gets Lance's index; fts reports the setting)."""
    try:
        return _TermIndex(Tokenizer.from_index_details(index.params))
    except InvalidConfigError:
        return None


class MemTableIndexes:
    """The vector and full-text indexes of one MemTable (scalar indexes need none: the MemTable's
    key index serves lookups, filters are evaluated on its rows)."""

    def __init__(self, indexes: Sequence[MaintainedIndex], schema: pa.Schema) -> None:
        self._lock = threading.Lock()
        self._vectors = {
            i.column: _VectorIndex(schema.field(i.column).type.list_size)
            for i in indexes
            if i.kind == "vector"
        }
        self._terms = {
            i.column: t for i in indexes if i.kind == "inverted" and (t := _term_index(i)) is not None
        }
        self._batches = 0
        self._rows = 0

    def __bool__(self) -> bool:
        return bool(self._vectors or self._terms)

    @property
    def indexed_rows(self) -> int:
        """How many of the MemTable's rows the indexes include."""
        return self._rows

    def catch_up(self, batches: Sequence[pa.RecordBatch], upto: int) -> None:
        """Index `batches[:upto]` (those not indexed yet)."""
        with self._lock:
            for batch in batches[self._batches : upto]:
                tombstone = _tombstones(batch)
                for column, vectors in self._vectors.items():
                    vectors.add(batch.column(column), tombstone)
                for column, terms in self._terms.items():
                    terms.add(batch.column(column), tombstone, self._rows)
                self._rows += batch.num_rows
            self._batches = max(self._batches, upto)

    def vectors(
        self, column: str, batches: Sequence[pa.RecordBatch], upto: int, rows: int
    ) -> VectorRows | None:
        """The vectors of the `rows` rows of `batches[:upto]`, None when `column` is not indexed."""
        if column not in self._vectors:
            return None
        self.catch_up(batches, upto)
        with self._lock:
            return self._vectors[column].view(rows)

    def terms(self, column: str, batches: Sequence[pa.RecordBatch], upto: int, rows: int) -> TermRows | None:
        """The postings of the `rows` rows of `batches[:upto]`, None when `column` is not indexed."""
        if column not in self._terms:
            return None
        self.catch_up(batches, upto)
        with self._lock:
            return self._terms[column].view(rows)


class BackgroundIndexer:
    """Brings the indexes of a writer's active MemTable up to date on a daemon thread (writers with
    `indexed_write=False`): `submit` after each write; a newer submission replaces an older one."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._todo: tuple[MemTableIndexes, list[pa.RecordBatch]] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, indexes: MemTableIndexes, batches: list[pa.RecordBatch]) -> None:
        with self._cond:
            self._todo = (indexes, batches)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._todo is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                assert self._todo is not None
                (indexes, batches), self._todo = self._todo, None
            indexes.catch_up(batches, len(batches))
