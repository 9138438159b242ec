"""A read snapshot: every level of the LSM tree that one query reads, fixed when the query is planned.

Levels (spec "MemTable Collection"): the base table (generation 0), each region's flushed
generations that are not merged yet (`generation > merged_generations[region]`, read from the base
manifest of the pinned base version), and, when a writer is attached, its unflushed MemTables.
Within a region, levels are ordered newest first; rows of different regions never share a key.

Consistency modes:
- `latest`: the base table's latest version, then each region's latest manifest. Every generation
  flushed before planning is visible.
- with `writer=`: additionally the writer's unflushed MemTables, copied at planning time (strong
  consistency for the regions that writer owns).

Guarantees: a generation that was garbage-collected is skipped (its rows are in the base table), never
an error; each level holds at most one row per key (generations are written newest-per-key, Lance
generations hide older duplicates with a deletion vector, MemTable copies are deduplicated).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df import layout, memwal_index
from memwal_df._proto import memwal_pb2 as pb
from memwal_df.bloom import BloomFilter
from memwal_df.errors import MissingGenerationError, NotFoundError
from memwal_df.exec.keyset import key_array
from memwal_df.manifest import RegionManifestStore
from memwal_df.predicate import referenced_columns, split_for_lance
from memwal_df.schema import TableSchema
from memwal_df.storage import LocalStorage, Storage

if TYPE_CHECKING:
    from memwal_df.region import RegionWriter
    from memwal_df.table import Table
    from memwal_df.writer import TableWriter

Consistency = Literal["latest"]
_PARALLEL_MANIFEST_READS = 16
_MAX_PLANNING_ATTEMPTS = 5


class _GenerationCache:
    """Immutable per-generation state kept across queries, keyed by the generation's URI.

    A generation directory never changes once its manifest entry is committed (a retried flush
    writes a new directory), so its opened dataset, bloom filter and derived indexes stay valid until
    it is garbage-collected, which readers detect when a read fails."""

    def __init__(self, capacity: int = 4096) -> None:
        self._items: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity

    def get(self, uri: str, name: str, compute: Callable[[], Any]) -> Any:
        key = (uri, name)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        if value is not None:
            with self._lock:
                self._items[key] = value
                while len(self._items) > self._capacity:
                    self._items.popitem(last=False)
        return value

    def forget(self, uri: str) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == uri]:
                del self._items[key]


GENERATIONS = _GenerationCache()


@dataclass
class Level:
    """One source of rows: a flushed generation or an unflushed MemTable of one region.

    Rows carry the table's columns plus `_tombstone`. `generation` orders levels within a region;
    `memtable` levels hold an Arrow table, `generation` levels a path opened on demand."""

    kind: Literal["generation", "memtable"]
    region_id: uuid.UUID
    generation: int
    storage: Storage
    path: str | None = None  # generation directory relative to the table root
    table: pa.Table | None = None  # MemTable rows (newest per key, tombstones included)
    _dataset: lance.LanceDataset | None = field(default=None, repr=False)
    _bloom: BloomFilter | None = field(default=None, repr=False)
    _keys: pa.Array | None = field(default=None, repr=False)
    missing: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind} {self.generation} of region {self.region_id}"

    @property
    def uri(self) -> str:
        return self.storage.child_uri(self.path or "")

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """A value derived from this generation's files, computed once per process (None: not kept)."""
        return GENERATIONS.get(self.uri, name, compute)

    def dataset(self) -> lance.LanceDataset | None:
        """The generation's Lance dataset; None (and `missing` set) if it was garbage-collected."""
        if self.kind != "generation" or self.missing:
            return None
        if self._dataset is None:
            try:
                options = self.storage.storage_options or None
                self._dataset = self.cached(
                    "dataset", lambda: lance.dataset(self.uri, storage_options=options)
                )
            except (ValueError, OSError):
                self._gone_or_raise()
                return None
        return self._dataset

    def _gone_or_raise(self) -> None:
        """After a failed read: mark the level missing if its directory was garbage-collected; a
        directory that exists but cannot be read is an error (skipping it would return stale rows)."""
        GENERATIONS.forget(self.uri)
        if self.storage.list(self.path or ""):
            raise MissingGenerationError(f"{self.name} exists but cannot be read: {self.path}")
        self.missing = True

    def bloom(self) -> BloomFilter | None:
        """The level's primary-key bloom filter (None if the generation has none)."""
        if self._bloom is None:
            if self.kind == "memtable":
                return None
            try:
                path = f"{self.path}/{layout.BLOOM_FILTER_FILE}"
                self._bloom = self.cached("bloom", lambda: BloomFilter.from_bytes(self.storage.get(path)))
            except (NotFoundError, ValueError):
                return None
        return self._bloom

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

    def to_table(
        self,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table | None:
        """The level's rows (only `columns`, rows matching `filter` by pyarrow's rules), None if the
        level is gone. `schema` (the table's) lets the filter be pushed into Lance's scan."""
        if self.kind == "memtable":
            assert self.table is not None
            t = self.table if filter is None else self.table.filter(filter)
            return t if columns is None else t.select(list(columns))
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
        except (ValueError, OSError):
            self._gone_or_raise()  # collected while we read it, or unreadable
            return None
        if residual is not None:
            t = t.filter(residual)
            if cols is not None:
                t = t.select(cols)
        return t


@dataclass
class RegionLevels:
    """The unmerged levels of one region, newest first; `merged`: the generations still listed in its
    manifest that are merged into the pinned base, newest first (read only by index catch-up plans)."""

    region_id: uuid.UUID
    spec_id: int
    values: tuple[Any, ...] | None
    levels: list[Level]
    merged: list[Level] = field(default_factory=list)


@dataclass
class ReadSnapshot:
    """What one query reads."""

    schema: TableSchema
    base: lance.LanceDataset
    details: pb.MemWalIndexDetails
    regions: list[RegionLevels]
    consistency: str
    storage: Storage  # the table's: older base manifests are read through it

    @property
    def levels(self) -> list[Level]:
        return [lv for r in self.regions for lv in r.levels]


def take_snapshot(
    table: Table, consistency: Consistency = "latest", writer: TableWriter | RegionWriter | None = None
) -> ReadSnapshot:
    """Pin the base version, then read every region's latest manifest (and the writer's MemTables)."""
    if consistency != "latest":
        raise ValueError(f"unknown consistency mode {consistency!r} (only 'latest' exists so far)")
    for _ in range(_MAX_PLANNING_ATTEMPTS):
        snapshot = _take(table, writer)
        # A merge committed while the manifests were read may already have been collected: its
        # generations would be missing from both the pinned base and the levels. Plan again.
        if memwal_index.latest_version(table.storage) == snapshot.base.version:
            return snapshot
    return snapshot


def _take(table: Table, writer: TableWriter | RegionWriter | None) -> ReadSnapshot:
    table.refresh()
    base = table.dataset
    merged = memwal_index.merged_generations(table.details)
    # MemTables first, manifests second: a MemTable flushed in between is then seen twice (as a
    # MemTable and as a generation, same rows), never not at all.
    memtables = _writer_memtables(writer)
    ids = table.region_ids()
    storage = table.storage

    def latest(region_id: uuid.UUID) -> pb.ShardManifest | None:
        return RegionManifestStore(storage, region_id).latest()

    # Local manifests are read faster than a thread pool starts; object stores in parallel.
    if len(ids) <= 1 or isinstance(storage, LocalStorage):
        manifests = [latest(r) for r in ids]
    else:
        manifests = list(_manifest_pool().map(latest, ids))
    regions = []
    for region_id, m in zip(ids, manifests, strict=True):
        if m is None:
            continue
        floor = merged.get(region_id, 0)
        levels = [
            Level("memtable", region_id, gen, storage, table=t)
            for gen, t in reversed(memtables.get(region_id, []))
        ]
        flushed = [
            Level(
                "generation", region_id, s.generation, storage, path=layout.generation_path(region_id, s.path)
            )
            for s in sorted(m.sstables, key=lambda s: -s.generation)
        ]
        levels += [lv for lv in flushed if lv.generation > floor]
        done = [lv for lv in flushed if lv.generation <= floor]  # merged, still listed
        regions.append(RegionLevels(region_id, m.shard_spec_id, table.region_values(m), levels, done))
    return ReadSnapshot(table.schema, base, table.details, regions, "latest", storage)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _manifest_pool() -> ThreadPoolExecutor:
    """One process-wide pool for parallel manifest reads (starting a pool per query costs ms)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_PARALLEL_MANIFEST_READS, thread_name_prefix="memwal-manifest")
        return _POOL


def _writer_memtables(
    writer: TableWriter | RegionWriter | None,
) -> dict[uuid.UUID, list[tuple[int, pa.Table]]]:
    """(generation, newest rows) of each unflushed MemTable of the writer, per region, oldest first."""
    if writer is None:
        return {}
    region_writers = getattr(writer, "writers", None)
    writers = list(region_writers.values()) if region_writers is not None else [writer]
    return {w.region_id: w.memtable_snapshot() for w in writers}
