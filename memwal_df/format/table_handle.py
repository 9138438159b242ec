"""The table handle: what a MemWAL table is on storage, as every writer, reader and job reads it.

A `TableHandle` holds the Lance base dataset at the version it last opened, the `__lance_mem_wal`
index entry of that version (region specs, writer defaults, merge progress), the table schema with
its primary key and Lance field ids, and the regions under `_mem_wal/` with their region values.
It knows nothing of writers, readers or jobs; the user-facing `memwal_df.table.Table` extends it.

Region ids of spec-governed regions are derived from the spec id and the region values (a UUID v4
layout over a SHA-256 digest), so every writer of a value meets in the same region.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from typing import Any

import lance

from memwal_df.errors import NonKeyRegionColumnError, RegionRoutingError, StorageError, TableNotFoundError
from memwal_df.format import base_manifest, layout, memwal_index
from memwal_df.format.maintained_indexes import MaintainedIndex, resolve_maintained_indexes
from memwal_df.format.manifest import region_id_of
from memwal_df.format.open_storage import open_storage
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec, lance_field_ids, non_key_columns, non_key_message
from memwal_df.format.regions.values import (
    decode_region_value,
    encode_non_null_region_value,
    result_arrow_type,
)
from memwal_df.format.schema import TableSchema
from memwal_df.format.storage import Storage

# Capacities of the Lance caches a handle keeps for the life of the process (one per handle). The
# index cache holds what queries load of base indexes (IVF centroids and PQ codes, B-tree pages,
# inverted lists), the metadata cache manifests, fragment and deletion metadata.
INDEX_CACHE_BYTES = 512 * 2**20
METADATA_CACHE_BYTES = 128 * 2**20
# A handle starts a fresh session (its caches empty) once more index segments it has seen were
# replaced than are live, and at least this many.
RETIRED_SEGMENTS = 8


def _new_session() -> Any:
    """A Lance session (index and metadata caches) of the capacities above; lance leaves `Session`
    out of its `__all__`."""
    return lance.Session(  # type: ignore[attr-defined]
        index_cache_size_bytes=INDEX_CACHE_BYTES, metadata_cache_size_bytes=METADATA_CACHE_BYTES
    )


class TableHandle:
    """An open MemWAL table on storage. Cheap to create; `refresh()` re-reads the base table and
    MemWAL index."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.storage: Storage = open_storage(uri, storage_options)
        self.uri = self.storage.uri
        self.storage_options = dict(storage_options or {})
        # Lance's index/metadata caches, kept across refreshes (see `_cached_segments`)
        self._session = _new_session()
        self._cached_segments: set[str] = set()
        self._region_keys: dict[uuid.UUID, tuple[int, tuple[Any, ...] | None]] = {}
        self._maintained: tuple[int, tuple[MaintainedIndex, ...]] = (-1, ())
        self.refresh()

    def refresh(self) -> None:
        """Open the base table's latest version and its MemWAL index entry; `TableNotFoundError`
        when the URI holds no Lance table or one without a MemWAL index."""
        try:
            ds = lance.dataset(self.uri, storage_options=self.storage_options or None, session=self._session)
        except (ValueError, OSError) as e:
            raise TableNotFoundError(f"no Lance table at {self.uri}") from e
        ds = self._retire_cached(ds)
        found = memwal_index.read_details(self.uri, self.storage_options or None, version=ds.version)
        if found is None:
            raise TableNotFoundError(
                f"the Lance table at {self.uri} has no MemWAL index ({memwal_index.MEMWAL_INDEX_NAME})"
            )
        self.dataset = ds
        self._opened_version = ds.version
        self.details = found[0]
        pk = base_manifest.primary_key(ds.schema)
        self.schema = TableSchema(ds.schema, tuple(pk), lance_field_ids(ds))
        specs = sorted(self.details.sharding_specs, key=lambda s: s.spec_id)
        self.spec = RegionSpec.from_proto(specs[-1]) if specs else None
        self._specs = {s.spec_id: RegionSpec.from_proto(s) for s in specs}
        self.data_storage_version = ds.data_storage_version

    def _retire_cached(self, ds: lance.LanceDataset) -> lance.LanceDataset:
        """`ds`, opened in a fresh session when the current one has cached more retired index
        segments than live ones (and at least `RETIRED_SEGMENTS`): every round of jobs replaces
        segments (catch-up deltas, consolidation, compaction's remap) and Lance's caches evict only
        when full, so a handle kept for days would otherwise grow up to their capacities."""
        live = {str(s.uuid) for d in ds.describe_indices() for s in d.segments}
        self._cached_segments |= live
        if len(self._cached_segments - live) <= max(RETIRED_SEGMENTS, len(live)):
            return ds
        self._session = _new_session()
        self._cached_segments = live
        return lance.dataset(
            self.uri, version=ds.version, storage_options=self.storage_options or None, session=self._session
        )

    def sync(self) -> None:
        """`refresh()` unless the open version is still the base table's latest (a Lance version
        never changes once written, so an unchanged number means unchanged state), or if a commit
        through `self.dataset` itself (e.g. its `delete`) moved that object to another version in
        place: readers keep per-object state (key maps, open fragment sessions) that holds for the
        version the object was opened at, so a moved object is replaced by a new one."""
        if self.dataset.version != self._opened_version or not self.is_latest(self.dataset.version):
            self.refresh()

    def is_latest(self, version: int) -> bool:
        """Whether `version` is the base table's latest version, as Lance resolves the latest version
        to open a table: one listing of `_versions/` (on object stores its first page, where V2
        names sort newest first; locally one directory read). Never inferred from a missing
        version + 1: version cleanup deletes old versions while newer ones exist. Raises
        `StorageError` when the versions cannot be listed."""
        try:
            latest = self.dataset.latest_version
        except (OSError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StorageError(f"cannot find the latest version of the table at {self.uri}: {first}") from e
        return latest == version

    def maintained_indexes(self) -> tuple[MaintainedIndex, ...]:
        """The maintained indexes resolved against the latest base version (once per version)."""
        self.sync()
        version, indexes = self._maintained
        if version != self.dataset.version:
            indexes = resolve_maintained_indexes(self.details, self.dataset, self.storage)
            self._maintained = (self.dataset.version, indexes)
        return indexes

    @property
    def specs(self) -> dict[int, RegionSpec]:
        """Every region spec of the table by spec id (regions keep the spec they were created under)."""
        return dict(self._specs)

    def require_spec(self) -> RegionSpec:
        """The current region spec; `RegionRoutingError` for a table without one."""
        if self.spec is None:
            raise RegionRoutingError("the table has no region spec; regions are created manually")
        return self.spec

    def spec_text(self) -> str:
        """The current region spec over column names, e.g. `bucket[4](id)`; `none` without one."""
        if self.spec is None:
            return "none"
        names = self.schema.names_by_id
        return " + ".join(
            f"{f.transform}({', '.join(names.get(i, f'#{i}') for i in f.source_ids)})"
            for f in self.spec.fields
        )

    def non_key_region_columns(self) -> list[str]:
        """The columns the current region spec reads that are not primary-key columns (none for a
        table memwal_df created, and for a table without a primary key or region spec)."""
        if self.spec is None or not self.schema.primary_key:
            return []
        return non_key_columns(self.spec, self.schema.primary_key, self.schema.field_ids)

    def check_writable(self, allow_non_key_region_columns: bool = False) -> None:
        """`NonKeyRegionColumnError` if the region spec reads columns outside the primary key and the
        caller did not opt in with `allow_non_key_region_columns`."""
        outside = self.non_key_region_columns()
        if outside and not allow_non_key_region_columns:
            raise NonKeyRegionColumnError(
                non_key_message(outside, self.schema.primary_key)
                + ". This table's spec was made elsewhere; to write to it anyway, pass "
                "allow_non_key_region_columns=True and never change those columns of an existing key"
            )

    # ------------------------------------------------------------------ regions

    def region_id_for(self, values: tuple[Any, ...]) -> uuid.UUID:
        """The id of the region holding rows whose region values are `values` under the current spec."""
        spec = self.require_spec()
        digest = hashlib.sha256(b"memwal_df.region\x00" + spec.spec_id.to_bytes(4, "little"))
        for f, v in zip(spec.fields, values, strict=True):
            digest.update(f.field_id.encode() + b"\x00")
            digest.update(
                b"\x00"
                if v is None
                else b"\x01" + encode_non_null_region_value(v, result_arrow_type(f.result_type))
            )
        return uuid.UUID(bytes=digest.digest()[:16], version=4)

    def region_ids(self) -> list[uuid.UUID]:
        """Every region that has a directory under `_mem_wal/`."""
        ids = (_region_uuid(name) for name in self.storage.list_dir(layout.MEM_WAL_DIR))
        return sorted(i for i in ids if i is not None)

    def region_values(self, m: pb.ShardManifest) -> tuple[Any, ...] | None:
        """A region's values under its spec, from its manifest's field entries (None if unknown)."""
        spec = self._specs.get(m.shard_spec_id)
        if spec is None or not m.shard_field_entries:
            values = None
        else:
            entries = {e.field_id: e.value for e in m.shard_field_entries}
            values = tuple(
                decode_region_value(entries[f.field_id], result_arrow_type(f.result_type))
                if f.field_id in entries
                else None
                for f in spec.fields
            )
        if spec is not None or not m.shard_field_entries:  # final: a region's entries never change
            self._region_keys[region_id_of(m)] = (m.shard_spec_id, values)
        return values

    def known_region(self, region_id: uuid.UUID) -> tuple[int, tuple[Any, ...] | None] | None:
        """(spec id, values) of a region whose manifest `region_values` decoded before, else None.
        A region keeps the spec and values it was created with, so the answer never goes stale."""
        return self._region_keys.get(region_id)


@functools.lru_cache(maxsize=1 << 14)
def _region_uuid(name: str) -> uuid.UUID | None:
    """The region id a `_mem_wal/` directory name stands for (None: not a region directory)."""
    try:
        return uuid.UUID(name)
    except ValueError:
        return None
