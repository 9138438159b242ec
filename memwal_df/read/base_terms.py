"""The base table's full-text term state: one term index per fragment, kept across base versions.

A Lance fragment's data files never change once written (a merge adds fragments and deletion files;
compaction replaces fragments), so a fragment's postings, document lengths and keys are built once
per process from one read of every physical row of its key and text columns (deleted rows included),
and kept in `BASE_TERMS` under what identifies its data: the table URI, the fragment id, its data
file paths, the column and the tokenizer. A new base version builds term indexes for the fragments
it added only; the others are reused as they are.

A fragment's documents in one base version are the rows its deletion vector keeps whose text is not
NULL (kept per deletion file, with their count and token count: `FragmentLive`), minus the rows whose
key a newer level holds (located among the fragment's sorted keys; per newer generation kept with the
fragment, per MemTable computed per query). A query pays for the rows newer levels hide, not for
the fragment's size; corpus statistics are sums over fragments (`TermPart.corpus`).

Postings are arrays only: the fragments of one (table, column, tokenizer) share a `Vocabulary` (term
-> id), and a fragment keeps, per term id it holds, a slice of int32 document offsets and of
frequencies in the smallest unsigned type that holds them.

Guarantees: every fragment's term index covers all its physical rows, so it is exact for every base
version that lists the fragment, whatever its deletion vector; `BuildCounts` (`BUILT`) counts the
fragments indexed, documents tokenized and deletion files read by the process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from memwal_df.format.deletion_files import deleted_offsets, deletion_file_id
from memwal_df.format.storage import Storage
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.cache import ImmutableCache
from memwal_df.read.fts_terms import KeyPositions, TermPart, Terms, compact_uint, doc_term_counts
from memwal_df.read.keys import KeySet, key_array
from memwal_df.read.levels import GenerationLevel, Level
from memwal_df.read.newer_levels import NewerLevels

__all__ = [
    "BASE_TERMS",
    "BASE_TERM_CACHE_BYTES",
    "BUILT",
    "BuildCounts",
    "FragmentLive",
    "FragmentTerms",
    "Vocabulary",
    "base_parts",
]

BASE_TERM_CACHE_BYTES = 1 << 30
"""Default bound of `BASE_TERMS`' declared sizes (fragment term indexes, live masks, vocabularies)."""

BASE_TERMS = ImmutableCache(capacity=1 << 16, max_bytes=BASE_TERM_CACHE_BYTES)
_BATCH_ROWS = 1 << 17  # rows tokenized at a time while a fragment's term index is built
_EMPTY_DOCS = np.zeros(0, np.int32)
_EMPTY_TF = np.zeros(0, np.uint8)


@dataclass
class BuildCounts:
    """What this process built from base fragments so far."""

    fragments: int = 0  # fragment term indexes built
    documents: int = 0  # physical rows tokenized
    deletion_files: int = 0  # deletion vectors read


BUILT = BuildCounts()


