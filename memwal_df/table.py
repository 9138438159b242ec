"""A MemWAL table: a Lance base table, its MemWAL index and the regions under `_mem_wal/`.

`create_table` writes the base table (primary key marked as Lance's unenforced primary key) and the
`__lance_mem_wal` index entry exactly as Lance's `initialize_mem_wal` does; `open_table` opens tables
made by either. Region ids of spec-governed regions are derived from the spec id and the region values
(a UUID v4 layout over a SHA-256 digest), so every writer of a value meets in the same region.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from memwal_df.errors import (
    CorruptManifestError,
    CorruptRegionsError,
    CorruptWalEntryError,
    InvalidArgumentError,
    InvalidConfigError,
    NonKeyRegionColumnError,
    NotFoundError,
    RegionRoutingError,
    SchemaMismatchError,
    StorageError,
    TableExistsError,
    TableNotFoundError,
    UnknownRegionError,
)
from memwal_df.format import base_manifest, layout, memwal_index
from memwal_df.format.maintained_indexes import MaintainedIndex, maintained_indexes
from memwal_df.format.manifest import RegionManifestStore, region_id_of
from memwal_df.format.open_storage import open_storage
from memwal_df.format.pk_index import is_supported_pk_type
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.region_spec import (
    RegionSpec,
    UnboundRegionSpec,
    decode_region_value,
    encode_region_value,
    lance_field_ids,
    non_key_columns,
    non_key_message,
    result_arrow_type,
)
from memwal_df.format.schema import TableSchema, check_keys, conform, to_table
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal
from memwal_df.jobs import garbage as _gc
from memwal_df.jobs import index_builder, index_catchup, merger
from memwal_df.jobs import maintain as _maintain
from memwal_df.jobs import repair as _repair
from memwal_df.write.region_writer import RegionContext, RegionWriter, WriterConfig
from memwal_df.write.table_writer import TableWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegionStatus:
    """One region as its latest manifest describes it."""

    region_id: uuid.UUID
    spec_id: int
    values: tuple[Any, ...] | None
    manifest_version: int
    writer_epoch: int
    replay_after_wal_entry_position: int
    wal_entry_position_last_seen: int
    current_generation: int
    flushed_generations: tuple[tuple[int, str], ...]
    merged_generation: int


class Table:
    """An open MemWAL table. Cheap to create; `refresh()` re-reads the base table and MemWAL index."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.storage: Storage = open_storage(uri, storage_options)
        self.uri = self.storage.uri
        self.storage_options = dict(storage_options or {})
        self._session: lance.Session | None = None  # Lance's index/metadata caches, kept across refreshes
        self._region_keys: dict[uuid.UUID, tuple[int, tuple[Any, ...] | None]] = {}
        self._maintained: tuple[int, tuple[MaintainedIndex, ...]] = (-1, ())
        self.refresh()

    def refresh(self) -> None:
        try:
            ds = lance.dataset(self.uri, storage_options=self.storage_options or None, session=self._session)
        except (ValueError, OSError) as e:
            raise TableNotFoundError(f"no Lance table at {self.uri}") from e
        found = memwal_index.read_details(self.uri, self.storage_options or None, version=ds.version)
        if found is None:
            raise TableNotFoundError(
                f"the Lance table at {self.uri} has no MemWAL index ({memwal_index.MEMWAL_INDEX_NAME})"
            )
        self.dataset = ds
        self._opened_version = ds.version
        self._session = ds.session()
        self.details = found[0]
        pk = base_manifest.primary_key(ds.schema)
        self.schema = TableSchema(ds.schema, tuple(pk), lance_field_ids(ds))
        specs = sorted(self.details.sharding_specs, key=lambda s: s.spec_id)
        self.spec = RegionSpec.from_proto(specs[-1]) if specs else None
        self._specs = {s.spec_id: RegionSpec.from_proto(s) for s in specs}
        self.data_storage_version = ds.data_storage_version

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
            indexes = maintained_indexes(self.details, self.dataset, self.storage)
            self._maintained = (self.dataset.version, indexes)
        return indexes

    @property
    def specs(self) -> dict[int, RegionSpec]:
        """Every region spec of the table by spec id (regions keep the spec they were created under)."""
        return dict(self._specs)

    # ------------------------------------------------------------------ regions

    def region_id_for(self, values: tuple[Any, ...]) -> uuid.UUID:
        """The id of the region holding rows whose region values are `values` under the current spec."""
        spec = self._require_spec()
        digest = hashlib.sha256(b"memwal_df.region\x00" + spec.spec_id.to_bytes(4, "little"))
        for f, v in zip(spec.fields, values, strict=True):
            digest.update(f.field_id.encode() + b"\x00")
            digest.update(
                b"\x00" if v is None else b"\x01" + encode_region_value(v, result_arrow_type(f.result_type))
            )
        return uuid.UUID(bytes=digest.digest()[:16], version=4)

    def region_ids(self) -> list[uuid.UUID]:
        """Every region that has a directory under `_mem_wal/`."""
        ids = (_region_uuid(name) for name in self.storage.list_dir(layout.MEM_WAL_DIR))
        return sorted(i for i in ids if i is not None)

    def region_writer(
        self,
        region_id: uuid.UUID | str | None = None,
        *,
        values: Sequence[Any] | None = None,
        durable: bool | None = None,
        indexed: bool | None = None,
        config: WriterConfig | None = None,
        allow_non_key_region_columns: bool = False,
        **settings: Any,
    ) -> RegionWriter:
        """Claim a region and return its writer: the existing region `region_id`, or the region of
        `values` (one region value per field of the current spec; created if new).

        On a table with a region spec a new region is named by its values, so every key lands in
        the one region the spec assigns it: a `region_id` that names no existing region raises
        `UnknownRegionError`. On a table without a spec regions are created by hand: any new
        `region_id` (a UUID) is a new region. `allow_non_key_region_columns`: see `writer`."""
        if region_id is not None and values is not None:
            raise InvalidArgumentError("region_writer takes a region id or values=, not both")
        self.check_writable(allow_non_key_region_columns)
        config = config or self._config(durable, indexed, settings)
        if values is not None:
            return self.routed_writer(tuple(values), config, allow_non_key_region_columns=True)
        region_id = layout.parse_region_id(region_id)
        m = RegionManifestStore(self.storage, region_id).latest()
        if m is None and self.spec is not None:
            raise UnknownRegionError(
                f"region {region_id} does not exist, and a new region of a table with a region spec is "
                "named by its region values, not by an id: use table.writer(), which routes each row "
                "to its region, or table.region_writer(values=(...)) with one value per field of "
                f"the spec {self.spec_text()}"
            )
        values = self.region_values(m) if m is not None else None
        entries = {e.field_id: e.value for e in m.shard_field_entries} if m is not None and values else {}
        return self._writer(region_id, values, entries, config)

    def writer(
        self,
        *,
        durable: bool | None = None,
        indexed: bool | None = None,
        allow_non_key_region_columns: bool = False,
        **settings: Any,
    ) -> TableWriter:
        """A writer that routes rows to their regions (the table needs a region spec).

        `durable` / `indexed` default to the table's writer defaults (durable and indexed unless the
        MemWAL index says otherwise). A table whose region spec reads columns outside the primary
        key (made elsewhere: memwal_df refuses to create one) raises `NonKeyRegionColumnError`
        unless `allow_non_key_region_columns=True`: an upsert that changes such a column puts its key
        into a second region, so the caller must never change them."""
        return TableWriter(
            self,
            self._config(durable, indexed, settings),
            allow_non_key_region_columns=allow_non_key_region_columns,
        )

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

    def recover(self) -> list[uuid.UUID]:
        """Claim every region whose WAL holds entries no generation covers, replay and flush them.

        This is what a restarted writer does for the regions it writes to; `recover` does it for all
        of them, so durable writes of a crashed writer become visible to readers of flushed levels.
        Returns the recovered regions. Claiming fences any writer still active on those regions.
        A region whose manifest or WAL entry cannot be decoded is skipped and the others recovered;
        `CorruptRegionsError` then lists each skipped region and file (`result`: the recovered ids).
        """
        recovered, failed = [], {}
        for region_id in self.region_ids():
            try:
                if self._recover_region(region_id):
                    recovered.append(region_id)
            except (CorruptManifestError, CorruptWalEntryError) as e:
                failed[region_id] = e
        if failed:
            raise CorruptRegionsError("recover", failed, recovered)
        return recovered

    def _recover_region(self, region_id: uuid.UUID) -> bool:
        """Replay and flush the region if its WAL holds rows no generation covers; whether it did."""
        m = RegionManifestStore(self.storage, region_id).latest()
        if m is None or not Wal(self.storage, region_id).has_data_after(m.replay_after_wal_entry_position):
            return False
        with self.region_writer(region_id, allow_non_key_region_columns=True):  # replays, adds no rows
            pass
        return True

    def repair_region(
        self, region_id: uuid.UUID | str, *, apply: bool = False, discard_later: bool = False
    ) -> _repair.RepairPlan:
        """Plan, and with `apply=True` perform, setting the region's corrupt WAL entries aside (moved
        to a quarantine directory under the region) so the region can be claimed and replayed again;
        `plan.describe()` says what is lost. A corrupt entry followed by valid ones is refused with
        `RepairRefusedError` unless `discard_later`. See `memwal_df.jobs.repair`."""
        return _repair.repair_region(
            self.storage, layout.parse_region_id(region_id), apply=apply, discard_later=discard_later
        )

    def build_index(self) -> index_builder.BuildResult:
        """Run the MemWAL index builder: snapshot every region's state into the MemWAL index (for
        `MemWalTable(uri, consistency="snapshot")`) and advance stale WAL hints. See
        `memwal_df.jobs.index_builder`."""
        return index_builder.build_index(self)

    def merge(
        self,
        regions: Iterable[uuid.UUID | str] | None = None,
        max_generations: int | None = None,
        parallel: bool = False,
    ) -> merger.MergeResult:
        """Merge flushed generations into the base table, in order, per region (`memwal_df.jobs.merger`)."""
        return merger.merge(self, regions, max_generations, parallel)

    def gc(
        self,
        *,
        grace: timedelta = _gc.DEFAULT_GRACE,
        keep_manifest_versions: int = _gc.DEFAULT_KEEP_MANIFEST_VERSIONS,
    ) -> _gc.GcResult:
        """Remove merged generations, their WAL entries, orphaned generation directories and old
        region manifest versions that no reader or writer can still need; see `memwal_df.jobs.garbage`."""
        return _gc.gc(self, grace=grace, keep_manifest_versions=keep_manifest_versions)

    def catch_up_indexes(self, rebuild: bool = True) -> index_catchup.CatchUpResult:
        """Rebuild lagging maintained base indexes (`optimize_indices`) and record their
        `index_catchup`, claiming only generations their fragment bitmaps cover; see
        `memwal_df.jobs.index_catchup`."""
        return index_catchup.catch_up_indexes(self, rebuild)

    def maintain(
        self,
        *,
        interval: float = 60.0,
        stop: threading.Event | None = None,
        max_rounds: int | None = None,
        grace: timedelta = _gc.DEFAULT_GRACE,
        version_retention: timedelta | None = _maintain.DEFAULT_VERSION_RETENTION,
        keep_versions: int | None = None,
    ) -> list[_maintain.Round]:
        """Run merge, index build, index catch-up, cleanup of base versions older than
        `version_retention` (None: keep all) but the newest `keep_versions`, and GC every `interval`
        seconds until `stop` is set or `max_rounds` rounds ran, logging and retrying failed jobs; see
        `memwal_df.jobs.maintain`."""
        return _maintain.maintain(
            self,
            interval=interval,
            stop=stop,
            max_rounds=max_rounds,
            grace=grace,
            version_retention=version_retention,
            keep_versions=keep_versions,
        )

    def region_status(self, region_id: uuid.UUID) -> RegionStatus | None:
        m = RegionManifestStore(self.storage, region_id).latest()
        if m is None:
            return None
        merged = memwal_index.merged_generations(self.details).get(region_id, 0)
        return RegionStatus(
            region_id=region_id_of(m),
            spec_id=m.shard_spec_id,
            values=self.region_values(m),
            manifest_version=m.version,
            writer_epoch=m.writer_epoch,
            replay_after_wal_entry_position=m.replay_after_wal_entry_position,
            wal_entry_position_last_seen=m.wal_entry_position_last_seen,
            current_generation=m.current_generation,
            flushed_generations=tuple((s.generation, s.path) for s in m.sstables),
            merged_generation=merged,
        )

    def status(self, *, check_wal: bool = True) -> dict[str, Any]:
        """Regions, epochs, generations and merge progress, as plain data. `corrupt_regions` lists
        each region whose latest manifest or (with `check_wal`) unreplayed WAL entry cannot be decoded
        (its file and the error); a region with a corrupt manifest is missing from `regions`.
        `check_wal` reads every WAL entry a claiming writer would replay (up to a MemTable's worth per
        region); without it only manifests are read."""
        self.refresh()
        regions, corrupt = [], []
        for region_id in self.region_ids():
            try:
                s = self.region_status(region_id)
            except CorruptManifestError as e:
                corrupt.append(_repair.manifest_problem(region_id, e))
                continue
            if s is None:
                continue
            regions.append(s)
            if check_wal and (
                problem := _repair.wal_problem(self.storage, region_id, s.replay_after_wal_entry_position)
            ):
                corrupt.append(problem)
        return {
            "uri": self.uri,
            "base_version": self.dataset.version,
            "base_rows": self.dataset.count_rows(),
            "primary_key": list(self.schema.primary_key),
            "region_spec": None if self.spec is None else self.spec.describe(),
            "maintained_indexes": (
                "all" if self.details.maintain_all_indexes else list(self.details.maintained_indexes)
            ),
            "regions": regions,
            "corrupt_regions": corrupt,
        }

    # ------------------------------------------------------------------ helpers

    def _require_spec(self) -> RegionSpec:
        if self.spec is None:
            raise RegionRoutingError("the table has no region spec; regions are created manually")
        return self.spec

    def _config(self, durable: bool | None, indexed: bool | None, settings: dict[str, Any]) -> WriterConfig:
        return WriterConfig.from_defaults(
            dict(self.details.writer_config_defaults),
            durable_write=durable,
            indexed_write=indexed,
            **settings,
        )

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

    def routed_writer(
        self, values: tuple[Any, ...], config: WriterConfig, *, allow_non_key_region_columns: bool = False
    ) -> RegionWriter:
        """The writer of the region for `values`, created with its field entries if new."""
        self.check_writable(allow_non_key_region_columns)
        spec = self._require_spec()
        if len(values) != len(spec.fields):
            raise RegionRoutingError(
                f"the region spec has {len(spec.fields)} fields "
                f"{[f.field_id for f in spec.fields]}, got {len(values)} region values {list(values)}"
            )
        for f, v in zip(spec.fields, values, strict=True):
            if not f.transform.can_produce(v):
                raise RegionRoutingError(
                    f"no row has region value {v!r} for field {f.field_id!r} ({f.transform}): "
                    "a region for it would stay empty"
                )
        entries = {
            f.field_id: encode_region_value(v, result_arrow_type(f.result_type))
            for f, v in zip(spec.fields, values, strict=True)
            if v is not None
        }
        return self._writer(self.region_id_for(values), values, entries, config)

    def _writer(
        self,
        region_id: uuid.UUID,
        values: tuple[Any, ...] | None,
        entries: dict[str, bytes],
        config: WriterConfig,
    ) -> RegionWriter:
        ctx = RegionContext(
            storage=self.storage,
            schema=self.schema,
            data_storage_version=self.data_storage_version,
            spec=self.spec,
            region_values=values,
            field_entries=entries,
            indexes=self.maintained_indexes(),
        )
        return RegionWriter(ctx, region_id, config)


