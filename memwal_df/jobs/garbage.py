"""Garbage collection of a MemWAL table's regions (spec "Garbage collector").

`gc(table)` removes, per region:
1. **merged generations** no reader or writer can still need: generation `g` of region `r` goes when
   - every retained base version (Lance's `versions()`: what time travel can reach) records
     `merged_generations[r] >= g` — so base versions must first be cleaned up with Lance's
     `cleanup_old_versions`, which is the table's time-travel retention policy;
   - every maintained index that exists on the base records index catch-up `>= g` for `r`;
   - the grace rule for readers still running on a version cleaned up meanwhile: if any base version
     was cleaned up (the oldest retained one is not version 1), the oldest retained version must be
     older than `grace`. A query planned against a cleaned-up version started before that version's
     successor was committed, so only queries running longer than `grace` can miss a generation;
   - every change-feed consumer that pins (`memwal_df.format.consumers`: it committed offsets less
     than its expiry ago) has read every change of `g`: its offsets name a later generation.
   They leave the region manifest first (a new manifest version, same epoch, put-if-not-exists,
   retried on a lost race as the writer and index builder do), then their directories are deleted;
2. **their WAL entries**: from the lowest position up, entries covered by a flushed generation
   (position <= `replay_after_wal_entry_position`) whose generation (entry metadata) is removable;
   fence sentinels among them too. It stops at the first entry that does not qualify;
3. **orphaned generation directories** of failed flushes: `*_gen_*` directories no retained manifest
   version lists, with a generation below the region's `current_generation` (a writer only flushes
   `current_generation`, so an in-flight flush is never touched);
4. **old region manifest versions**: all but the newest `keep_manifest_versions` (>= 2, so a writer
   can still tell its own commit from a claim);
and, outside the regions, the region leases of Spark write jobs whose driver died before it removed
them (`_mem_wal/_write_leases/{job}`, `memwal_df.spark.staging`): a job's directory goes once none
of its leases expired less than `grace` ago.
Readers skip garbage-collected generation directories; see `docs/background-jobs.md`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import lance

from memwal_df.errors import CorruptRegionsError, InvalidConfigError, TableNotFoundError
from memwal_df.format import base_manifest, consumers, layout, lease, memwal_index
from memwal_df.format.manifest import RegionManifestStore, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal
from memwal_df.jobs.index_catchup import maintained_index_names
from memwal_df.jobs.repair import each_region

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle

DEFAULT_GRACE = timedelta(hours=1)
DEFAULT_KEEP_MANIFEST_VERSIONS = 10
_COMMIT_ATTEMPTS = 20


@dataclass(frozen=True)
class RegionGc:
    """What one `gc` removed from one region."""

    region_id: uuid.UUID
    removable_through: int  # generations <= this were removable (merged, indexed, unreachable)
    generations: tuple[int, ...]  # merged generations unlisted and/or deleted by this call
    orphans: tuple[str, ...]  # paths of orphaned generation directories deleted
    wal_positions: tuple[int, ...]  # WAL entries deleted
    manifest_versions: tuple[int, ...]  # region manifest versions deleted


@dataclass(frozen=True)
class GcResult:
    """What one `gc` removed, per region."""

    regions: tuple[RegionGc, ...]
    write_lease_jobs: tuple[str, ...] = ()  # Spark write jobs whose stale lease directories were deleted

    @property
    def generations(self) -> dict[uuid.UUID, tuple[int, ...]]:
        return {r.region_id: r.generations for r in self.regions if r.generations}

    @property
    def removed(self) -> int:
        """Generations, orphans, WAL entries and manifest versions removed, in total."""
        return sum(
            len(r.generations) + len(r.orphans) + len(r.wal_positions) + len(r.manifest_versions)
            for r in self.regions
        )


def gc(
    table: TableHandle,
    *,
    grace: timedelta = DEFAULT_GRACE,
    keep_manifest_versions: int = DEFAULT_KEEP_MANIFEST_VERSIONS,
) -> GcResult:
    """Remove what no reader or writer can still need (see the module docstring). A region whose
    manifest or WAL entry cannot be decoded is left as it is; after every other region,
    `CorruptRegionsError` (`result`: this `GcResult`) names it."""
    if grace < timedelta(0):
        raise InvalidConfigError(f"grace must not be negative, got {grace}")
    if keep_manifest_versions < 2:
        raise InvalidConfigError(f"keep_manifest_versions must be >= 2, got {keep_manifest_versions}")
    regions = table.region_ids()
    floors = removable_generations(table, regions, grace)
    storage = table.storage
    done, failed = each_region(lambda r: _region(storage, r, floors[r], keep_manifest_versions), regions)
    result = GcResult(tuple(done), tuple(lease.remove_stale(storage, layout.WRITE_LEASE_DIR, grace)))
    if failed:
        raise CorruptRegionsError("gc", failed, result)
    return result


def removable_generations(
    table: TableHandle, regions: list[uuid.UUID], grace: timedelta
) -> dict[uuid.UUID, int]:
    """Region -> highest generation GC may remove (0: none): the rules 1 of the module docstring."""
    nothing = dict.fromkeys(regions, 0)
    try:
        ds = lance.dataset(table.uri, storage_options=table.storage_options or None)
        versions = sorted(ds.versions(), key=lambda v: v["version"])
    except (ValueError, OSError):
        return nothing  # a version was cleaned up while Lance listed them: retry on the next run
    oldest = versions[0]
    # lance types a version's "timestamp" int | datetime; versions() converts every one to a datetime
    if oldest["version"] > 1 and oldest["timestamp"].timestamp() > time.time() - grace.total_seconds():  # type: ignore[union-attr]
        return nothing
    merged_per_version = []
    for v in versions:
        try:
            found = memwal_index.read_details(table.uri, table.storage_options or None, v["version"])
        except TableNotFoundError:
            return nothing  # cleaned up while we read: retry on the next run
        if found is None:
            return nothing
        details = found[0]
        merged_per_version.append(memwal_index.merged_generations(details))
    floors = {r: min(m.get(r, 0) for m in merged_per_version) for r in regions}
    catchup = memwal_index.index_catchup(details)  # the newest version's
    for name in _existing_maintained_indexes(table, details, versions[-1]["version"]):
        floors = {r: min(g, catchup.get(name, {}).get(r, 0)) for r, g in floors.items()}
    pins = consumers.pinned_floors(consumers.list_consumers(table.storage), regions, time.time())
    return {r: min(g, pins.get(r, g)) for r, g in floors.items()}


def _existing_maintained_indexes(
    table: TableHandle, details: pb.MemWalIndexDetails, version: int
) -> set[str]:
    """Names of the maintained indexes that exist on the base table at `version`."""
    _, entries = base_manifest.read_index_section(table.storage, version)
    return maintained_index_names(details, {e.name for e in entries})


def _region(storage: Storage, region_id: uuid.UUID, floor: int, keep: int) -> RegionGc:
    store = RegionManifestStore(storage, region_id)
    latest = _unlist(store, floor)
    if latest is None:
        return RegionGc(region_id, floor, (), (), (), ())
    current = {s.path for s in latest.sstables}
    ever = {s.path for m in store.history() for s in m.sstables}
    generations, orphans = [], []
    for name in storage.list_dir(layout.region_dir(region_id)):
        parsed = layout.parse_generation_dir_name(name)
        if parsed is None or name in current:
            continue
        gen = parsed[1]
        if gen <= floor:
            generations.append(gen)
        elif name not in ever and gen < latest.current_generation:
            orphans.append(layout.generation_path(region_id, name))
        else:
            continue
        storage.delete_prefix(layout.generation_path(region_id, name))
    wal = _wal_entries(storage, region_id, latest.replay_after_wal_entry_position, floor)
    versions = store.list_versions()[:-keep]
    for v in versions:
        storage.delete(store.path(v))
    return RegionGc(
        region_id, floor, tuple(sorted(generations)), tuple(sorted(orphans)), wal, tuple(versions)
    )


def _unlist(store: RegionManifestStore, floor: int) -> pb.ShardManifest | None:
    """Commit a manifest version without the generations <= `floor`; the latest manifest after it."""
    for _ in range(_COMMIT_ATTEMPTS):
        latest = store.latest()
        if latest is None or not any(s.generation <= floor for s in latest.sstables):
            return latest
        m = next_version(latest)
        del m.sstables[:]
        m.sstables.extend(s for s in latest.sstables if s.generation > floor)
        if store.commit(m):
            return m
    return store.latest()  # kept losing races to a busy writer: the next run unlists them


def _wal_entries(storage: Storage, region_id: uuid.UUID, covered: int, floor: int) -> tuple[int, ...]:
    """Delete the WAL entries of removable generations, lowest position first (rule 2)."""
    wal = Wal(storage, region_id)
    deleted = []
    for position in wal.stored_positions():
        if position > covered:
            break
        entry = wal.read(position)
        if entry is None:
            continue  # removed by a concurrent GC
        if not entry.is_sentinel and (entry.generation is None or entry.generation > floor):
            break
        storage.delete(wal.path(position))
        deleted.append(position)
    return tuple(deleted)