class Vocabulary:
    """Term ids shared by the term indexes of one table's fragments (one column, one tokenizer)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._word_bytes = 0

    def get(self, term: str) -> int | None:
        return self._ids.get(term)

    def ids(self, words: list[str]) -> np.ndarray:
        """The id of each of `words` (new words get the next free ids)."""
        with self._lock:
            ids = self._ids
            before = len(ids)
            out = np.fromiter((ids.setdefault(w, len(ids)) for w in words), np.int64, len(words))
            if len(ids) > before:
                new = [w for w, i in zip(words, out.tolist(), strict=True) if i >= before]
                self._word_bytes += sum(sys.getsizeof(w) + 28 for w in new)
        return out

    @property
    def nbytes(self) -> int:
        """The dictionary, its words and their ids (an estimate of Python's sizes)."""
        return sys.getsizeof(self._ids) + self._word_bytes

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class FragmentTerms(Terms):
    """The postings of one fragment's physical rows (documents are physical offsets)."""

    positions: KeyPositions
    vocabulary: Vocabulary
    term_ids: np.ndarray  # the vocabulary ids of the terms the fragment holds, ascending
    offsets: np.ndarray  # postings of term_ids[i]: [offsets[i], offsets[i + 1])
    docs: np.ndarray  # int32
    tf: np.ndarray
    _hidden: dict[str, np.ndarray] = field(default_factory=dict, repr=False, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    @classmethod
    def build(
        cls,
        fragment: lance.LanceFragment,
        primary_key: Sequence[str],
        column: str,
        tokenizer: Tokenizer,
        vocabulary: Vocabulary,
    ) -> FragmentTerms:
        """From one read of every physical row of the fragment (deleted ones included)."""
        columns = [*primary_key, column]
        scanner = fragment.scanner(
            columns=columns, with_row_id=True, include_deleted_rows=True, batch_size=_BATCH_ROWS
        )
        keys, lengths, valid, docs, terms, tfs = [], [], [], [], [], []
        rows = 0
        for batch in scanner.to_batches():
            text = batch.column(column)
            doc, tokens = tokenizer.tokenize(text)
            ids = vocabulary.ids(tokens.dictionary.to_pylist())
            local = tokens.indices.to_numpy(zero_copy_only=False)
            d, t, tf = doc_term_counts(doc, local, len(tokens.dictionary))
            docs.append(d + rows)
            terms.append(ids[t])
            tfs.append(tf)
            lengths.append(np.bincount(doc, minlength=batch.num_rows))
            valid.append(text.is_valid().to_numpy(zero_copy_only=False))
            keys.append(key_array([batch.column(c) for c in primary_key]))
            rows += batch.num_rows
        if rows != fragment.metadata.physical_rows:
            raise RuntimeError(f"read {rows} rows of fragment {fragment.fragment_id}, which has "
                               f"{fragment.metadata.physical_rows}")  # fmt: skip
        BUILT.fragments += 1
        BUILT.documents += rows
        return cls._of(keys, lengths, valid, docs, terms, tfs, vocabulary)

    @classmethod
    def _of(
        cls,
        keys: list[pa.Array],
        lengths: list[np.ndarray],
        valid: list[np.ndarray],
        docs: list[np.ndarray],
        terms: list[np.ndarray],
        tfs: list[np.ndarray],
        vocabulary: Vocabulary,
    ) -> FragmentTerms:
        term = compact_uint(np.concatenate(terms)) if terms else np.zeros(0, np.uint8)
        order = np.argsort(term, kind="stable")  # documents stay ascending within a term
        term_ids, starts = np.unique(term[order], return_index=True)
        key_type = keys[0].type if keys else pa.int64()
        return cls(
            doc_len=compact_uint(np.concatenate(lengths)) if lengths else np.zeros(0, np.uint8),
            in_corpus=np.concatenate(valid) if valid else np.zeros(0, bool),
            positions=KeyPositions.of(pa.concat_arrays(keys) if keys else pa.array([], key_type)),
            vocabulary=vocabulary,
            term_ids=term_ids.astype(np.int64),
            offsets=np.append(starts, len(term)).astype(np.int64),
            docs=np.concatenate(docs)[order].astype(np.int32) if docs else _EMPTY_DOCS,
            tf=compact_uint(np.concatenate(tfs)[order]) if tfs else _EMPTY_TF,
        )

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (the shared vocabulary not counted)."""
        arrays = (self.doc_len, self.in_corpus, self.term_ids, self.offsets, self.docs, self.tf)
        return sum(a.nbytes for a in arrays) + self.positions.nbytes

    def key_positions(self) -> KeyPositions:
        return self.positions

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        term_id = self.vocabulary.get(term)
        if term_id is None:
            return _EMPTY_DOCS, _EMPTY_TF
        i = int(np.searchsorted(self.term_ids, term_id))
        if i == len(self.term_ids) or self.term_ids[i] != term_id:
            return _EMPTY_DOCS, _EMPTY_TF
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.docs[lo:hi], self.tf[lo:hi]

    def hidden_by(self, level: GenerationLevel, key_set: KeySet) -> np.ndarray:
        """The documents whose key the generation holds (kept: both never change)."""
        hits = self._hidden.get(level.uri)
        if hits is None:
            hits = self.positions_of(key_set)
            with self._lock:
                self._hidden[level.uri] = hits
        return hits

    def forget_hidden(self, keep: set[str]) -> None:
        """Drop the kept answers of generations outside `keep` once they outnumber it (merged and
        collected generations are never newer again)."""
        if len(self._hidden) > 2 * len(keep) + 8:
            with self._lock:
                for uri in [u for u in self._hidden if u not in keep]:
                    del self._hidden[uri]


@dataclass(frozen=True)
class FragmentLive:
    """A fragment's documents under one deletion vector: the rows it keeps whose text is not NULL."""

    live: np.ndarray  # bool per physical row (read-only)
    num_docs: int
    total_len: int  # their tokens

    @classmethod
    def of(cls, terms: FragmentTerms, deleted: np.ndarray) -> FragmentLive:
        live = terms.in_corpus.copy()
        live[deleted] = False
        live.flags.writeable = False
        total = int(np.sum(terms.doc_len, where=live, dtype=np.int64))
        return cls(live, int(np.count_nonzero(live)), total)


_build_locks: dict[tuple[str, str], threading.Lock] = {}
_build_locks_lock = threading.Lock()


def _kept(uri: str, name: str, compute: Callable[[], Any], size: Callable[[Any], int]) -> Any:
    """`BASE_TERMS.get`, computed by one thread at a time per entry (a fragment's build is costly)."""
    found = BASE_TERMS.peek(uri, name)
    if found is not None:
        return found
    with _build_locks_lock:
        lock = _build_locks.setdefault((uri, name), threading.Lock())
    try:
        with lock:
            return BASE_TERMS.get(uri, name, compute, size)
    finally:
        with _build_locks_lock:
            _build_locks.pop((uri, name), None)


def _fragment_name(fragment: lance.LanceFragment, column: str, tokenizer: Tokenizer) -> str:
    """What identifies the fragment's term index: its id and data files (never rewritten in place)."""
    metadata = fragment.metadata
    files = ",".join(f.path for f in metadata.files)
    overlays = f":{metadata.overlays}" if getattr(metadata, "overlays", None) else ""
    return f"terms:{column}:{tokenizer}:{fragment.fragment_id}:{files}{overlays}"


def _hidden(terms: FragmentTerms, levels: Sequence[tuple[Level, KeySet]]) -> np.ndarray | None:
    """The documents whose key one of `levels` holds (None: none of them holds any)."""
    hits = [
        terms.hidden_by(level, key_set) if isinstance(level, GenerationLevel) else terms.positions_of(key_set)
        for level, key_set in levels
    ]
    hits = [h for h in hits if len(h)]
    return np.unique(np.concatenate(hits)) if hits else None


def _part(fragment_id: int, terms: FragmentTerms, state: FragmentLive, hidden: np.ndarray | None) -> TermPart:
    first = fragment_id << 32
    if hidden is None:
        return TermPart(terms, state.live, state.live, first, state.num_docs, state.total_len)
    hidden = hidden[state.live[hidden]]
    live = state.live.copy()
    live[hidden] = False
    total = state.total_len - int(terms.doc_len[hidden].sum(dtype=np.int64))
    return TermPart(terms, live, live, first, state.num_docs - len(hidden), total)


def base_parts(
    base: lance.LanceDataset, storage: Storage, column: str, tokenizer: Tokenizer, newer: NewerLevels
) -> list[TermPart]:
    """One `TermPart` per fragment of `base` (its storage: `storage`): documents are the fragment's
    physical rows, positions their row addresses (fragment id << 32 | offset), live the rows its
    deletion vector keeps, with a text, whose key no level of `newer` holds."""
    pk = list(newer.primary_key)
    vocabulary = _kept(base.uri, f"vocab:{column}:{tokenizer}", Vocabulary, lambda v: v.nbytes)
    levels = [(lv, ks) for lv in newer.levels if (ks := lv.key_set(pk, newer.key_type)) is not None]
    generations = {lv.uri for lv, _ in levels if isinstance(lv, GenerationLevel)}
    parts = []
    for fragment in base.get_fragments():
        name = _fragment_name(fragment, column, tokenizer)

        def build(fragment: lance.LanceFragment = fragment) -> FragmentTerms:
            return FragmentTerms.build(fragment, pk, column, tokenizer, vocabulary)

        terms: FragmentTerms = _kept(base.uri, name, build, lambda t: t.nbytes)

        def live(fragment: lance.LanceFragment = fragment, terms: FragmentTerms = terms) -> FragmentLive:
            return _live(storage, fragment, terms)

        live_name = f"live:{name}:{deletion_file_id(fragment)}"
        state: FragmentLive = _kept(base.uri, live_name, live, lambda s: s.live.nbytes)
        parts.append(_part(fragment.fragment_id, terms, state, _hidden(terms, levels)))
        terms.forget_hidden(generations)
    BASE_TERMS.put(base.uri, f"vocab:{column}:{tokenizer}", vocabulary, vocabulary.nbytes)  # its size grew
    return parts


def _live(storage: Storage, fragment: lance.LanceFragment, terms: FragmentTerms) -> FragmentLive:
    BUILT.deletion_files += fragment.metadata.deletion_file is not None
    return FragmentLive.of(terms, deleted_offsets(storage, fragment))