@functools.lru_cache(maxsize=1 << 14)
def _region_uuid(name: str) -> uuid.UUID | None:
    """The region id a `_mem_wal/` directory name stands for (None: not a region directory)."""
    try:
        return uuid.UUID(name)
    except ValueError:
        return None


def _exists(storage: Storage) -> bool:
    try:
        return bool(storage.list_dir("_versions"))
    except NotFoundError:
        return False


def create_table(
    uri: str,
    data_or_schema: Any,
    primary_key: str | list[str],
    region_spec: UnboundRegionSpec | None = None,
    maintained_indexes: list[str] | None = None,
    storage_options: dict[str, str] | None = None,
    data_storage_version: str | None = None,
) -> Table:
    """Create the base Lance table (from data or an empty schema) and its MemWAL index.

    All or nothing: the key, the data and the region spec (it may read primary-key columns only,
    `NonKeyRegionColumnError`) are checked before anything is written, and if writing fails after
    the base table was written, what was written is removed, so the URI holds no table and a retry
    can succeed. (A process killed in between leaves a Lance table without a MemWAL index, which
    `open_table` refuses and a retry reports as `TableExistsError`.)"""
    storage = open_storage(uri, storage_options)
    if _exists(storage):
        if memwal_index.read_details(storage.uri, storage_options or None) is None:
            raise TableExistsError(
                f"a Lance table without a MemWAL index exists at {storage.uri} (a create_table killed "
                "midway leaves one): remove it to create the table there"
            )
        raise TableExistsError(f"a table already exists at {storage.uri}")
    pk = [primary_key] if isinstance(primary_key, str) else list(primary_key)
    data = data_or_schema.empty_table() if isinstance(data_or_schema, pa.Schema) else to_table(data_or_schema)
    _check_primary_key(data.schema, pk)
    schema = base_manifest.with_primary_key(_nullable_values(data.schema, pk), pk)
    data = conform(data, schema)
    check_keys(data, tuple(pk))
    data = _last_per_key(data, pk)
    field_ids = lance_field_ids(schema)  # as Lance assigns them to the new dataset
    details = _initial_details(field_ids, schema, pk, region_spec, maintained_indexes)
    before = set(storage.list_dir(""))
    ds = lance.write_dataset(
        data,
        storage.uri,
        schema=schema,
        mode="create",
        storage_options=storage_options or None,
        data_storage_version=data_storage_version,
    )
    try:
        if lance_field_ids(ds) != field_ids:
            details = _initial_details(lance_field_ids(ds), ds.schema, pk, region_spec, maintained_indexes)
        memwal_index.initialize(storage.uri, details, storage_options or None)
    except BaseException:
        _remove_created(storage, before)
        raise
    return Table(storage.uri, storage_options)


