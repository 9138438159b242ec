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
and, outside the regions:
5. the region leases of Spark write jobs whose driver died before it removed them
   (`_mem_wal/_write_leases/{job}`, `memwal_df.spark.staging`): a job's directory goes once none of
   its leases expired less than `grace` ago;
6. the commit records of stopped Spark streaming queries (`_mem_wal/_streams/{query}`,
   `memwal_df.format.stream_commits`): all of a query's records go once its newest one is older than
   `stream_commit_retention` (default 7 days). A query restarted after that may apply again the one
   batch its driver committed to the table but not to its checkpoint (see that module);
7. change-feed consumer records that stopped pinning more than `consumer_retention` ago (default
   30 days after their expiry; `memwal_df.format.consumers.remove_stale`);
8. on local storage, temp files of writes a crash interrupted (`{name}.tmp.{uuid}`, hidden from
   listings) in the directories memwal_df writes single files to (region manifests, WAL, consumers,
   stream commits, leases), once older than `grace` and at least `TEMP_FILE_MIN_AGE`, so that a write
   in flight keeps its file. Object stores leave none: memwal_df's own puts are single requests.
Readers skip garbage-collected generation directories; see `docs/background-jobs.md`. Before it
removes anything, GC makes the base table's files durable (on local storage: every file and directory
outside `_mem_wal/`), so no power loss can take back a base version that absorbed what it removes.

**Cost per run.** What a run reads is bounded by what it keeps, not by how long the table ran: one
listing of the base table's `_versions/`, and base manifests, WAL entries and region manifest versions
read once per `TableHandle` (they never change; `_Memo`), so a maintain loop reads only those new
since its previous run; listings of each region's directories, and of the lease, stream and consumer
directories, which GC itself keeps small.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import lance

from memwal_df.errors import CorruptRegionsError, InvalidConfigError, TableNotFoundError
from memwal_df.format import base_manifest, consumers, layout, lease, memwal_index, stream_commits
from memwal_df.format.local_storage import LocalStorage
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
DEFAULT_STREAM_COMMIT_RETENTION = stream_commits.DEFAULT_RETENTION  # 7 days
DEFAULT_CONSUMER_RETENTION = consumers.DEFAULT_RECORD_RETENTION  # 30 days after a consumer's expiry
TEMP_FILE_MIN_AGE = timedelta(hours=1)  # a temp file younger than this may be a write in flight
_COMMIT_ATTEMPTS = 20
_MANIFEST_NAME = re.compile(r"(\d+)\.manifest")  # `_versions/` names (`base_manifest.manifest_path`)
_U64_MAX = (1 << 64) - 1
_DETACHED = 1 << 63  # Lance's detached versions: not on the version history


