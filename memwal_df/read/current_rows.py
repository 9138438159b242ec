"""The current rows of a region writer's keys, for partial and conditional writes: the read path's
batched point lookup (`plan_point_lookup`: one plan per write, newest level first, bloom-guarded
generation takes by `_pk_index`, the base key index) over the writer's own levels.

Guarantees: the rows returned are the live rows of the asked keys as of the writer's MemTables (given
by the writer, which holds its lock), the generations of its manifest that the base has not merged, and
the base. The base is the table handle's open version, refreshed only when needed: a generation
garbage-collected while it was read (merged meanwhile, its rows in a newer base), or a manifest that
garbage collection may have stripped of generations the open base lacks, makes the lookup run again on
the base's latest version; it never answers from a base that lacks rows of a level it skipped.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pyarrow as pa

from memwal_df.errors import MissingGenerationError
from memwal_df.format import memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.table_handle import TableHandle
from memwal_df.read.levels import GenerationLevel
from memwal_df.read.lookup_planner import plan_point_lookup
from memwal_df.read.snapshot import ReadSnapshot, region_writer_snapshot

_MAX_ATTEMPTS = 5


def current_rows(
    table: TableHandle,
    region_id: uuid.UUID,
    manifest: pb.ShardManifest,
    memtables: Sequence[tuple[int, pa.Table]],
    keys: pa.Table,
    columns: Sequence[str],
) -> pa.Table:
    """The live rows (`columns` only) of `keys` in the region (see `memwal_df.write.partial.CurrentRows`)."""
    ts = table.schema
    schema = pa.schema([ts.schema.field(c) for c in columns])
    for attempt in range(_MAX_ATTEMPTS):
        if attempt:
            table.sync()  # a generation was collected: its merge is in a newer base version
        snapshot = region_writer_snapshot(table, region_id, manifest, memtables)
        node = plan_point_lookup(snapshot, None, ts.field_ids, keys, columns)
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
