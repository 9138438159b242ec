"""Recovering regions whose writer is gone: the maintain loop's `recover` job.

A region whose WAL holds entries no flushed generation covers has acknowledged writes that readers of
the flushed levels do not see yet. If its writer lease (`memwal_df.write.writer_lease`) expired or was
released, no writer is renewing it: the job replays the WAL into a generation, as `Table.recover()`
and a claiming writer do, so the writes become visible without a manual step. Per region:

1. read the latest region manifest (version `v`) and check that its WAL has data after
   `replay_after_wal_entry_position`; then read the writer lease: none (no memwal_df writer ever
   leased the region: Lance's writers keep no lease) or an active one means skip;
2. take the lease epoch after the expired one (`take_expired`): if another holder created it first, a
   writer came back or started, skip;
3. claim the region only as manifest version `v + 1` (`RecoveryClaim`): a writer that claimed the
   region, or committed anything, since step 1 makes this claim lose (`CommitConflictError`, skip), so
   a writer that is live is never fenced by a recovery that raced it. Then replay, flush, close.

A writer that took its lease after step 1 claims after it too, so its claim either comes first (the
recovery's loses) or fences the recovery writer (whose flush then raises `WriterFencedError`: skipped,
the new writer replays the same entries). The only writer a recovery fences is one that stopped
renewing for longer than its lease's TTL (a hung or partitioned process): it learns it at its next
WAL append or manifest commit (`WriterFencedError`), as when any new writer claims its region.
Regions whose manifest or WAL entry cannot be decoded are reported and skipped (`CorruptRegionsError`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    CorruptRegionsError,
    CorruptWalEntryError,
    WriterFencedError,
)
from memwal_df.format.lease import now_ms
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal
from memwal_df.write import writer_lease
from memwal_df.write.region_open import region_context
from memwal_df.write.region_writer import RegionWriter
from memwal_df.write.writer_config import WriterConfig
from memwal_df.write.writer_lease import RecoveryClaim

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryResult:
    """What a `recover_abandoned` run did: the regions it replayed and flushed, those with unflushed
    WAL entries and a live writer (left alone), and those whose writer keeps no lease (Lance's own
    writer, or one that never took a lease: `memwal recover` replays them)."""

    recovered: tuple[uuid.UUID, ...] = ()
    live: tuple[uuid.UUID, ...] = ()
    unleased: tuple[uuid.UUID, ...] = ()

    @property
    def regions(self) -> int:
        return len(self.recovered)


def recover_abandoned(table: TableHandle, config: WriterConfig | None = None) -> RecoveryResult:
    """Replay and flush every region with unflushed WAL entries whose writer lease expired or was
    released (see the module docstring); `config` for the recovering writers (the table's writer
    defaults when None). Raises `CorruptRegionsError` (with the result) after the other regions
    when some region's manifest or WAL entry cannot be decoded."""
    if config is None:
        config = WriterConfig.from_defaults(dict(table.details.writer_config_defaults))
    found: dict[str, list[uuid.UUID]] = {"recovered": [], "live": [], "unleased": [], "clean": []}
    failed: dict[uuid.UUID, CorruptManifestError | CorruptWalEntryError] = {}
    for region_id in table.region_ids():
        try:
            found[_recover_region(table, region_id, config)].append(region_id)
        except (CorruptManifestError, CorruptWalEntryError) as e:
            failed[region_id] = e
    result = RecoveryResult(tuple(found["recovered"]), tuple(found["live"]), tuple(found["unleased"]))
    if failed:
        raise CorruptRegionsError("recover", failed, result)
    return result


def unflushed(storage: Storage, region_id: uuid.UUID) -> pb.ShardManifest | None:
    """The region's latest manifest when its WAL holds entries after the manifest's replay position
    (acknowledged writes no flushed generation covers); None when there is nothing to replay."""
    m = RegionManifestStore(storage, region_id).latest()
    if m is None or not Wal(storage, region_id).has_data_after(m.replay_after_wal_entry_position):
        return None
    return m


def _recover_region(table: TableHandle, region_id: uuid.UUID, config: WriterConfig) -> str:
    """`recovered`, `live`, `unleased` or `clean` (nothing to replay)."""
    storage = table.storage
    m = unflushed(storage, region_id)
    if m is None:
        return "clean"
    cur = writer_lease.current(storage, region_id)
    if cur is None:
        return "unleased"
    if cur.active(now_ms()):
        return "live"
    ttl = timedelta(seconds=config.lease_ttl_s)
    mine = writer_lease.take_expired(storage, region_id, cur, ttl)
    if mine is None:
        return "live"
    ctx = region_context(table, region_id, m)
    try:
        writer = RegionWriter(ctx, region_id, config, recovery=RecoveryClaim(m.version, mine))
    except CommitConflictError:  # (the writer released the lease it was given)
        log.info("region %s has a writer again: not recovered", region_id)
        return "live"
    try:
        writer.close()
    except WriterFencedError:
        log.info("a writer claimed region %s while it was recovered: it replays the WAL itself", region_id)
        return "live"
    log.info("recovered region %s (its writer's lease expired %s)", region_id, cur.expires_ms)
    return "recovered"
