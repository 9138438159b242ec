"""Owning a region: the claim (epoch raise), replay of unflushed WAL entries, fenced manifest commits.

Guarantees: a claim commits a manifest version whose `writer_epoch` is higher than every earlier one
(a new region starts at version 1, epoch 1; losing the put-if-not-exists race reloads and tries again).
Replay rebuilds the active MemTable from every WAL entry after `replay_after_wal_entry_position`, up to
the first missing position (sentinels skipped, entries of fenced or crashed writers included); on an
existing region it then stores a fence sentinel at the first free position, so no older writer can
append after the entries replayed. A manifest commit applies its change only to a latest version that
still carries this writer's epoch; otherwise the writer is fenced (`RegionState.fence`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pyarrow as pa

from memwal_df.errors import CommitConflictError, CorruptWalEntryError
from memwal_df.format.manifest import RegionManifestStore, new_manifest, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.wal import Wal, encode_fence_sentinel
from memwal_df.write.region_state import RegionState

ManifestChange = Callable[[pb.ShardManifest], bool | None]
"""Changes a new manifest version in place; returns False when there is nothing to change."""


def claim(
    store: RegionManifestStore,
    region_id: uuid.UUID,
    spec_id: int,
    field_entries: dict[str, bytes],
    expect_version: int | None = None,
) -> tuple[pb.ShardManifest, bool]:
    """Commit a manifest version with a raised epoch; the manifest and whether the region is new.
    With `expect_version` (a recovery) only the version after that one: `CommitConflictError` when
    the latest version is another one, or another claimer commits that version first."""
    while True:
        latest = store.latest()
        if expect_version is not None and (latest is None or latest.version != expect_version):
            raise CommitConflictError(
                f"region {region_id} moved on from manifest version {expect_version}: it has a writer"
            )
        if latest is None:
            m = new_manifest(region_id, spec_id, field_entries)
        else:
            m = next_version(latest)
            m.writer_epoch = latest.writer_epoch + 1
        if store.commit(m):
            return m, latest is None


def replay(state: RegionState, wal: Wal, store: RegionManifestStore, fresh: bool) -> None:
    """Rebuild the active MemTable from the WAL, then fence older writers with a sentinel (existing
    regions) and record its position in the manifest. Runs before the writer's threads start."""
    position = state.next_position
    while True:
        entry = wal.read(position)
        if entry is None:
            if fresh or wal.append(position, encode_fence_sentinel(state.epoch)):
                break
            continue  # an older writer took the position first: replay that entry too
        if entry.writer_epoch > state.epoch:
            raise state.fence(f"WAL entry {position} has epoch {entry.writer_epoch} > ours {state.epoch}")
        for batch in entry.batches:
            state.active.append(conform_replayed(state.active.schema, wal, batch, position))
        position += 1
    if fresh:
        state.next_position = position
        state.active.last_wal_position = position - 1
        return
    state.active.last_wal_position = position  # the sentinel needs no replay either
    state.next_position = position + 1
    commit(state, store, lambda m: _set_last_seen(m, position))


def conform_replayed(schema: pa.Schema, wal: Wal, batch: pa.RecordBatch, position: int) -> pa.RecordBatch:
    """`batch` of the WAL entry at `position` cast to the MemTable `schema`; `CorruptWalEntryError`
    naming the entry's file when it does not match."""
    try:
        return batch.replace_schema_metadata(None).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError) as e:
        raise CorruptWalEntryError(
            f"WAL entry {position} does not match the table schema ({e})", wal.path(position)
        ) from e


def commit(state: RegionState, store: RegionManifestStore, change: ManifestChange) -> None:
    """Apply `change` to the latest manifest and commit it, if the epoch is still ours; raises
    `WriterFencedError` (and fences the writer) otherwise."""
    while True:
        latest = store.latest()
        assert latest is not None
        if latest.writer_epoch != state.epoch:
            raise state.fence(f"the region manifest has epoch {latest.writer_epoch}, ours is {state.epoch}")
        m = next_version(latest)
        if change(m) is False:  # nothing to change: an earlier attempt of ours made this commit
            with state.cond:
                state.manifest = latest
            return
        if store.commit(m):
            with state.cond:
                state.manifest = m
            return


def _set_last_seen(m: pb.ShardManifest, position: int) -> None:
    m.wal_entry_position_last_seen = max(m.wal_entry_position_last_seen, position)
