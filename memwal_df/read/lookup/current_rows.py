"""The current rows of a region writer's keys in its stored levels, for partial and conditional writes:
one batched lookup per write (`memwal_df.write.newest_rows`): the unmerged generations newest first,
each asked by `_pk_index` (bloom-guarded for a few keys) for the keys no newer level held, then the
base (its key index, or the rows read once for the whole write).

Guarantees: the rows returned are the live rows of the asked keys (the ones none of the writer's
MemTables holds; the writer asks under its lock) as of the generations of its manifest that the base
has not merged, except those it holds in memory, and the base. The base is the table handle's open
version, refreshed only when needed: a generation garbage-collected while it was read (merged
meanwhile, its rows in a newer base), or a manifest that garbage collection may have stripped of
generations the open base lacks, makes the lookup run again on the base's latest version; it never
answers from a base that lacks rows of a level it skipped. Base rows taken once for a write across its
regions (`base_rows`) stand for the base only in a lookup that reads the very version they were taken
from (a version's rows never change); any other lookup, a retry on a newer version included, reads the
base itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError
from memwal_df.format import memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.table_handle import TableHandle
from memwal_df.pools import shared_pool
from memwal_df.read.exec.base import ExecNode
from memwal_df.read.lookup.bloom_guard import BloomFilterGuardExec
from memwal_df.read.lookup.take_last import TakeLastExec, with_live_flag
from memwal_df.read.lsm.keys import distinct_keys
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import ReadSnapshot, region_writer_snapshot
from memwal_df.write.newest_rows import Found, KeyedLevel, newest_rows
from memwal_df.write.partial import BaseRows, encoded_keys

_MAX_ATTEMPTS = 5
# Up to this many keys a region, bloom filters rule generations out cheaper than `_pk_index` lookups.
_GUARDED_KEYS = 16


def _may_lack_merged(region_id: uuid.UUID, manifest: pb.ShardManifest, snapshot: ReadSnapshot) -> bool:
    """Whether `manifest` may no longer list generations that the snapshot's base has not merged:
    garbage collection unlists the merged prefix of a region's generations (merged into a base newer
    than the snapshot's), so a gap between the base's merged generation and the lowest listed one
    (or the next one to flush) may hold such generations. Then only the latest base is sure to
    hold their rows."""
    merged = memwal_index.merged_generations(snapshot.details).get(region_id, 0)
    lowest = min((s.generation for s in manifest.sstables), default=manifest.current_generation)
    return lowest > merged + 1


@dataclass(frozen=True)
class _Generation:
    """A stored generation asked through its `_pk_index` (`TakeLastExec`), behind its bloom filter
    when `guard`: for a few keys the filter rules it out cheaper than the index lookup."""

    level: GenerationLevel
    primary_key: list[str]
    guard: bool

    def find(
        self, keys: pa.Table | None, asked: pa.Array, columns: Sequence[str]
    ) -> tuple[pa.Table, np.ndarray]:
        assert keys is not None

        def take(k: pa.Table) -> ExecNode:
            return TakeLastExec(self.level, k, columns, self.primary_key)

        node = BloomFilterGuardExec(self.level, keys, take, self.primary_key) if self.guard else take(keys)
        return _held(list(node.execute()), asked, self.primary_key)


@dataclass(frozen=True)
class _Base:
    """The base table: the rows `taken` for the write when it gives them, else a lookup of its own."""

    dataset: lance.LanceDataset
    storage: Storage
    primary_key: list[str]
    taken: Callable[[], pa.Table | None] | None

    def find(
        self, keys: pa.Table | None, asked: pa.Array, columns: Sequence[str]
    ) -> tuple[pa.Table, np.ndarray]:
        assert keys is not None
        rows = self.taken() if self.taken is not None else None
        if rows is None:
            keys = distinct_keys(keys, self.primary_key)  # (a key index take needs each key once)
            node = TakeLastExec(self.dataset, keys, columns, self.primary_key, self.storage)
            return _held(list(node.execute()), asked, self.primary_key)
        at = _positions(rows, asked, self.primary_key)  # (the base holds a key once)
        hit = np.flatnonzero(at >= 0)  # (the rows are the whole write's: the asked keys' go on)
        taken = rows.take(pa.array(at[hit]))
        at[hit] = np.arange(len(hit))
        return with_live_flag(taken), at


def _held(
    batches: list[pa.RecordBatch], asked: pa.Array, primary_key: Sequence[str]
) -> tuple[pa.Table, np.ndarray]:
    """A `TakeLastExec`'s rows (one per key) and the position there of each asked key (-1: none)."""
    if not batches:
        return pa.table({}), np.full(len(asked), -1, np.int64)
    rows = pa.Table.from_batches(batches)
    return rows, _positions(rows, asked, primary_key)


