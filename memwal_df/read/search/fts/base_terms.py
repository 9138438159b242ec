"""The base table's full-text term state: one term index per fragment, kept across base versions.

A Lance fragment's data files never change once written (a merge adds fragments and deletion files;
compaction replaces fragments), so a fragment's postings, document lengths and keys are built once
per process from one read of every physical row of its key and text columns (deleted rows included),
and kept in `BASE_TERMS` under what identifies its data: the table URI, the fragment id, its data
file paths, the column and the tokenizer. A new base version builds term indexes for the fragments
it added only (all of them in one scan and one tokenization pass); the others are reused as they are.

A fragment's documents in one base version are the rows its deletion vector keeps whose text is not
NULL (`FragmentLive`, read once per deletion file; a newer deletion vector that only adds deletions
patches the newest one kept), minus the rows whose key a newer level holds (located among the
fragment's sorted keys). The live mask under a deletion vector and a set of newer generations is kept
with the fragment (its newest few), so a query over the same generations applies only its
MemTables' keys; corpus statistics are sums over fragments (`TermPart.corpus`).

Postings are arrays only: the fragments of one (table, column, tokenizer) share a `Vocabulary` (term
-> id), and a fragment keeps, per term id it holds, a slice of int32 document offsets and of
frequencies in the smallest unsigned type that holds them. Memory: ~5 bytes per distinct (document,
term) pair, ~14 per document (length, text flag, sorted key and its offset), 1 per physical row per
live mask kept, ~80 per vocabulary term.

When a newer base version is first listed, the term indexes of the fragments the previous newest
version listed and it does not (compacted away) are dropped; a reader of an older version rebuilds
them.

Guarantees: every fragment's term index covers all its physical rows, so it is exact for every base
version that lists the fragment, whatever its deletion vector; `BUILT` counts the fragments indexed,
documents tokenized and deletion files read by the process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import lance
import numpy as np
import pyarrow as pa

from memwal_df.format.deletion_files import deleted_offsets, deletion_file_id
from memwal_df.format.storage import Storage
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.lsm.cache import ImmutableCache, PerObjectCache
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.search.fts.terms import (
    KeyPositions,
    TermPart,
    Terms,
    compact_uint,
    doc_term_counts,
    generations_digest,
    hidden_by_memtables,
)
from memwal_df.read.search.staleness import NewerLevels

__all__ = [
    "BASE_TERMS",
    "BASE_TERM_CACHE_BYTES",
    "BUILT",
    "BuildCounts",
    "FragmentLive",
    "FragmentTerms",
    "Vocabulary",
    "base_parts",
    "build_fragment_terms",
]

BASE_TERM_CACHE_BYTES = 1 << 30
"""Default bound of `BASE_TERMS`' declared sizes (fragment term indexes and vocabularies)."""

BASE_TERMS = ImmutableCache(capacity=1 << 16, max_bytes=BASE_TERM_CACHE_BYTES)
_BATCH_ROWS = 1 << 17  # rows tokenized at a time while a fragment's term index is built
_EMPTY_DOCS = np.zeros(0, np.int32)
_EMPTY_TF = np.zeros(0, np.uint8)


@dataclass
class BuildCounts:
    """What this process built from base fragments so far."""

    fragments: int = 0  # fragment term indexes built
    documents: int = 0  # physical rows tokenized
    deletion_files: int = 0  # deletion files read


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


@dataclass(frozen=True)
class FragmentLive:
    """A fragment's documents under one deletion vector: the rows it keeps whose text is not NULL."""

    deleted: np.ndarray  # the physical offsets the deletion vector removes, ascending
    live: np.ndarray  # bool per physical row (read-only)
    num_docs: int
    total_len: int  # their tokens

    @classmethod
    def of(cls, terms: Terms, deleted: np.ndarray, before: FragmentLive | None) -> FragmentLive:
        """From `before` (the same fragment under an older deletion vector) when `deleted` holds all
        it removed: only the rows deleted since are subtracted; else from the whole fragment."""
        if before is not None and len(deleted) >= len(before.deleted):
            at = np.minimum(np.searchsorted(deleted, before.deleted), max(len(deleted) - 1, 0))
            if len(before.deleted) == 0 or bool((deleted[at] == before.deleted).all()):
                newly = deleted[before.live[deleted]]
                live = before.live.copy()
                live[newly] = False
                live.flags.writeable = False
                total = before.total_len - int(terms.doc_len[newly].sum(dtype=np.int64))
                return cls(deleted, live, before.num_docs - len(newly), total)
        live = terms.in_corpus.copy()
        live[deleted] = False
        live.flags.writeable = False
        total = int(np.sum(terms.doc_len, where=live, dtype=np.int64))
        return cls(deleted, live, int(np.count_nonzero(live)), total)

    def without(self, terms: Terms, hidden: np.ndarray | None) -> FragmentLive:
        """These documents but the `hidden` ones (distinct offsets; None: none)."""
        if hidden is None:
            return self
        hidden = hidden[self.live[hidden]]
        live = self.live.copy()
        live[hidden] = False
        live.flags.writeable = False
        total = self.total_len - int(terms.doc_len[hidden].sum(dtype=np.int64))
        return FragmentLive(self.deleted, live, self.num_docs - len(hidden), total)