def _check_primary_key(schema: pa.Schema, pk: list[str]) -> None:
    """SchemaMismatchError unless every key column exists and has a type Lance 14 keys support."""
    missing = [c for c in pk if c not in schema.names]
    if missing:
        raise SchemaMismatchError(f"primary key columns {missing} are not in the schema")
    unsupported = {c: str(schema.field(c).type) for c in pk if not is_supported_pk_type(schema.field(c).type)}
    if unsupported:
        raise SchemaMismatchError(
            f"primary key columns of these types are not supported by Lance 14: {unsupported} "
            "(use integers, booleans, strings or binaries)"
        )


def _initial_details(
    field_ids: dict[str, int],
    schema: pa.Schema,
    pk: list[str],
    region_spec: UnboundRegionSpec | None,
    maintained_indexes: list[str] | None,
) -> pb.MemWalIndexDetails:
    """The MemWAL index details of a new table; raises (InvalidRegionSpecError, InvalidConfigError)
    for a spec that does not bind to `schema` or a maintained index the new table cannot have."""
    details = pb.MemWalIndexDetails()
    if region_spec is not None:
        bound = region_spec.bind(field_ids, schema, primary_key=pk)
        details.sharding_specs.append(bound.to_proto())
        if bound.num_regions is not None:
            details.num_shards = bound.num_regions
    if maintained_indexes is None:
        details.maintain_all_indexes = True
    elif maintained_indexes:
        raise InvalidConfigError(
            f"maintained_indexes names indexes a new table does not have: {list(maintained_indexes)} "
            "(create the table with maintained_indexes=None (all) or [] (none))"
        )
    else:
        details.maintain_all_indexes = False
    return details


