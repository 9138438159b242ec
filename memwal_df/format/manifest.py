"""Region manifests: immutable, numbered versions of a region's state, committed with put-if-not-exists.

Version N lives at `_mem_wal/{region}/manifest/{bitrev64(N)}.binpb` (a `ShardManifest` protobuf,
spec name RegionManifest). After a commit, `version_hint.json` is overwritten best-effort with
`{"version":N}`. The latest version is found by reading the hint and probing forward with HEAD
requests in batches until a batch finds nothing (Lance's `manifest_scan_batch_size`, default 2).

Guarantees: two commits of the same version never both succeed (also when the store answers a PUT
ambiguously: a claim then counts as lost, any other commit as made if the version holds its bytes);
`latest()` returns a version at least as new as every commit that completed before it was called.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from google.protobuf.message import DecodeError

from memwal_df.errors import CorruptManifestError, NotFoundError, StorageError
from memwal_df.format import layout
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import EXISTED, LANDED, Storage
from memwal_df.pools import shared_pool

DEFAULT_SCAN_BATCH = 2
PARALLEL_MANIFEST_READS = 16  # threads of the pool that reads the regions' manifests of an object store
T = TypeVar("T")
_U64_MAX = (1 << 64) - 1


def read_regions(storage: Storage, ids: Sequence[uuid.UUID], read: Callable[[uuid.UUID], T]) -> list[T]:
    """`read(region)` for every region of `ids`, in order: one after another on a local directory
    (faster than a thread pool starts), in parallel on an object store."""
    if len(ids) <= 1 or isinstance(storage, LocalStorage):
        return [read(r) for r in ids]
    return list(shared_pool("manifest", PARALLEL_MANIFEST_READS).map(read, ids))


def new_manifest(region_id: uuid.UUID, spec_id: int, field_entries: dict[str, bytes]) -> pb.ShardManifest:
    """Version 1 of a fresh region, claimed by epoch 1 (Lance writes no epoch-0 manifest)."""
    m = pb.ShardManifest(version=1, writer_epoch=1, current_generation=1, shard_spec_id=spec_id)
    m.shard_id.uuid = region_id.bytes
    for field_id, value in field_entries.items():
        m.shard_field_entries.add(field_id=field_id, value=value)
    return m


def next_version(m: pb.ShardManifest) -> pb.ShardManifest:
    """A copy of `m` numbered as its successor, to be changed and committed."""
    n = pb.ShardManifest()
    n.CopyFrom(m)
    n.version = m.version + 1
    return n


def region_id_of(m: pb.ShardManifest) -> uuid.UUID:
    return uuid.UUID(bytes=m.shard_id.uuid)


class RegionManifestStore:
    """The manifest versions of one region."""

    def __init__(self, storage: Storage, region_id: uuid.UUID, scan_batch: int = DEFAULT_SCAN_BATCH) -> None:
        self.storage = storage
        self.region_id = region_id
        self.scan_batch = max(1, scan_batch)

    def path(self, version: int) -> str:
        return layout.manifest_path(self.region_id, version)

    def read(self, version: int) -> pb.ShardManifest | None:
        """Version `version`, or None if it does not exist."""
        path = self.path(version)
        try:
            data = self.storage.get(path)
        except NotFoundError:
            return None
        m = pb.ShardManifest()
        try:
            m.ParseFromString(data)
        except DecodeError as e:
            raise CorruptManifestError(f"region manifest version {version} cannot be decoded", path) from e
        if m.version != version:
            raise CorruptManifestError(f"region manifest file of version {version} says {m.version}", path)
        # Protobuf decodes a file cut at a field boundary without complaint (dropping, say, the last
        # flushed generations). The region id is written after every field but the region values, so
        # a missing or foreign id marks a torn or misplaced file.
        if m.shard_id.uuid != self.region_id.bytes:
            raise CorruptManifestError(
                f"region manifest version {version} is truncated or belongs to another region "
                f"(region id {m.shard_id.uuid.hex() or 'missing'})",
                path,
            )
        return m

    def _hint(self) -> int:
        """The version the hint names; 1 when it is missing or is not a valid u64 version (corrupt,
        `1e400`, beyond u64 ...): it is only where probing starts."""
        try:
            version = json.loads(self.storage.get(layout.version_hint_path(self.region_id)))["version"]
        except (NotFoundError, ValueError, KeyError, TypeError, IndexError):
            return 1
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= _U64_MAX:
            return 1
        return version

    def latest_version(self) -> int:
        """The newest committed version number, 0 if the region has no manifest."""
        start = self._hint()
        if start > 1 and self.storage.head(self.path(start)) is None:
            start = 1
        if self.storage.head(self.path(start)) is None:
            # Old versions may have been garbage-collected: fall back to a listing.
            return max(self.list_versions(), default=0)
        last = start
        while True:
            found = [
                v
                for v in range(last + 1, last + 1 + self.scan_batch)
                if self.storage.head(self.path(v)) is not None
            ]
            if not found:
                return last
            last = max(found)

    def latest(self) -> pb.ShardManifest | None:
        """The newest manifest, or None if the region has none."""
        while True:
            version = self.latest_version()
            if version == 0:
                return None
            m = self.read(version)
            if m is not None:
                return m
            # Deleted between the probe and the read (only GC of superseded versions does that): probe again.

    def commit(self, manifest: pb.ShardManifest) -> bool:
        """Publish `manifest` at its version; False if that version already exists."""
        if manifest.version < 1:
            raise ValueError("manifest versions start at 1")
        outcome = self.storage.create(self.path(manifest.version), manifest.SerializeToString())
        if outcome == EXISTED:
            return False
        if outcome == LANDED and self._is_claim(manifest):
            # The store did not say whether our PUT landed, and the version holds our bytes. A claim's
            # bytes do not identify the claimer (every claimer of version N+1 writes the same
            # manifest), so they may be another claimer's: taking them for ours would give two
            # writers one epoch. Report a lost race; the claimer then claims a higher epoch.
            return False
        try:
            hint = json.dumps({"version": manifest.version}, separators=(",", ":")).encode()
            self.storage.put(layout.version_hint_path(self.region_id), hint)
        except StorageError:
            pass  # the hint is best-effort; readers probe forward past a stale one
        return True

    def _is_claim(self, manifest: pb.ShardManifest) -> bool:
        """Whether `manifest` starts a new writer epoch (version 1, or an epoch its predecessor lacks).
        Other commits come from the epoch's one writer and name a fresh generation directory or a
        position only it wrote, so identical bytes are its own."""
        if manifest.version == 1:
            return True
        previous = self.read(manifest.version - 1)
        return previous is None or previous.writer_epoch != manifest.writer_epoch

    def list_versions(self) -> list[int]:
        """Every version present in storage, ascending."""
        prefix = f"{layout.region_dir(self.region_id)}/{layout.MANIFEST_DIR}"
        versions = (
            layout.parse_bitrev64_name(name)
            for name in self.storage.list_dir(prefix)
            if name.endswith(".binpb")  # not a stray `.arrow` (a WAL-style name) or other files
        )
        return sorted(v for v in versions if v is not None)

    def history(self) -> Iterator[pb.ShardManifest]:
        for v in self.list_versions():
            if (m := self.read(v)) is not None:
                yield m