def _positions(rows: pa.Table, asked: pa.Array, primary_key: Sequence[str]) -> np.ndarray:
    """The position in `rows` (one per key) of each asked key's row, -1 where `rows` lacks it."""
    at = pc.index_in(asked, value_set=encoded_keys(rows, primary_key))
    return at.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def base_rows(table: TableHandle, keys: pa.Table, columns: Sequence[str]) -> BaseRows:
    """The live rows of `keys` (`columns` only) in the open version of the base, read in one lookup on
    a background thread."""
    ds = table.dataset
    node = TakeLastExec(ds, keys, columns, table.schema.primary_key, table.storage)
    return BaseRows(ds.version, tuple(node.columns), shared_pool("base-rows", 2).submit(_read, node, ds))


def _read(node: TakeLastExec, ds: lance.LanceDataset) -> pa.Table | None:
    """The rows of a base lookup without `_tombstone`; None when its version cannot be read (its files
    cleaned up): each region's lookup then reads a base itself."""
    try:
        batches = list(node.execute())
    except (OSError, ValueError):
        return None
    rows = pa.Table.from_batches(batches) if batches else ds.schema.empty_table()
    return rows.select(list(node.columns))


def _taken(
    base: BaseRows | None, version: int, columns: Sequence[str]
) -> Callable[[], pa.Table | None] | None:
    """The rows of `base`, when read, if they stand for the base of this lookup: same version, every
    column."""
    if base is None or base.version != version or not set(columns) <= set(base.columns):
        return None
    return base.rows


class WriterLookup:
    """The `CurrentRows` lookup of the writers of `table` (`memwal_df.write.partial`)."""

    def __init__(self, table: TableHandle) -> None:
        self.table = table

    def __call__(
        self,
        region_id: uuid.UUID,
        manifest: pb.ShardManifest,
        held: Collection[int],
        keys: pa.Table,
        columns: Sequence[str],
        base: BaseRows | None = None,
    ) -> Found:
        """The live rows (`columns` only) of `keys` in the region's stored levels (see
        `memwal_df.write.partial.CurrentRows`)."""
        table = self.table
        ts = table.schema
        pk = list(ts.primary_key)
        schema = pa.schema([ts.schema.field(c) for c in columns])
        keys = keys.select(pk)
        asked = encoded_keys(keys, pk)
        for attempt in range(_MAX_ATTEMPTS):
            if attempt:
                table.sync()  # a generation was collected: its merge is in a newer base version
            snapshot = region_writer_snapshot(table, region_id, manifest, held)
            generations = [lv for lv in snapshot.levels if isinstance(lv, GenerationLevel)]
            guard = keys.num_rows <= _GUARDED_KEYS
            levels: list[KeyedLevel] = [_Generation(lv, pk, guard) for lv in generations]
            levels.append(
                _Base(snapshot.base, table.storage, pk, _taken(base, snapshot.base.version, columns))
            )
            try:
                found = newest_rows(levels, asked, schema, keys)
            except (OSError, ValueError):
                if attempt + 1 == _MAX_ATTEMPTS or table.is_latest(snapshot.base.version):
                    raise
                continue  # an old base version whose files version cleanup removed: read the latest
            if any(lv.missing for lv in generations):
                continue
            if _may_lack_merged(region_id, manifest, snapshot) and not table.is_latest(snapshot.base.version):
                continue
            return found
        raise MissingGenerationError(  # (a merge and GC on every attempt)
            f"region {region_id}: generations kept disappearing during {_MAX_ATTEMPTS} lookups of "
            "current rows"
        )

    def base_rows(self, keys: pa.Table, columns: Sequence[str]) -> BaseRows:
        return base_rows(self.table, keys, columns)
