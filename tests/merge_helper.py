"""Test helpers around the background jobs.

`merge_region` / `merge_all` run the real merger (`memwal_df.jobs.merger`). `gc_merged` is a deliberately
aggressive stand-in for GC that deletes the directory of every merged generation at once, ignoring
time travel and grace (the real `Table.gc` keeps what retained base versions reach): reader tests use
it to check that readers skip garbage-collected generations.
"""

from __future__ import annotations

import uuid

from memwal_df.format import layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.table import Table


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
    ascending order, with the real merger; returns the generations merged."""
    floor = merged_generation(table, region_id)
    pending = [
        g for g, _ in flushed_generations(table, region_id) if g > floor and (up_to is None or g <= up_to)
    ]
    if not pending:
        return []
    return list(table.merge([region_id], max_generations=len(pending)).generations.get(region_id, ()))


def merge_all(table: Table) -> dict[uuid.UUID, list[int]]:
    """Merge every region's unmerged generations."""
    merged = table.merge().generations
    return {r: list(merged.get(r, ())) for r in table.region_ids()}


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
