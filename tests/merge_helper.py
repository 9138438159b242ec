"""Test helpers that stand in for the background jobs: a merger and a GC built on Lance's primitives.

`merge_region` merges a region's flushed generations into the base table exactly as the real merger
will (reference/lance14-native-format.md section 5): for each flushed generation above the region's
merged generation, in ascending order, a `when_matched_delete` pass for its tombstones (no marker),
then an upsert pass of its live rows carrying the `CompactedSsTable(region, generation)` marker (an
empty source with the marker still commits). `gc_merged` deletes the directories of merged
generations, as GC will; readers must then skip them.
"""

from __future__ import annotations

import uuid

import lance
import pyarrow as pa
import pyarrow.compute as pc
from lance.mem_wal import CompactedSsTable

from memwal_df import layout, memwal_index
from memwal_df.manifest import RegionManifestStore
from memwal_df.table import Table

TOMBSTONE = "_tombstone"


def flushed_generations(table: Table, region_id: uuid.UUID) -> list[tuple[int, str]]:
    """(generation, path relative to the table root) of every flushed generation, ascending."""
    m = RegionManifestStore(table.storage, region_id).latest()
    if m is None:
        return []
    return sorted((s.generation, layout.generation_path(region_id, s.path)) for s in m.sstables)


def merged_generation(table: Table, region_id: uuid.UUID) -> int:
    table.refresh()
    return memwal_index.merged_generations(table.details).get(region_id, 0)


def merge_region(table: Table, region_id: uuid.UUID, up_to: int | None = None) -> list[int]:
    """Merge the region's unmerged flushed generations (those <= `up_to` if given) into the base, in
    ascending order; returns the generations merged."""
    pk = list(table.schema.primary_key)
    floor = merged_generation(table, region_id)
    done = []
    for gen, path in flushed_generations(table, region_id):
        if gen <= floor or (up_to is not None and gen > up_to):
            continue
        rows = lance.dataset(
            table.storage.child_uri(path), storage_options=table.storage_options or None
        ).to_table()
        dead = rows.column(TOMBSTONE)
        tombstones = rows.filter(dead).drop_columns([TOMBSTONE])
        live = rows.filter(pc.invert(dead)).drop_columns([TOMBSTONE])
        options = table.storage_options or None
        if tombstones.num_rows:
            ds = lance.dataset(table.uri, storage_options=options)
            ds.merge_insert(pk).when_matched_delete().execute(tombstones)
        ds = lance.dataset(table.uri, storage_options=options)
        live = live.cast(pa.schema([ds.schema.field(n) for n in live.column_names]))
        (
            ds.merge_insert(pk)
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .mark_sstables_as_compacted([CompactedSsTable(str(region_id), gen)])
            .execute(live)
        )
        done.append(gen)
    table.refresh()
    return done


def merge_all(table: Table) -> dict[uuid.UUID, list[int]]:
    """Merge every region's unmerged generations."""
    return {r: merge_region(table, r) for r in table.region_ids()}


def gc_merged(table: Table) -> list[str]:
    """Delete the directory of every merged generation still present; returns the paths deleted."""
    table.refresh()
    merged = memwal_index.merged_generations(table.details)
    deleted = []
    for region_id in table.region_ids():
        floor = merged.get(region_id, 0)
        for gen, path in flushed_generations(table, region_id):
            if gen <= floor and table.storage.list_dir(path):
                table.storage.delete_prefix(path)
                deleted.append(path)
    return deleted
