"""The MemWAL index builder (spec "MemWAL Index Builder"): region snapshots for `consistency="snapshot"`.

`build_index(table)`:
1. pins the base version and its MemWAL index details (configuration, merge progress, catch-up);
2. lists the regions under `_mem_wal/` and, per region (in parallel on object stores), loads the
   latest manifest, probes the WAL past `wal_entry_position_last_seen` and, if the WAL is further
   along, commits a manifest version with the position seen (best effort: a lost race or a storage
   error leaves the hint as it was; a writer that loses the race to this commit retries on top of it);
3. encodes one snapshot row per region (`region_snapshot`): inline in `inline_snapshots` for at most
   `INLINE_THRESHOLD` regions, else `_indices/{uuid}/index.lance` (created with put-if-not-exists);
4. commits the details with only the snapshot fields changed through `memwal_index.replace_details`,
   which three-way merges anything committed since the pinned version: concurrent merge progress,
   index catch-up and configuration are kept, never lowered.

A region whose manifest cannot be decoded keeps the state the previous snapshot holds for it (if
any); after the commit, `CorruptRegionsError` names it.

Two builders committing at the same time conflict: the later one raises `CommitConflictError`.
Snapshot files of earlier builds are not deleted here; that is garbage collection's job (Lance's
`cleanup_old_versions` also removes them once no retained version's entry names their directory).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memwal_df.errors import CorruptRegionsError, StorageError
from memwal_df.format import memwal_index, region_snapshot
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.manifest import RegionManifestStore, next_version, region_id_of
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal
from memwal_df.jobs.repair import each_region

if TYPE_CHECKING:
    import uuid
    from collections.abc import Iterable

    from memwal_df.format.table_handle import TableHandle

_PARALLEL_REGION_READS = 16


@dataclass(frozen=True)
class BuildResult:
    """What one `build_index` committed."""

    version: int  # base table version holding the new snapshot
    snapshot_ts_millis: int
    regions: int
    generations: int  # flushed generations listed over all regions
    snapshot_bytes: int  # size of the snapshot's Lance file
    location: str  # "inline" or the external file's path relative to the table root
    last_seen_advanced: int  # regions whose wal_entry_position_last_seen this build advanced


def build_index(table: TableHandle, inline_threshold: int = region_snapshot.INLINE_THRESHOLD) -> BuildResult:
    """Snapshot every region's state into the MemWAL index; see the module docstring."""
    table.refresh()
    read_version = table.dataset.version
    details = table.details
    storage = table.storage
    ids = table.region_ids()
    if len(ids) <= 1 or isinstance(storage, LocalStorage):
        states, failed = each_region(lambda r: _region_state(storage, r), ids)
    else:
        with ThreadPoolExecutor(_PARALLEL_REGION_READS, thread_name_prefix="memwal-index-builder") as pool:
            states, failed = each_region(lambda r: _region_state(storage, r), ids, pool.map)
    manifests = [m for m, _ in states if m is not None] + _previous_states(table, failed)
    data = region_snapshot.encode(manifests, table.specs)

    new = pb.MemWalIndexDetails()
    new.CopyFrom(details)
    ts = max(int(time.time() * 1000), details.snapshot_ts_millis + 1)
    if len(manifests) <= inline_threshold:
        new.inline_snapshots = data
        location = "inline"
    else:
        new.ClearField("inline_snapshots")
        while not storage.put_if_not_exists(region_snapshot.external_path(ts), data):
            ts += 1  # another build took this millisecond: each snapshot file is written once
        location = region_snapshot.external_path(ts)
    new.snapshot_ts_millis = ts
    version = memwal_index.replace_details(table.uri, new, read_version, table.storage_options or None)
    table.refresh()
    result = BuildResult(
        version=version,
        snapshot_ts_millis=ts,
        regions=len(manifests),
        generations=sum(len(m.sstables) for m in manifests),
        snapshot_bytes=len(data),
        location=location,
        last_seen_advanced=sum(advanced for _, advanced in states),
    )
    if failed:
        raise CorruptRegionsError("build-index", failed, result)
    return result


def _previous_states(table: TableHandle, regions: Iterable[uuid.UUID]) -> list[pb.ShardManifest]:
    """The states the current snapshot holds for `regions` (whose manifests cannot be read now):
    kept as they were, so a snapshot reader sees those regions no less than before."""
    wanted = set(regions)
    if not wanted:
        return []
    previous = region_snapshot.load(table.storage, table.details, table.specs) or []
    return [m for m in previous if region_id_of(m) in wanted]


def _region_state(storage: Storage, region_id: uuid.UUID) -> tuple[pb.ShardManifest | None, bool]:
    """(latest manifest, whether this call advanced its `wal_entry_position_last_seen`)."""
    store = RegionManifestStore(storage, region_id)
    m = store.latest()
    if m is None:
        return None, False
    try:
        seen = m.wal_entry_position_last_seen
        last = Wal(storage, region_id).last_position(max(seen, m.replay_after_wal_entry_position) + 1)
        if last <= seen:
            return m, False
        update = next_version(m)
        update.wal_entry_position_last_seen = last
        if store.commit(update):
            return update, True
    except StorageError:
        pass  # the hint is best effort
    return m, False
