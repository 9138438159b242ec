"""The `Table` facade, `create_table` and `open_table`: what users call on a MemWAL table.

`Table` is the table handle (`memwal_df.format.table_handle.TableHandle`: the Lance base table, its
MemWAL index and the regions under `_mem_wal/`) plus the writers (`writer`, `region_writer`), status,
recovery and the background jobs of `memwal_df.jobs`. `create_table` writes the base table (primary
key marked as Lance's unenforced primary key) and the `__lance_mem_wal` index entry exactly as
Lance's `initialize_mem_wal` does; `open_table` opens tables made by either.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any

import lance
import pyarrow as pa

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    CorruptRegionsError,
    CorruptWalEntryError,
    InvalidArgumentError,
    InvalidConfigError,
    NotFoundError,
    RegionRoutingError,
    SchemaMismatchError,
    TableExistsError,
)
from memwal_df.format import base_manifest, consumers, layout, memwal_index
from memwal_df.format.consumers import ChangeOffsets, Consumer
from memwal_df.format.manifest import RegionManifestStore, region_id_of
from memwal_df.format.open_storage import open_storage
from memwal_df.format.pk_index import is_supported_pk_type
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import UnboundRegionSpec, lance_field_ids, unsharded
from memwal_df.format.schema import check_keys, conform, to_table
from memwal_df.format.storage import Storage
from memwal_df.format.table_handle import TableHandle
from memwal_df.jobs import base_recovery, compaction, index_builder, index_catchup, merger, region_recovery
from memwal_df.jobs import garbage as _gc
from memwal_df.jobs import generation_repair as _generation_repair
from memwal_df.jobs import health as _health
from memwal_df.jobs import maintain as _maintain
from memwal_df.jobs import repair as _repair
from memwal_df.jobs.compaction import CompactionSettings
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings
from memwal_df.read.changes import EARLIEST, ChangeFeed, Since, open_feed, register_consumer
from memwal_df.read.lookup.current_rows import WriterLookup
from memwal_df.read.lsm.keys import last_per_key
from memwal_df.write.region_open import open_region_writer, open_routed_writer
from memwal_df.write.region_writer import RegionWriter
from memwal_df.write.table_writer import TableWriter
from memwal_df.write.writer_config import WriterConfig

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


class Table(TableHandle):
    """An open MemWAL table: the table handle (`TableHandle`: schema, region specs, regions) with
    its writers, status, recovery and background jobs. Cheap to create; `refresh()` re-reads the
    base table and MemWAL index."""

    # ------------------------------------------------------------------ writers

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
            return open_routed_writer(
                self,
                tuple(values),
                config,
                allow_non_key_region_columns=True,
                current_rows=self._current_rows,
            )
        return open_region_writer(self, layout.parse_region_id(region_id), config, self._current_rows)

    def routed_writer(
        self, values: tuple[Any, ...], config: WriterConfig, *, allow_non_key_region_columns: bool = False
    ) -> RegionWriter:
        """The writer of the region for `values`, created with its field entries if new (see
        `memwal_df.write.region_open.open_routed_writer`)."""
        return open_routed_writer(
            self,
            values,
            config,
            allow_non_key_region_columns=allow_non_key_region_columns,
            current_rows=self._current_rows,
        )

    def writer(
        self,
        *,
        durable: bool | None = None,
        indexed: bool | None = None,
        allow_non_key_region_columns: bool = False,
        **settings: Any,
    ) -> TableWriter:
        """A writer that routes rows to their regions.

        A table without a region spec that has no region yet gets the `unsharded` spec first (one
        region holding every row; see `single_region_spec`), so `create_table(uri, schema, key)`
        followed by `writer()` just works; one whose regions were created by hand raises
        `RegionRoutingError` (a key may be in any of them: write with `region_writer(region_id)`).

        `durable` / `indexed` default to the table's writer defaults (durable and indexed unless the
        MemWAL index says otherwise). A table whose region spec reads columns outside the primary
        key (made elsewhere: memwal_df refuses to create one) raises `NonKeyRegionColumnError`
        unless `allow_non_key_region_columns=True`: an upsert that changes such a column puts its key
        into a second region, so the caller must never change them."""
        if self.spec is None:
            self.single_region_spec()
        return TableWriter(
            self,
            self._config(durable, indexed, settings),
            allow_non_key_region_columns=allow_non_key_region_columns,
            current_rows=self._current_rows,
        )

    def single_region_spec(self) -> None:
        """Give a table without a region spec and without regions the `unsharded` spec (every row in
        one region, whose id the spec derives), committed to the MemWAL index like any spec change;
        Lance's readers and writers read the table as before. Two processes doing this at once
        commit one spec. Raises `RegionRoutingError` when the table has regions already (created by
        hand with `region_writer(region_id)` or by Lance's `mem_wal_writer`): a key may be in any of
        them, so no routed writer can keep each key in one region."""
        self.refresh()
        while self.spec is None:
            regions = self.region_ids()
            if regions:
                shown = ", ".join(str(r) for r in regions[:3]) + (", ..." if len(regions) > 3 else "")
                raise RegionRoutingError(
                    f"the table has no region spec and {len(regions)} region(s) created by hand "
                    f"({shown}); a key may be in any of them, so rows cannot be routed: write with "
                    "table.region_writer(region_id)"
                )
            details = pb.MemWalIndexDetails()
            details.CopyFrom(self.details)
            bound = unsharded().bind(
                self.schema.field_ids, self.schema.schema, primary_key=self.schema.primary_key
            )
            details.sharding_specs.append(bound.to_proto())
            details.num_shards = 1
            try:
                memwal_index.replace_details(
                    self.uri, details, self.dataset.version, self.storage_options or None
                )
            except CommitConflictError:  # another process gave it a spec first: use that one
                log.info("a concurrent writer gave %s its region spec first", self.uri)
            self.refresh()

    @cached_property
    def _current_rows(self) -> WriterLookup:
        """The writers' lookup for partial and conditional writes (`memwal_df.write.partial.CurrentRows`)."""
        return WriterLookup(self)

    def _config(self, durable: bool | None, indexed: bool | None, settings: dict[str, Any]) -> WriterConfig:
        return WriterConfig.from_defaults(
            dict(self.details.writer_config_defaults),
            durable_write=durable,
            indexed_write=indexed,
            **settings,
        )

    # ------------------------------------------------------------------ recovery, jobs, status

    def recover(self) -> list[uuid.UUID]:
        """Claim every region whose WAL holds entries no generation covers, replay and flush them.

        This is what a restarted writer does for the regions it writes to; `recover` does it for all
        of them, so durable writes of a crashed writer become visible to readers of flushed levels.
        Returns the recovered regions. Claiming fences any writer still active on those regions.
        A region whose manifest or WAL entry cannot be decoded is skipped and the others recovered;
        `CorruptRegionsError` then lists each skipped region and file (`result`: the recovered ids).

        First, on local storage, newest base versions that a power loss tore are rolled back
        (`memwal_df.jobs.base_recovery`; logged at WARNING): their generations are unmerged again.
        """
        rolled = base_recovery.recover_base(self.storage)
        if rolled.rolled_back:
            log.warning(
                "base versions %s of %s did not survive whole and were set aside (%s); the table is at "
                "version %s",
                list(rolled.rolled_back),
                self.uri,
                "; ".join(rolled.problems),
                rolled.latest,
            )
            self.refresh()
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
        if region_recovery.unflushed(self.storage, region_id) is None:
            return False
        with self.region_writer(region_id, allow_non_key_region_columns=True):  # replays, adds no rows
            pass
        return True

    def repair_region(
        self, region_id: uuid.UUID | str, *, apply: bool = False, discard_later: bool = False
    ) -> _repair.RepairPlan:
        """Plan, and with `apply=True` perform, setting the region's corrupt WAL entries aside (moved
        to a quarantine directory under the region) so the region can be claimed and replayed again,
        and rebuilding its corrupt unmerged generations from the WAL (or, when their WAL entries are
        gone, setting them aside); `plan.describe()` says what is lost. A corrupt entry followed by
        valid ones is refused with `RepairRefusedError` unless `discard_later`. See
        `memwal_df.jobs.repair` and `memwal_df.jobs.generation_repair`."""
        return _generation_repair.repair_region(
            self, layout.parse_region_id(region_id), apply=apply, discard_later=discard_later
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
        generations_per_commit: int = merger.GENERATIONS_PER_COMMIT,
    ) -> merger.MergeResult:
        """Merge flushed generations into the base table, in order, per region, up to
        `generations_per_commit` consecutive generations of a region in one commit
        (`memwal_df.jobs.merger`)."""
        return merger.merge(self, regions, max_generations, parallel, generations_per_commit)

    def gc(
        self,
        *,
        grace: timedelta = _gc.DEFAULT_GRACE,
        keep_manifest_versions: int = _gc.DEFAULT_KEEP_MANIFEST_VERSIONS,
        stream_commit_retention: timedelta = _gc.DEFAULT_STREAM_COMMIT_RETENTION,
        consumer_retention: timedelta = _gc.DEFAULT_CONSUMER_RETENTION,
    ) -> _gc.GcResult:
        """Remove merged generations, their WAL entries, orphaned generation directories, old
        region manifest versions, temp files of failed writes, the commit records of streaming
        queries stopped longer than `stream_commit_retention` and consumer records stale longer than
        `consumer_retention`, all that no reader or writer can still need; see `memwal_df.jobs.garbage`."""
        return _gc.gc(
            self,
            grace=grace,
            keep_manifest_versions=keep_manifest_versions,
            stream_commit_retention=stream_commit_retention,
            consumer_retention=consumer_retention,
        )

    def catch_up_indexes(
        self, rebuild: bool = True, upkeep: IndexUpkeepSettings | None = None
    ) -> index_catchup.CatchUpResult:
        """Rebuild lagging maintained base indexes (`optimize_indices`, keeping each within the
        segment and retraining bounds of `upkeep`) and record their `index_catchup`, claiming only
        generations their fragment bitmaps cover; see `memwal_df.jobs.index_catchup`."""
        return index_catchup.catch_up_indexes(self, rebuild, upkeep)

    def compact(self, settings: CompactionSettings | None = None) -> compaction.CompactionResult:
        """Rewrite the base table's small fragments and fragments with many deleted rows when their
        debt passes `settings` (default `CompactionSettings()`), keeping the MemWAL index and index
        catch-up intact; see `memwal_df.jobs.compaction`."""
        return compaction.compact(self, settings)

    def maintain(
        self,
        *,
        interval: float = 60.0,
        stop: threading.Event | None = None,
        max_rounds: int | None = None,
        grace: timedelta = _gc.DEFAULT_GRACE,
        version_retention: timedelta | None = _maintain.DEFAULT_VERSION_RETENTION,
        keep_versions: int | None = None,
        compact: CompactionSettings | None = compaction.DEFAULT_SETTINGS,
        index_upkeep: IndexUpkeepSettings | None = None,
    ) -> list[_maintain.Round]:
        """Run the recovery of regions whose writer is gone (their writer lease expired or was
        released: `memwal_df.jobs.region_recovery`), merge, index build, index catch-up (bounded by
        `index_upkeep`), base compaction
        (`compact`; None: none), cleanup of base versions older than `version_retention` (None: keep
        all) but the newest `keep_versions`, and GC every `interval` seconds until `stop` is set or
        `max_rounds` rounds ran, logging and retrying failed jobs; see `memwal_df.jobs.maintain`."""
        return _maintain.maintain(
            self,
            interval=interval,
            stop=stop,
            max_rounds=max_rounds,
            grace=grace,
            version_retention=version_retention,
            keep_versions=keep_versions,
            compact=compact,
            index_upkeep=index_upkeep,
        )

    # ------------------------------------------------------------------ change feed

    def changes(
        self,
        since: Since | None = None,
        *,
        until: Since | None = None,
        consumer: str | None = None,
        max_generations: int | None = None,
        columns: Sequence[str] | None = None,
    ) -> ChangeFeed:
        """The table's changes (every flushed generation's, in order per region) from `since`
        (offsets, "earliest" or "latest"; None: the `consumer`'s committed offsets, else "earliest")
        to `until` (None: every flushed change), at most `max_generations` generations, `columns`
        (all when None; the key always): iterate it for Arrow batches, then resume from its
        `offsets` (`feed.commit()` stores them for its consumer). `ChangesExpiredError` if GC removed
        changes `since` needs. See `memwal_df.read.changes` and docs/changes.md."""
        return open_feed(
            self, since, until=until, consumer=consumer, max_generations=max_generations, columns=columns
        )

    def register_consumer(
        self, consumer_id: str, since: Since = EARLIEST, *, expiry: timedelta = consumers.DEFAULT_EXPIRY
    ) -> Consumer:
        """Register a change-feed consumer at `since`: GC keeps every change it has not read while it
        commits offsets at least every `expiry` (an already registered consumer is returned as it is)."""
        return register_consumer(self, consumer_id, since, expiry)

    def commit_consumer(self, consumer_id: str, offsets: ChangeOffsets | dict[str, Any] | str) -> Consumer:
        """Record that `consumer_id` has read every change before `offsets` (registering it if new)."""
        return consumers.commit_offsets(self.storage, consumer_id, ChangeOffsets.parse(offsets))

    def consumers(self) -> list[Consumer]:
        """Every registered change-feed consumer."""
        return consumers.list_consumers(self.storage)

    def remove_consumer(self, consumer_id: str) -> None:
        """Unregister a consumer: GC stops keeping changes for it."""
        consumers.remove_consumer(self.storage, consumer_id)

    def region_status(self, region_id: uuid.UUID) -> RegionStatus | None:
        """The region as its latest manifest describes it; None when the region has no manifest."""
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

    def status(self, *, check_wal: bool = True, check_generations: bool = True) -> dict[str, Any]:
        """Regions, epochs, generations and merge progress, as plain data. `corrupt_regions` lists
        each region whose latest manifest or (with `check_wal`) unreplayed WAL entry cannot be decoded
        and (with `check_generations`) each corrupt unmerged generation (its file and the error); a
        region with a corrupt manifest is missing from `regions`. `check_wal` reads every WAL entry a
        claiming writer would replay (up to a MemTable's worth per region), `check_generations` every
        file of every unmerged generation (`jobs.generation_repair.check_generation`); without them
        only manifests are read. `health` (`memwal_df.jobs.health.Health`): the
        base's fragments, deletion files and compaction debt, each base index's segments and coverage,
        and the maintain loop's last error per job, from manifest metadata (no row data is read)."""
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
            if check_generations:
                merged, pk = s.merged_generation, self.schema.primary_key
                corrupt += _generation_repair.generation_problems(self.storage, region_id, merged, pk)
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
            "health": _health.table_health(self.dataset, self.details, self.storage),
        }


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
    `open_table` refuses and a retry reports as `TableExistsError`.) On local storage every file of
    the new table is fsynced, with its directory entries, before it returns."""
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
    data = last_per_key(data, pk)
    field_ids = lance_field_ids(schema)  # as Lance assigns them to the new dataset
    details = _initial_details(field_ids, schema, pk, region_spec, maintained_indexes)
    before = set(storage.list_dir(""))
    with storage.synced_changes():  # the new table is durable when this returns
        ds = lance.write_dataset(
            data,
            storage.uri,
            schema=schema,
            mode="create",
            storage_options=storage_options or None,
            data_storage_version=data_storage_version,  # type: ignore[arg-type]  # lance checks the name at run time
        )
        try:
            made_ids = lance_field_ids(ds)
            if made_ids != field_ids:
                details = _initial_details(made_ids, ds.schema, pk, region_spec, maintained_indexes)
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
    """Open a MemWAL table (made by memwal_df or by Lance's `initialize_mem_wal`) to write or run
    jobs on. On local storage, a newest base version whose manifest a power loss tore is rolled back
    first when the table cannot be opened otherwise (`Table.recover` checks the files of the newest
    versions too)."""
    try:
        return Table(uri, storage_options)
    except BaseException as e:  # TableNotFoundError for an unreadable newest manifest, Lance's errors
        if not (isinstance(e, OSError | ValueError) or base_recovery.is_lance_panic(e)):
            raise
        if not base_recovery.recover_base(open_storage(uri, storage_options)).rolled_back:
            raise
    log.warning("the newest base version of %s did not survive whole and was set aside", uri)
    return Table(uri, storage_options)


def _nullable_values(schema: pa.Schema, pk: list[str]) -> pa.Schema:
    """Non-key columns must be nullable: a tombstone row carries only its key."""
    return pa.schema([f if f.name in pk else f.with_nullable(True) for f in schema], metadata=schema.metadata)