@dataclass
class _Memo:
    """What a GC run read that never changes, kept for the next runs on the same `TableHandle`:
    per base version its merged generations (None: no MemWAL index) and commit time, per WAL entry
    (region, position) whether it is a fence sentinel and its generation, per region manifest
    version (region, version) the generation directories it lists. Trimmed every run to what is
    still stored."""

    merged: dict[int, dict[uuid.UUID, int] | None] = field(default_factory=dict)
    committed_at: dict[int, float] = field(default_factory=dict)
    wal: dict[tuple[uuid.UUID, int], tuple[bool, int | None]] = field(default_factory=dict)
    listed: dict[tuple[uuid.UUID, int], frozenset[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one run at a time per handle


_MEMOS: weakref.WeakKeyDictionary[TableHandle, _Memo] = weakref.WeakKeyDictionary()
_MEMOS_LOCK = threading.Lock()


def _memo(table: TableHandle) -> _Memo:
    with _MEMOS_LOCK:
        memo = _MEMOS.get(table)
        if memo is None:
            memo = _MEMOS[table] = _Memo()
        return memo


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
    stream_queries: tuple[str, ...] = ()  # stopped streaming queries whose commit records were deleted
    consumers: tuple[str, ...] = ()  # change-feed consumers whose stale records were deleted
    temp_files: tuple[str, ...] = ()  # temp files of interrupted writes deleted (local storage)

    @property
    def generations(self) -> dict[uuid.UUID, tuple[int, ...]]:
        """Region -> the merged generations this call removed (regions with none left out)."""
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
    stream_commit_retention: timedelta = DEFAULT_STREAM_COMMIT_RETENTION,
    consumer_retention: timedelta = DEFAULT_CONSUMER_RETENTION,
) -> GcResult:
    """Remove what no reader or writer can still need (see the module docstring). A region whose
    manifest or WAL entry cannot be decoded is left as it is; after every other region,
    `CorruptRegionsError` (`result`: this `GcResult`) names it."""
    if grace < timedelta(0):
        raise InvalidConfigError(f"grace must not be negative, got {grace}")
    if keep_manifest_versions < 2:
        raise InvalidConfigError(f"keep_manifest_versions must be >= 2, got {keep_manifest_versions}")
    for name, value in (
        ("stream_commit_retention", stream_commit_retention),
        ("consumer_retention", consumer_retention),
    ):
        if value < timedelta(0):
            raise InvalidConfigError(f"{name} must not be negative, got {value}")
    memo = _memo(table)
    with memo.lock:
        regions = table.region_ids()
        storage = table.storage
        found = consumers.list_consumers(storage)
        floors = removable_generations(table, regions, grace, found, memo)
        # The base versions that absorbed what goes now are durable before it goes (Lance does not
        # fsync; another process's commit may not have synced yet).
        storage.sync_tree("", skip=layout.NOT_BASE)
        done, failed = each_region(
            lambda r: _region(storage, r, floors[r], keep_manifest_versions, memo), regions
        )
        now = time.time()
        result = GcResult(
            tuple(done),
            tuple(lease.remove_stale(storage, layout.WRITE_LEASE_DIR, grace)),
            tuple(stream_commits.remove_stopped(storage, stream_commit_retention, now)),
            tuple(consumers.remove_stale(storage, found, consumer_retention, now)),
            tuple(_temp_files(storage, regions, max(grace, TEMP_FILE_MIN_AGE), now)),
        )
    if failed:
        raise CorruptRegionsError("gc", failed, result)
    return result


def removable_generations(
    table: TableHandle,
    regions: list[uuid.UUID],
    grace: timedelta,
    found: list[consumers.Consumer] | None = None,
    memo: _Memo | None = None,
) -> dict[uuid.UUID, int]:
    """Region -> highest generation GC may remove (0: none): the rules 1 of the module docstring.
    `found`: the consumer records (None: read them); `memo`: what earlier runs read."""
    nothing = dict.fromkeys(regions, 0)
    memo = memo or _Memo()
    versions = _retained_versions(table.storage)
    memo.merged = {v: m for v, m in memo.merged.items() if v in versions}
    memo.committed_at = {v: t for v, t in memo.committed_at.items() if v in versions}
    if not versions:
        return nothing
    oldest = versions[0]
    if oldest > 1:
        committed_at = memo.committed_at.get(oldest)
        if committed_at is None:
            try:
                ds = lance.dataset(table.uri, version=oldest, storage_options=table.storage_options or None)
                # lance types a version's "timestamp" int | datetime; it converts every one to a datetime
                committed_at = ds.get_version()["timestamp"].timestamp()  # type: ignore[union-attr]
            except (ValueError, OSError):
                return nothing  # cleaned up since the listing: retry on the next run
            memo.committed_at[oldest] = committed_at
        if committed_at > time.time() - grace.total_seconds():
            return nothing
    merged_per_version = []
    for v in versions:
        if v not in memo.merged:
            try:
                found_details = memwal_index.read_details(table.uri, table.storage_options or None, v)
            except TableNotFoundError:
                return nothing  # cleaned up while we read: retry on the next run
            memo.merged[v] = (
                None if found_details is None else memwal_index.merged_generations(found_details[0])
            )
        merged = memo.merged[v]
        if merged is None:
            return nothing
        merged_per_version.append(merged)
    floors = {r: min(m.get(r, 0) for m in merged_per_version) for r in regions}
    latest = memwal_index.read_details(table.uri, table.storage_options or None, versions[-1])
    if latest is None:
        return nothing
    details = latest[0]
    catchup = memwal_index.index_catchup(details)
    for name in _existing_maintained_indexes(table, details, versions[-1]):
        floors = {r: min(g, catchup.get(name, {}).get(r, 0)) for r, g in floors.items()}
    if found is None:
        found = consumers.list_consumers(table.storage)
    pins = consumers.pinned_floors(found, regions, time.time())
    return {r: min(g, pins.get(r, g)) for r, g in floors.items()}


def _retained_versions(storage: Storage) -> list[int]:
    """The base table's versions on its history (what `cleanup_old_versions` has not removed),
    ascending: one listing of `_versions/`."""
    found = set()
    for name in storage.list_dir(base_manifest.VERSIONS_DIR):
        m = _MANIFEST_NAME.fullmatch(name)
        if m is None:
            continue
        digits = m.group(1)
        version = _U64_MAX - int(digits) if len(digits) == 20 else int(digits)  # v2 : v1 naming
        if 0 <= version and not version & _DETACHED:
            found.add(version)
    return sorted(found)


def _existing_maintained_indexes(
    table: TableHandle, details: pb.MemWalIndexDetails, version: int
) -> set[str]:
    """Names of the maintained indexes that exist on the base table at `version`."""
    _, entries = base_manifest.read_index_section(table.storage, version)
    return maintained_index_names(details, {e.name for e in entries})


def _region(storage: Storage, region_id: uuid.UUID, floor: int, keep: int, memo: _Memo) -> RegionGc:
    store = RegionManifestStore(storage, region_id)
    latest = _unlist(store, floor)
    if latest is None:
        return RegionGc(region_id, floor, (), (), (), ())
    current = {s.path for s in latest.sstables}
    ever = set().union(*(_listed(store, v, memo) for v in store.list_versions()))
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
    wal = _wal_entries(storage, region_id, latest.replay_after_wal_entry_position, floor, memo)
    stored = store.list_versions()
    versions = stored[:-keep]
    for v in versions:
        storage.delete(store.path(v))
    kept = set(stored[-keep:])
    for key in [k for k in memo.listed if k[0] == region_id and k[1] not in kept]:
        del memo.listed[key]
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


def _listed(store: RegionManifestStore, version: int, memo: _Memo) -> frozenset[str]:
    """The generation directories manifest `version` lists (none if it is gone)."""
    key = (store.region_id, version)
    listed = memo.listed.get(key)
    if listed is None:
        m = store.read(version)
        if m is None:
            return frozenset()  # trimmed by a concurrent GC
        listed = memo.listed[key] = frozenset(s.path for s in m.sstables)
    return listed


def _wal_entries(
    storage: Storage, region_id: uuid.UUID, covered: int, floor: int, memo: _Memo
) -> tuple[int, ...]:
    """Delete the WAL entries of removable generations, lowest position first (rule 2)."""
    wal = Wal(storage, region_id)
    deleted = []
    stored = wal.stored_positions()
    alive = set(stored)
    for key in [k for k in memo.wal if k[0] == region_id and k[1] not in alive]:
        del memo.wal[key]  # removed by another GC
    for position in stored:
        if position > covered:
            break
        key = (region_id, position)
        known = memo.wal.get(key)
        if known is None:
            entry = wal.read(position)
            if entry is None:
                continue  # removed by a concurrent GC
            known = memo.wal[key] = (entry.is_sentinel, entry.generation)
        sentinel, generation = known
        if not sentinel and (generation is None or generation > floor):
            break
        storage.delete(wal.path(position))
        memo.wal.pop(key, None)
        deleted.append(position)
    return tuple(deleted)


def _temp_files(storage: Storage, regions: list[uuid.UUID], min_age: timedelta, now: float) -> list[str]:
    """Delete temp files older than `min_age` of interrupted writes (rule 8); their paths."""
    if not isinstance(storage, LocalStorage):
        return []
    directories = [layout.CONSUMER_DIR, layout.ENTRY_LEASE_DIR]
    for r in regions:
        directories += [
            f"{layout.region_dir(r)}/{layout.MANIFEST_DIR}",
            f"{layout.region_dir(r)}/{layout.WAL_DIR}",
            layout.writer_lease_dir(r),
        ]
    directories += [layout.stream_dir(q) for q in stream_commits.queries(storage)]
    for group in storage.list_dir(layout.WRITE_LEASE_DIR):
        directories += [
            f"{layout.WRITE_LEASE_DIR}/{group}/{d}"
            for d in storage.list_dir(f"{layout.WRITE_LEASE_DIR}/{group}")
        ]
    removed = []
    for directory in directories:
        for path, modified in storage.temp_files(directory):
            if modified < now - min_age.total_seconds():
                storage.delete(path)
                removed.append(path)
    return removed
