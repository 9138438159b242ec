"""Corrupt flushed generations: finding them (`generation_problems`, for `Table.status()`) and the
operator's repair (`repair_region`, which `Table.repair_region` runs: the WAL repair of
`memwal_df.jobs.repair` plus the corrupt unmerged generations of the region).

A generation holds the rows of the WAL entries after the previous flush up to its own: positions
`first..last`, where `last` is the region manifest's `replay_after_wal_entry_position` in the version
that added the generation and `first - 1` the same field one version earlier. A corrupt unmerged
generation (its files fail `memwal_df.format.checksums.verify_generation`, or, without a sidecar,
`check_rows`) is

* rebuilt when both manifest versions are still stored and every WAL entry of the range is stored
  and readable: the entries are replayed into a MemTable of the same generation, as a claiming
  writer replays them, and written as a new generation directory, which a new region manifest
  version lists in place of the corrupt one;
* otherwise dropped from the region manifest (a new version): its rows are lost, and the plan says
  how many.

Either way the corrupt directory is then moved to `_mem_wal/{region}/quarantine/generations/`, never
deleted. Manifest commits keep the writer epoch and are retried on a lost race (re-applied to the
newest version), so an active writer keeps writing.

Guarantees: nothing is changed without `apply=True`; only unmerged generations that fail
verification are touched; a rebuilt generation holds exactly the rows its WAL entries replay to.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

import lance

from memwal_df.errors import CommitConflictError, CorruptGenerationError, CorruptWalEntryError
from memwal_df.format import checksums, layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.table_handle import TableHandle
from memwal_df.format.wal import Wal
from memwal_df.jobs import repair
from memwal_df.jobs.repair import GenerationFix, RegionProblem, RepairPlan
from memwal_df.write.claim import conform_replayed
from memwal_df.write.generation import write_generation
from memwal_df.write.memtable import MemTable

_COMMIT_ATTEMPTS = 20


def check_generation(
    storage: Storage, region_id: uuid.UUID, sstable: pb.SsTable, primary_key: Sequence[str]
) -> None:
    """Verify a flushed generation's files against its checksum sidecar, or, without one, its row
    count and keys (`checksums.check_rows`, reading the key columns only). Raises
    `CorruptGenerationError`; a generation that is gone passes."""
    rel = layout.generation_path(region_id, sstable.path)
    outcome = checksums.verify_generation(storage, region_id, sstable.generation, rel)
    if outcome != checksums.UNCHECKED:
        return
    try:
        ds = lance.dataset(storage.child_uri(rel), storage_options=storage.storage_options or None)
        keys = ds.to_table(columns=list(primary_key))
        physical = sum(f.metadata.physical_rows for f in ds.get_fragments())
    except (ValueError, OSError) as e:
        if not storage.list(rel):
            return
        name = f"generation {sstable.generation} of region {region_id}"
        raise CorruptGenerationError(
            f"{name} cannot be read ({e})", rel, region_id, sstable.generation
        ) from e
    checksums.check_rows(
        keys, physical, sstable.physical_rows, primary_key, region_id, sstable.generation, rel
    )


def generation_problems(
    storage: Storage, region_id: uuid.UUID, merged: int, primary_key: Sequence[str]
) -> list[RegionProblem]:
    """The region's unmerged generations (above `merged`) that fail `check_generation`."""
    m = RegionManifestStore(storage, region_id).latest()
    out = []
    for sstable in sorted(m.sstables, key=lambda s: s.generation) if m is not None else []:
        if sstable.generation > merged:
            try:
                check_generation(storage, region_id, sstable, primary_key)
            except CorruptGenerationError as e:
                out.append(RegionProblem(region_id, "generation", e.path, str(e)))
    return out


# ------------------------------------------------------------------------------------------ repair


def repair_region(
    table: TableHandle, region_id: uuid.UUID, *, apply: bool = False, discard_later: bool = False
) -> RepairPlan:
    """Plan (and with `apply=True` perform) the repair of the region's WAL (`repair.repair_region`)
    and of its corrupt unmerged generations (see the module docstring). A refused WAL repair
    (`RepairRefusedError`) changes nothing."""
    plan = repair.repair_region(table.storage, region_id, discard_later=discard_later)
    planned = _plan(table, region_id)
    if apply:
        fixes = tuple(_apply(table, region_id, fix, memtable) for fix, memtable in planned)
        plan = repair.repair_region(table.storage, region_id, apply=True, discard_later=discard_later)
    else:
        fixes = tuple(fix for fix, _ in planned)
    quarantine = repair.generation_quarantine(region_id) if fixes else None
    applied = plan.applied or (apply and bool(fixes))
    return replace(plan, generations=fixes, generation_quarantine=quarantine, applied=applied)


