"""The levels of the LSM tree a query reads: `GenerationLevel` (a flushed generation, opened lazily)
and `MemTableLevel` (an unflushed MemTable's rows as of when the snapshot was taken).

Every level answers the same questions (its rows, its keys, the rows at some positions, values
derived from it kept as long as they stay valid); each kind owns how. A position is a row's index in
the level's scan order: the MemTable snapshot's row order, or a generation's visible-row order
(`LanceDataset.to_table()` order, which `take()` follows).

Guarantees: a generation's files are checked against its checksum sidecar before anything is read
from them (once per process), and one that does not match raises `CorruptGenerationError`; values
derived from a generation's files are kept once per process (`GENERATIONS`: a generation directory
never changes once committed), a MemTable copy's once per copy; a generation that was
garbage-collected reads as gone (None, `missing` set), never as an error, while one that exists but
cannot be read raises `MissingGenerationError`.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.bloom import BloomFilter
from memwal_df.format.checksums import GONE, verify_generation_once
from memwal_df.format.storage import Storage
from memwal_df.read.expr.lance_filter import split_for_lance
from memwal_df.read.expr.predicate import referenced_columns
from memwal_df.read.lsm.cache import GENERATIONS
from memwal_df.read.lsm.fragments import fragment_take
from memwal_df.read.lsm.keys import KeySet, key_array
from memwal_df.read.lsm.labels import short_id

if TYPE_CHECKING:
    from memwal_df.write.memtable import MemTableSnapshot

__all__ = ["RESIDENT_BYTES", "GenerationLevel", "Level", "MemTableLevel"]

T = TypeVar("T")
RESIDENT_BYTES = 16 << 20  # a generation's rows kept in memory for `take` when they fit
_TOO_LARGE = object()  # cached for a generation whose rows do not fit
_POSITION = "__memwal_position"


def _key_set_name(primary_key: Sequence[str]) -> str:
    return "keyset:" + ",".join(primary_key)


@dataclass
class Level(ABC):
    """One source of rows of one region. Rows carry the table's columns plus `_tombstone`;
    `generation` orders levels within a region, and a level holds at most one row per key."""

    noun: ClassVar[str]  # what the level is, in descriptions
    region_id: uuid.UUID
    generation: int
    storage: Storage
    _keys: pa.Array | None = field(default=None, repr=False, kw_only=True)

    @property
    def name(self) -> str:
        """`generation 3 of region <uuid>`."""
        return f"{self.noun} {self.generation} of region {self.region_id}"

    @property
    def label(self) -> str:
        """`generation 3 of region 1a2b3c4d…`, for one-line descriptions."""
        return f"{self.noun} {self.generation} of region {short_id(self.region_id)}"

    @abstractmethod
    def memo(self, name: str, compute: Callable[[], T]) -> T:
        """`compute()` once per generation and process, or once per MemTable copy."""

    @abstractmethod
    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table | None:
        """The level's rows in position order (only `columns`, rows matching `filter` by pyarrow's
        rules), None if the level is gone. `schema` (the table's) lets a generation push the filter
        into Lance's scan."""

    @abstractmethod
    def take(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at `positions` (in that order), `columns` only."""

    def bloom(self) -> BloomFilter | None:
        """The level's primary-key bloom filter, None when it has none."""
        return None

    def keys(self, primary_key: Sequence[str]) -> pa.Array | None:
        """Every key the level holds (tombstones included), as one key array; None if it is gone.
        Read once per query (the snapshot lives for one query)."""
        if self._keys is None:
            t = self.to_table(list(primary_key))
            if t is None:
                return None
            self._keys = key_array([t.column(c) for c in primary_key])
        return self._keys

    def set_keys(self, keys: pa.Array) -> None:
        """Record the level's full key set when a caller has read it anyway (an unfiltered read)."""
        if self._keys is None:
            self._keys = keys

    def key_set(self, primary_key: Sequence[str], key_type: pa.DataType) -> KeySet | None:
        """Every key the level holds (tombstones included) as a `KeySet` (kept with `memo`); None if
        the generation was collected."""
        pk = list(primary_key)

        def build() -> KeySet | None:
            keys = self.keys(pk)
            return None if keys is None else KeySet(keys, key_type)

        return self.memo(_key_set_name(pk), build)

    def key_set_in_memory(self, primary_key: Sequence[str]) -> KeySet | None:
        """The level's key set if this process holds it already across queries (never reads it)."""
        return None

    def read(self, columns: Sequence[str]) -> pa.Table:
        """The level's rows (`columns` only), in position order; MissingGenerationError if it is gone."""
        rows = self.to_table(list(columns))
        if rows is None:
            raise MissingGenerationError(f"{self.name} was garbage-collected while it was searched")
        return rows

    def filter_mask(self, filter: pc.Expression | None) -> np.ndarray | None:
        """Bool per position: the row matches `filter` (pyarrow semantics); None without a filter."""
        if filter is None:
            return None
        rows = self.read(sorted(referenced_columns(filter)))
        n = rows.num_rows
        positions = rows.append_column(_POSITION, pa.array(np.arange(n, dtype=np.int64))).filter(filter)
        mask = np.zeros(n, dtype=bool)
        mask[positions.column(_POSITION).to_numpy()] = True
        return mask


@dataclass
class MemTableLevel(Level):
    """An unflushed MemTable's rows (newest per key, tombstones included) as of planning time:
    `source`, the MemTable's snapshot, holds their positions and keys, copies the rows when a reader
    first asks for them (`table`), and gives access to the MemTable's indexes."""

    noun: ClassVar[str] = "memtable"
    source: MemTableSnapshot = field(repr=False, compare=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    @property
    def table(self) -> pa.Table:
        """Its rows, copied when first asked for (`MemTableSnapshot.table`)."""
        return self.source.table

    def keys(self, primary_key: Sequence[str]) -> pa.Array:
        """Every key it holds, as the snapshot took them (no copy of its rows)."""
        return self.source.keys

    def memo(self, name: str, compute: Callable[[], T]) -> T:
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table:
        if filter is None and columns is not None:
            return self.source.columns(columns)
        t = self.table if filter is None else self.table.filter(filter)
        return t if columns is None else t.select(list(columns))

    def take(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        indices = pa.array(np.asarray(positions, dtype=np.int64))
        return self.table.select(list(columns)).take(indices)


@dataclass
class GenerationLevel(Level):
    """A flushed generation: its directory (`path`, relative to the table root), opened on demand;
    `missing` once a read found it garbage-collected."""

    noun: ClassVar[str] = "generation"
    path: str
    missing: bool = False
    _dataset: lance.LanceDataset | None = field(default=None, repr=False, kw_only=True)
    _bloom: BloomFilter | None = field(default=None, repr=False, kw_only=True)

    @cached_property
    def uri(self) -> str:
        return self.storage.child_uri(self.path)

    def cached(self, name: str, compute: Callable[[], Any], size: Callable[[Any], int] | None = None) -> Any:
        """A value derived from this generation's files, computed once per process (None: not kept);
        `size` declares its bytes to `GENERATIONS`' byte bound."""
        return GENERATIONS.get(self.uri, name, compute, size)

    def memo(self, name: str, compute: Callable[[], T]) -> T:
        return self.cached(name, compute)

    def key_set_in_memory(self, primary_key: Sequence[str]) -> KeySet | None:
        return GENERATIONS.get(self.uri, _key_set_name(primary_key), lambda: None)

    def verify(self) -> bool:
        """Check the generation's files against its checksum sidecar, once per process
        (`memwal_df.format.checksums`); False (and `missing` set) if it was garbage-collected.
        Raises `CorruptGenerationError` naming the file that does not match."""
        if verify_generation_once(self.storage, self.region_id, self.generation, self.path) == GONE:
            self.missing = True
            return False
        return True

    def dataset(self) -> lance.LanceDataset | None:
        """The generation's Lance dataset, its files verified; None (and `missing` set) if it was
        garbage-collected."""
        if self.missing:
            return None
        if self._dataset is None:
            if not self.verify():
                return None
            try:
                options = self.storage.storage_options or None
                self._dataset = self.cached(
                    "dataset", lambda: lance.dataset(self.uri, storage_options=options)
                )
            except (ValueError, OSError) as e:
                self._gone_or_raise(e)
                return None
        return self._dataset

    def _searched_dataset(self) -> lance.LanceDataset:
        """The generation's Lance dataset; MissingGenerationError if it was garbage-collected."""
        ds = self.dataset()
        if ds is None:
            raise MissingGenerationError(f"{self.name} was garbage-collected while it was searched")
        return ds

    def _gone_or_raise(self, cause: Exception) -> None:
        """After a failed read: mark the level missing if its directory was garbage-collected; a
        directory that exists but cannot be read is an error naming Lance's reason (skipping it
        would return stale rows)."""
        GENERATIONS.forget(self.uri)
        if self.storage.list(self.path):
            raise MissingGenerationError(
                f"{self.name} exists but cannot be read: {self.path} ({cause})"
            ) from cause
        self.missing = True

    def bloom(self) -> BloomFilter | None:
        """The generation's primary-key bloom filter, its files verified (None if it has none or
        was garbage-collected)."""
        if self._bloom is None:
            if self.missing or not self.verify():
                return None
            try:
                path = f"{self.path}/{layout.BLOOM_FILTER_FILE}"
                self._bloom = self.cached(
                    "bloom",
                    lambda: BloomFilter.from_bytes(self.storage.get(path)),
                    lambda _: BloomFilter.NUM_BYTES,
                )
            except (NotFoundError, ValueError):
                return None
        return self._bloom

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table | None:
        ds = self.dataset()
        if ds is None:
            return None
        sql, residual = split_for_lance(filter, schema)
        cols = None if columns is None else list(columns)
        read = (
            cols
            if residual is None or cols is None
            else list(dict.fromkeys([*cols, *referenced_columns(residual)]))
        )
        try:
            t = ds.to_table(columns=read, filter=sql)
        except (ValueError, OSError) as e:
            self._gone_or_raise(e)  # collected while we read it, or unreadable
            return None
        if residual is not None:
            t = t.filter(residual)
            if cols is not None:
                t = t.select(cols)
        return t

    def take(self, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """From memory when the generation's `columns` take at most `RESIDENT_BYTES` (read whole once
        per process: a Lance take per call would be most of a search's row phase), else through a
        Lance take."""
        indices = pa.array(np.asarray(positions, dtype=np.int64))
        resident = self.cached(f"resident rows:{','.join(columns)}", lambda: self._resident(columns))
        if resident is not _TOO_LARGE:
            return resident.take(indices)
        ds = self._searched_dataset()
        fragments = self.cached("fragment-ids", lambda: [f.fragment_id for f in ds.get_fragments()])
        if len(fragments) != 1 or len(np.unique(positions)) != len(positions):
            return ds.take(indices, columns=list(columns))
        # One fragment (every generation memwal_df writes): positions are its visible offsets, taken
        # through the fragment session the point lookups keep open (about half the cost of a take).
        order = np.argsort(positions)
        rows = fragment_take(ds, fragments[0], np.asarray(positions)[order], columns)
        return rows.take(pa.array(np.argsort(order)))

    def _resident(self, columns: Sequence[str]) -> Any:
        """The generation's `columns`, in position order, when they take at most RESIDENT_BYTES in
        memory; else `_TOO_LARGE`."""
        ds = self._searched_dataset()
        on_disk = sum(d.file_size_bytes or 0 for f in ds.get_fragments() for d in f.metadata.files)
        if on_disk > RESIDENT_BYTES:  # every column, compressed: no need to read it to know
            return _TOO_LARGE
        rows = self.read(columns).combine_chunks()
        return rows if rows.nbytes <= RESIDENT_BYTES else _TOO_LARGE