_STATES_KEPT = 8  # live masks kept per fragment: its newest deletion vectors, each under newer generations


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
    _states: dict[tuple[str, str], FragmentLive] = field(default_factory=dict, repr=False, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (the shared vocabulary and the live masks not counted)."""
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

    def _state(self, key: tuple[str, str], compute: Callable[[], FragmentLive]) -> FragmentLive:
        found = self._states.get(key)
        if found is not None:
            return found
        state = compute()
        with self._lock:
            self._states[key] = state
            while len(self._states) > _STATES_KEPT:
                del self._states[next(iter(self._states))]
        return state

    def live_under(self, deletion: str, deleted: Callable[[], np.ndarray]) -> FragmentLive:
        """The documents under the deletion vector `deletion` (its offsets: `deleted()`, read once),
        patched from the newest one kept when it only adds deletions."""

        def compute() -> FragmentLive:
            with self._lock:
                kept = [state for (_, newer), state in self._states.items() if newer == ""]
            return FragmentLive.of(self, deleted(), kept[-1] if kept else None)

        return self._state((deletion, ""), compute)

    def shadowed(
        self,
        deletion: str,
        deleted: Callable[[], np.ndarray],
        digest: str,
        generations: Sequence[tuple[GenerationLevel, KeySet]],
    ) -> FragmentLive:
        """`live_under(deletion)` minus the documents whose key one of `generations` holds (named by
        `digest`): kept, so a query over the same generations pays nothing for them."""
        state = self.live_under(deletion, deleted)
        if not generations:
            return state

        def compute() -> FragmentLive:
            hits = [h for level, key_set in generations if len(h := self.hidden_by(level, key_set))]
            return state.without(self, np.unique(np.concatenate(hits)) if hits else None)

        return self._state((deletion, digest), compute)

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


@dataclass
class _Tokenized:
    """The token stream of consecutive physical rows of some fragments: per row its key, length and
    whether its text is valid; per distinct (row, term) pair its frequency, ordered by row."""

    keys: list[pa.Array] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    valid: list[np.ndarray] = field(default_factory=list)
    docs: list[np.ndarray] = field(default_factory=list)
    terms: list[np.ndarray] = field(default_factory=list)
    tfs: list[np.ndarray] = field(default_factory=list)
    rows: int = 0

    def add(
        self,
        batch: pa.RecordBatch,
        pk: Sequence[str],
        column: str,
        tokenizer: Tokenizer,
        vocabulary: Vocabulary,
    ) -> None:
        text = batch.column(column)
        doc, tokens = tokenizer.tokenize(text)
        ids = vocabulary.ids(tokens.dictionary.to_pylist())
        d, t, tf = doc_term_counts(doc, tokens.indices.to_numpy(zero_copy_only=False), len(tokens.dictionary))
        row_type = np.int32 if self.rows + batch.num_rows < 2**31 else np.int64
        self.docs.append((d + self.rows).astype(row_type))  # compact while the batches pile up
        self.terms.append(ids[t].astype(np.int32))
        self.tfs.append(compact_uint(tf))
        self.lengths.append(np.bincount(doc, minlength=batch.num_rows))
        self.valid.append(text.is_valid().to_numpy(zero_copy_only=False))
        self.keys.append(key_array([batch.column(c) for c in pk]))
        self.rows += batch.num_rows

    def split(self, sizes: Sequence[int], vocabulary: Vocabulary) -> list[FragmentTerms]:
        """One term index per run of `sizes` rows (the stream is consumed)."""
        docs, terms, tfs = (
            _drained(self.docs, np.int32),
            _drained(self.terms, np.int32),
            _drained(self.tfs, np.uint8),
        )
        lengths, valid = _drained(self.lengths, np.int64), _drained(self.valid, np.bool_)
        keys = pa.chunked_array(self.keys) if self.keys else pa.chunked_array([], pa.int64())
        out, first = [], 0
        for size in sizes:
            lo, hi = np.searchsorted(docs, [first, first + size])  # pairs are ordered by row
            order = np.argsort(compact_uint(terms[lo:hi]), kind="stable")  # rows stay ascending per term
            term = terms[lo:hi][order]
            starts = (
                np.flatnonzero(np.r_[True, term[1:] != term[:-1]]) if len(term) else np.zeros(0, np.int64)
            )
            fragment_docs = docs[lo:hi][order]
            fragment_docs -= first
            out.append(
                FragmentTerms(
                    doc_len=compact_uint(lengths[first : first + size]),
                    in_corpus=valid[first : first + size].copy(),
                    positions=KeyPositions.of(keys.slice(first, size).combine_chunks()),
                    vocabulary=vocabulary,
                    term_ids=term[starts].astype(np.int64),
                    offsets=np.append(starts, len(term)).astype(np.int64),
                    docs=fragment_docs.astype(np.int32, copy=False),
                    tf=compact_uint(tfs[lo:hi][order]),
                )
            )
            first += size
        return out


def _drained(arrays: list[np.ndarray], empty: type) -> np.ndarray:
    """The arrays one after the other; the list is emptied (its pieces freed as soon as possible)."""
    out = np.concatenate(arrays) if arrays else np.zeros(0, empty)
    arrays.clear()
    return out


def build_fragment_terms(
    base: lance.LanceDataset,
    fragments: Sequence[lance.LanceFragment],
    primary_key: Sequence[str],
    column: str,
    tokenizer: Tokenizer,
    vocabulary: Vocabulary,
) -> list[FragmentTerms]:
    """The term indexes of `fragments` (of `base`), from one read of every physical row of each
    (deleted ones included), in one scan and one tokenization pass."""
    sizes = [f.metadata.physical_rows for f in fragments]
    scanner = base.scanner(
        fragments=list(fragments),
        columns=[*primary_key, column],
        with_row_id=True,
        include_deleted_rows=True,
        scan_in_order=True,
        batch_size=_BATCH_ROWS,
    )
    tokenized, pending = _Tokenized(), []
    for batch in scanner.to_batches():  # small fragments' batches tokenized together: a pass costs ~1 ms
        pending.append(batch)
        if sum(b.num_rows for b in pending) >= _BATCH_ROWS:
            tokenized.add(pa.concat_batches(pending), primary_key, column, tokenizer, vocabulary)
            pending = []
    if pending:
        tokenized.add(pa.concat_batches(pending), primary_key, column, tokenizer, vocabulary)
    if tokenized.rows != sum(sizes):
        ids = [f.fragment_id for f in fragments]
        raise RuntimeError(f"read {tokenized.rows} rows of fragments {ids}, which have {sum(sizes)}")
    BUILT.fragments += len(fragments)
    BUILT.documents += tokenized.rows
    return tokenized.split(sizes, vocabulary)


@dataclass(frozen=True)
class _Listed:
    """A fragment of a base version (no reference to the dataset: listings are kept per dataset)."""

    fragment_id: int
    name: str  # of its term index in BASE_TERMS: what identifies its data
    deletion: str  # what identifies its deletion vector
    rows: int


def _fragment(base: lance.LanceDataset, fragment_id: int) -> lance.LanceFragment:
    fragment = base.get_fragment(fragment_id)
    assert fragment is not None, f"fragment {fragment_id} is one of the listed fragments of the version"
    return fragment


_LISTINGS: PerObjectCache[lance.LanceDataset, dict[tuple[int, str], list[_Listed]]] = PerObjectCache()
_build_locks: dict[str, threading.Lock] = {}
_build_locks_lock = threading.Lock()


def _listing(base: lance.LanceDataset, column: str, tokenizer: Tokenizer) -> list[_Listed]:
    """The fragments of `base` with what identifies their term index and deletion vector (read once
    per dataset object and version)."""
    listings = _LISTINGS.get(base, dict)
    key = (base.version, f"{column}:{tokenizer}")
    if key not in listings:
        out = []
        for fragment in base.get_fragments():
            metadata = fragment.metadata
            files = ",".join(f.path for f in metadata.files)
            overlays = f":{metadata.overlays}" if getattr(metadata, "overlays", None) else ""
            name = f"terms:{key[1]}:{fragment.fragment_id}:{files}{overlays}"
            out.append(
                _Listed(fragment.fragment_id, name, deletion_file_id(fragment), metadata.physical_rows)
            )
        listings[key] = out
        _retire(base, key[1], out)
    return listings[key]


_newest: dict[tuple[str, str], tuple[int, set[str]]] = {}  # (uri, column and tokenizer) -> listing
_newest_lock = threading.Lock()


def _retire(base: lance.LanceDataset, what: str, listed: Sequence[_Listed]) -> None:
    """When `base` is the newest version listed yet: drop the term indexes of the fragments the
    previous newest version listed and this one does not (compacted away; a reader of an older
    version rebuilds them)."""
    names = {f.name for f in listed}
    with _newest_lock:
        before = _newest.get((base.uri, what))
        if before is not None and before[0] >= base.version:
            return
        _newest[(base.uri, what)] = (base.version, names)
    if before is not None and (gone := before[1] - names):
        BASE_TERMS.forget(base.uri, gone)


_GROUP_ROWS = 1 << 20  # fragments built in one scan, up to this many rows


def _term_indexes(
    base: lance.LanceDataset, listed: Sequence[_Listed], pk: Sequence[str], column: str, tokenizer: Tokenizer
) -> list[FragmentTerms]:
    """The term index of each listed fragment: kept ones from `BASE_TERMS`, the others built (one
    thread at a time per table: racing queries wait for the first one's build)."""
    found = [BASE_TERMS.peek(base.uri, f.name) for f in listed]
    if all(t is not None for t in found):
        return found
    with _build_locks_lock:
        lock = _build_locks.setdefault(base.uri, threading.Lock())
    with lock:
        found = [BASE_TERMS.peek(base.uri, f.name) for f in listed]
        missing = [f for f, t in zip(listed, found, strict=True) if t is None]
        vocabulary = BASE_TERMS.get(base.uri, f"vocab:{column}:{tokenizer}", Vocabulary)
        built: dict[str, FragmentTerms] = {}
        group: list[_Listed] = []
        for i, f in enumerate(missing):
            group.append(f)
            if i == len(missing) - 1 or sum(g.rows for g in group) + missing[i + 1].rows > _GROUP_ROWS:
                fragments = [_fragment(base, g.fragment_id) for g in group]
                terms = build_fragment_terms(base, fragments, pk, column, tokenizer, vocabulary)
                for g, t in zip(group, terms, strict=True):
                    BASE_TERMS.put(base.uri, g.name, t, t.nbytes)
                    built[g.name] = t
                group = []
        BASE_TERMS.put(base.uri, f"vocab:{column}:{tokenizer}", vocabulary, vocabulary.nbytes)
    return [t if t is not None else built[f.name] for f, t in zip(listed, found, strict=True)]


def base_parts(
    base: lance.LanceDataset, storage: Storage, column: str, tokenizer: Tokenizer, newer: NewerLevels
) -> list[TermPart]:
    """One `TermPart` per fragment of `base` (its storage: `storage`): documents are the fragment's
    physical rows, positions their row addresses (fragment id << 32 | offset), live the rows its
    deletion vector keeps, with a text, whose key no level of `newer` holds."""
    pk = list(newer.primary_key)
    listed = _listing(base, column, tokenizer)
    indexes = _term_indexes(base, listed, pk, column, tokenizer)
    generations = [
        (lv, ks)
        for lv in newer.levels
        if isinstance(lv, GenerationLevel) and (ks := lv.key_set(pk, newer.key_type)) is not None
    ]
    digest = generations_digest([lv for lv, _ in generations])
    parts = []
    for f, terms in zip(listed, indexes, strict=True):

        def deleted(f: _Listed = f) -> np.ndarray:
            BUILT.deletion_files += f.deletion != "-"
            return deleted_offsets(storage, _fragment(base, f.fragment_id))

        state = terms.shadowed(f.deletion, deleted, digest, generations)
        hidden = hidden_by_memtables(terms, newer)
        state = state.without(terms, None if hidden is None else np.unique(hidden))
        parts.append(
            TermPart(terms, state.live, state.live, f.fragment_id << 32, state.num_docs, state.total_len)
        )
        terms.forget_hidden({lv.uri for lv, _ in generations})
    return parts