def _plan(table: TableHandle, region_id: uuid.UUID) -> list[tuple[GenerationFix, MemTable | None]]:
    """Each corrupt unmerged generation with its fix and, when it can be rebuilt, its replayed rows."""
    table.refresh()
    merged = memwal_index.merged_generations(table.details).get(region_id, 0)
    store = RegionManifestStore(table.storage, region_id)
    m = store.latest()
    out = []
    for sstable in sorted(m.sstables, key=lambda s: s.generation) if m is not None else []:
        if sstable.generation <= merged:
            continue
        try:
            check_generation(table.storage, region_id, sstable, table.schema.primary_key)
        except CorruptGenerationError as e:
            out.append(_plan_one(table, store, sstable, str(e)))
    return out


def _plan_one(
    table: TableHandle, store: RegionManifestStore, sstable: pb.SsTable, error: str
) -> tuple[GenerationFix, MemTable | None]:
    rel = layout.generation_path(store.region_id, sstable.path)
    fix = GenerationFix(sstable.generation, rel, error, sstable.physical_rows, None, None)
    span = wal_range(store, sstable.generation)
    if span is None:
        why = "the region manifest versions that recorded its WAL positions were garbage-collected"
        return replace(fix, why_not=why), None
    wal = Wal(table.storage, store.region_id)
    memtable = MemTable(sstable.generation, table.schema.wal, table.schema.primary_key)
    for position in range(span[0], span[1] + 1):
        try:
            entry = wal.read(position)
        except CorruptWalEntryError:
            return replace(fix, why_not=f"its WAL entry {position} is corrupt"), None
        if entry is None:
            return replace(fix, why_not=f"its WAL entry {position} is gone (garbage-collected)"), None
        for batch in entry.batches:
            memtable.append(conform_replayed(memtable.schema, wal, batch, position))
    memtable.seal()
    complete = not sstable.physical_rows or sstable.physical_rows in (memtable.num_keys, memtable.num_rows)
    return replace(fix, wal_positions=span, rebuilt_rows=memtable.num_keys, complete=complete), memtable


def wal_range(store: RegionManifestStore, generation: int) -> tuple[int, int] | None:
    """The WAL positions (first, last) whose entries generation `generation` holds, from the manifest
    version that added it and the one before; None when either is no longer stored (or the
    generation is not listed)."""
    versions = store.list_versions()

    def lists(i: int) -> bool:
        m = store.read(versions[i])
        return m is not None and any(s.generation == generation for s in m.sstables)

    lo, hi = (
        0,
        len(versions),
    )  # the first version listing it: versions of an unmerged one list it from then on
    while lo < hi:
        mid = (lo + hi) // 2
        if lists(mid):
            hi = mid
        else:
            lo = mid + 1
    if lo == 0 or lo == len(versions) or versions[lo - 1] != versions[lo] - 1:
        return None
    added, before = store.read(versions[lo]), store.read(versions[lo - 1])
    if added is None or before is None:
        return None
    first, last = before.replay_after_wal_entry_position + 1, added.replay_after_wal_entry_position
    return (first, last) if first <= last else None


def _apply(
    table: TableHandle, region_id: uuid.UUID, fix: GenerationFix, memtable: MemTable | None
) -> GenerationFix:
    """Rebuild `fix`'s generation from `memtable` (or drop it without one), then move its corrupt
    directory to the quarantine directory."""
    name = fix.path.rsplit("/", 1)[1]
    store = RegionManifestStore(table.storage, region_id)
    if memtable is not None:
        rebuilt = write_generation(
            table.storage, region_id, memtable, table.data_storage_version, table.maintained_indexes()
        )

        def change(m: pb.ShardManifest) -> None:
            old = next(s for s in m.sstables if s.path == name)
            old.CopyFrom(rebuilt)

        _commit(store, name, change)
        fix = replace(fix, rebuilt_path=layout.generation_path(region_id, rebuilt.path))
    else:

        def drop(m: pb.ShardManifest) -> None:
            kept = [s for s in m.sstables if s.path != name]
            del m.sstables[:]
            m.sstables.extend(kept)

        _commit(store, name, drop)
    aside = f"{repair.generation_quarantine(region_id)}/{name}"
    for path in table.storage.list(fix.path):
        repair.move(table.storage, path, f"{aside}/{path[len(fix.path) + 1 :]}")
    return fix


def _commit(store: RegionManifestStore, name: str, change: Callable[[pb.ShardManifest], None]) -> None:
    """Commit `change` to the newest manifest version while it still lists generation directory
    `name`; `CommitConflictError` when it no longer does or races keep being lost."""
    for _ in range(_COMMIT_ATTEMPTS):
        latest = store.latest()
        if latest is None or not any(s.path == name for s in latest.sstables):
            raise CommitConflictError(
                f"region {store.region_id}: the manifest no longer lists {name}; run the repair again"
            )
        m = next_version(latest)
        change(m)
        if store.commit(m):
            return
    raise CommitConflictError(f"region {store.region_id}: lost {_COMMIT_ATTEMPTS} manifest commit races")