def _remove_created(storage: Storage, before: set[str]) -> None:
    """Remove what a failed `create_table` wrote: the base manifests first (then the URI holds no
    table), then the other top-level entries that were not there before."""
    try:
        storage.delete_prefix("_versions")
        for name in storage.list_dir(""):
            if name not in before:
                storage.delete_prefix(name)
    except Exception:  # the caller raises the error that made the create fail
        log.exception("removing the partly created table at %s failed", storage.uri)


def open_table(uri: str, storage_options: dict[str, str] | None = None) -> Table:
    """Open a MemWAL table (made by memwal_df or by Lance's `initialize_mem_wal`)."""
    return Table(uri, storage_options)


def _nullable_values(schema: pa.Schema, pk: list[str]) -> pa.Schema:
    """Non-key columns must be nullable: a tombstone row carries only its key."""
    return pa.schema([f if f.name in pk else f.with_nullable(True) for f in schema], metadata=schema.metadata)


def _last_per_key(table: pa.Table, pk: list[str]) -> pa.Table:
    """Initial data with one row per key, the last one (the base table holds unique keys)."""
    if table.num_rows == 0:
        return table
    idx = pa.array(np.arange(table.num_rows))
    last = table.append_column("_pos", idx).group_by(pk, use_threads=False).aggregate([("_pos", "max")])
    if last.num_rows == table.num_rows:
        return table
    return table.take(pa.array(np.sort(last.column("_pos_max").to_numpy())))
