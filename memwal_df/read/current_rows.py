"""The current rows of a region writer's keys, for partial and conditional writes: the read path's
batched point lookup (`plan_point_lookup`: one plan per write, newest level first, bloom-guarded
generation takes by `_pk_index`, the base key index) over the writer's own levels.

Guarantees: the rows returned are the live rows of the asked keys as of the writer's MemTables (given
by the writer, which holds its lock), the generations of its manifest that the base has not merged, and
the base. The base is the table handle's open version, refreshed only when needed: a generation
garbage-collected while it was read (merged meanwhile, its rows in a newer base), or a manifest that
garbage collection may have stripped of generations the open base lacks, makes the lookup run again on
the base's latest version; it never answers from a base that lacks rows of a level it skipped.
Base rows taken once for a write across its regions (`base_rows`) stand for the base only in a
lookup that reads the very version they were taken from (a version's rows never change); any other
lookup, a retry on a newer version included, reads the base itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import lance
import pyarrow as pa

from memwal_df.errors import MissingGenerationError
from memwal_df.format import memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.table_handle import TableHandle
from memwal_df.pools import shared_pool
from memwal_df.read.exec.take_last import TakeLastExec
from memwal_df.read.levels import GenerationLevel
from memwal_df.read.lookup_planner import plan_point_lookup
from memwal_df.read.snapshot import ReadSnapshot, region_writer_snapshot
from memwal_df.write.partial import BaseRows

_MAX_ATTEMPTS = 5
# Up to this many keys a region, bloom filters rule generations out cheaper than `_pk_index` lookups.
_GUARDED_KEYS = 16


def current_rows(
    table: TableHandle,
    region_id: uuid.UUID,
    manifest: pb.ShardManifest,
    memtables: Sequence[tuple[int, pa.Table]],
    keys: pa.Table,
    columns: Sequence[str],
    base: BaseRows | None = None,
) -> pa.Table:
    """The live rows (`columns` only) of `keys` in the region (see `memwal_df.write.partial.CurrentRows`)."""
    ts = table.schema
    schema = pa.schema([ts.schema.field(c) for c in columns])
    for attempt in range(_MAX_ATTEMPTS):
        if attempt:
            table.sync()  # a generation was collected: its merge is in a newer base version
        snapshot = region_writer_snapshot(table, region_id, manifest, memtables)
        taken = _taken(base, snapshot.base.version, columns)
        node = plan_point_lookup(
            snapshot,
            None,
            ts.field_ids,
            keys,
            columns,
            base_rows=taken,
            bloom_guards=len(keys) <= _GUARDED_KEYS,
        )
        try:
            rows = pa.Table.from_batches(list(node.execute()), schema=schema)
        except (OSError, ValueError):
            if attempt + 1 == _MAX_ATTEMPTS or table.is_latest(snapshot.base.version):
                raise
            continue  # an old base version whose files version cleanup removed: read the latest
        if any(isinstance(lv, GenerationLevel) and lv.missing for lv in snapshot.levels):
            continue
        if _may_lack_merged(region_id, manifest, snapshot) and not table.is_latest(snapshot.base.version):
            continue
        return rows
    raise MissingGenerationError(  # (a merge and GC on every attempt)
        f"region {region_id}: generations kept disappearing during {_MAX_ATTEMPTS} lookups of current rows"
    )


def _may_lack_merged(region_id: uuid.UUID, manifest: pb.ShardManifest, snapshot: ReadSnapshot) -> bool:
    """Whether `manifest` may no longer list generations that the snapshot's base has not merged:
    garbage collection unlists the merged prefix of a region's generations (merged into a base newer
    than the snapshot's), so a gap between the base's merged generation and the lowest listed one
    (or the next one to flush) may hold such generations. Then only the latest base is sure to
    hold their rows."""
    merged = memwal_index.merged_generations(snapshot.details).get(region_id, 0)
    lowest = min((s.generation for s in manifest.sstables), default=manifest.current_generation)
    return lowest > merged + 1


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
        memtables: Sequence[tuple[int, pa.Table]],
        keys: pa.Table,
        columns: Sequence[str],
        base: BaseRows | None = None,
    ) -> pa.Table:
        return current_rows(self.table, region_id, manifest, memtables, keys, columns, base)

    def base_rows(self, keys: pa.Table, columns: Sequence[str]) -> BaseRows:
        return base_rows(self.table, keys, columns)
