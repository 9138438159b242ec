"""A read snapshot: every level of the LSM tree that one query reads, fixed when the query is planned.

Levels (spec "MemTable Collection"): the base table (generation 0), each region's flushed
generations that are not merged yet (`generation > merged_generations[region]`, read from the base
manifest of the pinned base version), and, when a writer is attached, its unflushed MemTables.
Within a region, levels are ordered newest first; rows of different regions never share a key. The
base table is the snapshot's `base` dataset; the other levels are `GenerationLevel` and
`MemTableLevel` objects (`memwal_df.read.lsm.levels`).

Consistency modes:
- `latest`: the base table's latest version, then each region's latest manifest. Every generation
  flushed before planning is visible.
- `snapshot`: the base table's latest version, then the region states of that version's MemWAL
  index snapshot (one read: inline, or one file), with no region manifest read. Generations flushed
  and regions created after the last `build_index` are not visible. Without a snapshot (never built,
  or its external file is gone) the query reads region manifests as `latest` does.
- with `writer=`: additionally the writer's unflushed MemTables, copied at planning time (strong
  consistency for the regions that writer owns; in `snapshot` mode the writer's own manifest, if
  newer than the snapshot's row, gives those regions' flushed generations).

Guarantees: a generation that was garbage-collected is skipped (its rows are in the base table), never
an error; each level holds at most one row per key (generations are written newest-per-key, Lance
generations hide older duplicates with a deletion vector, MemTable copies are deduplicated).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import lance
import pyarrow as pa

from memwal_df.errors import CorruptManifestError, InvalidConfigError
from memwal_df.format import layout, memwal_index, region_snapshot
from memwal_df.format.manifest import RegionManifestStore, read_regions, region_id_of
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.schema import TableSchema, conform
from memwal_df.format.storage import Storage
from memwal_df.read.lsm.cache import PerObjectCache
from memwal_df.read.lsm.keys import distinct_keys
from memwal_df.read.lsm.levels import GenerationLevel, Level, MemTableLevel

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle
    from memwal_df.write.memtable import MemTableSnapshot
    from memwal_df.write.region_writer import RegionWriter
    from memwal_df.write.table_writer import TableWriter

Consistency = Literal["latest", "snapshot"]
CONSISTENCY_MODES: tuple[Consistency, ...] = ("latest", "snapshot")
_MAX_PLANNING_ATTEMPTS = 5


@dataclass
class RegionLevels:
    """The unmerged levels of one region, newest first; `merged`: the generations still listed in its
    manifest that are merged into the pinned base, newest first (read only by index catch-up plans)."""

    region_id: uuid.UUID
    spec_id: int
    values: tuple[Any, ...] | None
    levels: list[Level]
    merged: list[GenerationLevel] = field(default_factory=list)


@dataclass(frozen=True)
class UnreadableRegion:
    """A region whose latest manifest cannot be decoded: only queries that need it fail, with `error`.
    `spec_id` and `values` come from an older, readable manifest version (a region's spec and values
    never change); unknown (-1, None), the region is needed by every query."""

    region_id: uuid.UUID
    spec_id: int
    values: tuple[Any, ...] | None
    error: CorruptManifestError


@dataclass
class ReadSnapshot:
    """What one query reads.

    `lookup_keys` is set for a point-lookup snapshot (`take_snapshot(keys=...)`, conformed to the key
    schema, without NULL keys, each key once): `regions` then holds only the regions those keys can
    live in, so the snapshot answers lookups of those keys only (`plan_point_lookup` checks)."""

    schema: TableSchema
    base: lance.LanceDataset
    details: pb.MemWalIndexDetails
    regions: list[RegionLevels]
    consistency: str
    storage: Storage  # the table's: older base manifests are read through it
    lookup_keys: pa.Table | None = None
    unreadable: list[UnreadableRegion] = field(default_factory=list)  # not in `regions`

    @property
    def levels(self) -> list[Level]:
        """The levels of every region; raises the error of an unreadable region."""
        self.require_readable(self.unreadable)
        return [lv for r in self.regions for lv in r.levels]

    @staticmethod
    def require_readable(needed: Sequence[UnreadableRegion]) -> None:
        """Raise the `CorruptManifestError` of the first of the `needed` unreadable regions, if any."""
        if needed:
            raise needed[0].error


def key_region_values(
    spec: RegionSpec | None, field_ids: Mapping[str, int], primary_key: Sequence[str], keys: pa.Table
) -> list[tuple[Any, ...]] | None:
    """Each key's region values under `spec` (keys in the table's key types), or None when keys
    cannot be routed: no spec, or a spec that reads columns other than the key."""
    if spec is None or not spec.fields:
        return None
    if not spec.reads_only(field_ids[c] for c in primary_key if c in field_ids):
        return None
    return list(zip(*(v.to_pylist() for v in spec.evaluate(keys, field_ids)), strict=True))


def may_hold(spec: RegionSpec, targets: Container[tuple[Any, ...]], spec_id: int, values: Any) -> bool:
    """Whether a region (its spec id and values) may hold keys whose region values are in `targets`
    under `spec`: yes when its values match, or are unknown, or were recorded under another spec."""
    return values is None or spec_id != spec.spec_id or tuple(values) in targets


def take_snapshot(
    table: TableHandle,
    consistency: Consistency = "latest",
    writer: TableWriter | RegionWriter | None = None,
    *,
    keys: pa.Table | None = None,
) -> ReadSnapshot:
    """Pin the base version, then take the region states (every region's latest manifest, or the
    MemWAL index's region snapshot) and the writer's MemTables.

    With `keys` (a table of the primary-key columns), a point-lookup snapshot: regions the region
    spec routes none of the keys to are left out, without reading their manifests (a region's spec
    and values never change, so `TableHandle.known_region` remembers them; regions not seen before are read
    once to learn them). The same consistency holds for the regions kept."""
    check_consistency(consistency)
    if keys is not None:
        ts = table.schema
        keys = conform(keys.select(list(ts.primary_key)), ts.key_schema, what="lookup keys")
        keys = distinct_keys(keys, ts.primary_key)
    take = _take if consistency == "latest" else _take_indexed
    for _ in range(_MAX_PLANNING_ATTEMPTS):
        snapshot = take(table, writer, keys)
        # A merge committed while the manifests were read may already have been collected: its
        # generations would be missing from both the pinned base and the levels. Plan again.
        if table.is_latest(snapshot.base.version):
            return snapshot
    return snapshot


def _take(
    table: TableHandle, writer: TableWriter | RegionWriter | None, keys: pa.Table | None
) -> ReadSnapshot:
    table.sync()
    base = table.dataset
    merged = memwal_index.merged_generations(table.details)
    # MemTables first, manifests second: a MemTable flushed in between is then seen twice (as a
    # MemTable and as a generation, same rows), never not at all.
    wanted = _region_selector(table, keys)
    memtables = _writer_memtables(writer, wanted)
    ids = table.region_ids()
    if wanted is not None:
        ids = [r for r in ids if (known := table.known_region(r)) is None or wanted(*known)]
    storage = table.storage
    known_manifests = _LATEST_MANIFESTS.get(table, dict)

    def latest(region_id: uuid.UUID) -> pb.ShardManifest | CorruptManifestError | None:
        try:
            m = _latest_manifest(RegionManifestStore(storage, region_id), known_manifests.get(region_id))
        except CorruptManifestError as e:
            return e
        if m is not None:
            known_manifests[region_id] = m
        return m

    manifests = read_regions(storage, ids, latest)
    regions, unreadable = [], []
    for region_id, m in zip(ids, manifests, strict=True):
        if m is None:
            continue
        if isinstance(m, CorruptManifestError):
            region = _unreadable(table, region_id, m)
            if wanted is None:
                unreadable.append(region)
            elif wanted(region.spec_id, region.values):
                raise m  # a lookup of keys this region may hold
            continue
        values = _region_values(table, region_id, m)
        if wanted is not None and not wanted(m.shard_spec_id, values):
            continue
        regions.append(_region_levels(table, region_id, m, values, merged, memtables))
    return ReadSnapshot(table.schema, base, table.details, regions, "latest", table.storage, keys, unreadable)


def _unreadable(table: TableHandle, region_id: uuid.UUID, error: CorruptManifestError) -> UnreadableRegion:
    """The region whose latest manifest raised `error`, with its spec id and values as the table
    remembers them or as its oldest readable manifest version records them (-1, None: unknown)."""
    known = table.known_region(region_id)
    if known is not None:
        return UnreadableRegion(region_id, known[0], known[1], error)
    store = RegionManifestStore(table.storage, region_id)
    for version in store.list_versions():
        try:
            m = store.read(version)
        except CorruptManifestError:
            continue
        if m is not None:
            return UnreadableRegion(region_id, m.shard_spec_id, table.region_values(m), error)
    return UnreadableRegion(region_id, -1, None, error)


_LATEST_MANIFESTS: PerObjectCache[TableHandle, dict[uuid.UUID, pb.ShardManifest]] = PerObjectCache()


def _latest_manifest(store: RegionManifestStore, known: pb.ShardManifest | None) -> pb.ShardManifest | None:
    """The region's latest manifest. A manifest read before (`known`, version v) is still the latest
    when v + 1 does not exist and, checked after that, v still does; it is then returned without
    reading the hint or the file again. Versions are committed one after another (v + 1 only by a
    writer that read v), and garbage collection deletes old versions in ascending order: a v + 1
    missing because it was collected means v was collected before it, so v found afterwards proves
    that v was the latest when v + 1 was found missing. (The other order of the two probes is not
    proof: GC may collect v and v + 1 between them. Probing only past v would miss a region whose
    next versions were all collected.)"""
    if known is not None:
        v = known.version
        if store.storage.head(store.path(v + 1)) is None and store.storage.head(store.path(v)) is not None:
            return known
    return store.latest()


def _region_selector(table: TableHandle, keys: pa.Table | None) -> Callable[[int, Any], bool] | None:
    """For a point-lookup snapshot (`keys` conformed to the key schema), a test of (spec id, region
    values) for the regions to read; None when every region is read (no keys, or keys the region
    spec cannot route)."""
    if keys is None:
        return None
    ts, spec = table.schema, table.spec
    values = key_region_values(spec, ts.field_ids, ts.primary_key, keys)
    if values is None:
        return None
    assert spec is not None
    targets = set(values)
    return lambda spec_id, region_values: may_hold(spec, targets, spec_id, region_values)


def _take_indexed(
    table: TableHandle, writer: TableWriter | RegionWriter | None, keys: pa.Table | None
) -> ReadSnapshot:
    """`snapshot` mode: region states from the pinned version's MemWAL index snapshot (no manifest
    read; a region the writer writes uses the writer's manifest when it is newer). Without a
    snapshot this is `_take` (and the result says `latest`)."""
    table.sync()
    states = region_snapshot.load(table.storage, table.details, table.specs)
    if states is None:
        return _take(table, writer, keys)
    merged = memwal_index.merged_generations(table.details)
    wanted = _region_selector(table, keys)
    memtables = _writer_memtables(writer, wanted)  # before the writer's manifests, as in `_take`
    newest = {region_id_of(m): m for m in states}
    for m in _writer_manifests(writer):
        region_id = region_id_of(m)
        if region_id not in newest or m.version > newest[region_id].version:
            newest[region_id] = m
    regions = []
    for region_id in sorted(newest):
        m = newest[region_id]
        values = _region_values(table, region_id, m)
        if wanted is None or wanted(m.shard_spec_id, values):
            regions.append(_region_levels(table, region_id, m, values, merged, memtables))
    return ReadSnapshot(table.schema, table.dataset, table.details, regions, "snapshot", table.storage, keys)


def check_consistency(mode: str) -> Consistency:
    """`mode` if it is a consistency mode, else `InvalidConfigError`."""
    if mode not in CONSISTENCY_MODES:
        raise InvalidConfigError(f"unknown consistency mode {mode!r}; expected one of {CONSISTENCY_MODES}")
    return mode


def _region_values(table: TableHandle, region_id: uuid.UUID, m: pb.ShardManifest) -> tuple[Any, ...] | None:
    """The region's values (decoded once per table: a region's spec and values never change)."""
    known = table.known_region(region_id)
    if known is not None and known[0] == m.shard_spec_id:
        return known[1]
    return table.region_values(m)


def _region_levels(
    table: TableHandle,
    region_id: uuid.UUID,
    m: pb.ShardManifest,
    values: tuple[Any, ...] | None,
    merged: dict[uuid.UUID, int],
    memtables: dict[uuid.UUID, list[MemTableSnapshot]],
) -> RegionLevels:
    """A region's levels, newest first: the writer's MemTables, then its unmerged generations; its
    merged generations that the manifest still lists go to `merged` (catch-up plans read them)."""
    floor = merged.get(region_id, 0)
    levels: list[Level] = [
        MemTableLevel(region_id, mt.generation, table.storage, mt)
        for mt in reversed(memtables.get(region_id, []))
    ]
    flushed = [
        GenerationLevel(region_id, s.generation, table.storage, layout.generation_path(region_id, s.path))
        for s in sorted(m.sstables, key=lambda s: -s.generation)
    ]
    levels += [lv for lv in flushed if lv.generation > floor]
    done = [lv for lv in flushed if lv.generation <= floor]
    return RegionLevels(region_id, m.shard_spec_id, values, levels, done)


def region_writer_snapshot(
    table: TableHandle, region_id: uuid.UUID, manifest: pb.ShardManifest, held: Collection[int]
) -> ReadSnapshot:
    """One region's stored levels as its writer sees them, for the writer's own lookups: the base
    table's open version and the generations `manifest` lists that version has not merged, except the
    `held` ones (generations whose rows the writer holds in memory and asks there). The MemWAL index
    details are read before the dataset: a concurrent `refresh` replaces the dataset first, so the
    details are never newer than the base (newer ones would skip generations whose rows that base
    lacks)."""
    details = table.details
    base = table.dataset
    region = _region_levels(table, region_id, manifest, None, memwal_index.merged_generations(details), {})
    region.levels = [lv for lv in region.levels if lv.generation not in held]
    return ReadSnapshot(table.schema, base, details, [region], "latest", table.storage)


def _region_writers(writer: TableWriter | RegionWriter | None) -> list[RegionWriter]:
    if writer is None:
        return []
    region_writers = getattr(writer, "writers", None)
    return list(region_writers.values()) if region_writers is not None else [writer]  # type: ignore[list-item]


def _writer_memtables(
    writer: TableWriter | RegionWriter | None, wanted: Callable[[int, Any], bool] | None = None
) -> dict[uuid.UUID, list[MemTableSnapshot]]:
    """The newest rows of each unflushed MemTable of the writer, per region, oldest first;
    only of the regions `wanted` (a `_region_selector` test) accepts, when given."""
    return {
        w.region_id: w.memtable_snapshot()
        for w in _region_writers(writer)
        if wanted is None or wanted(w.manifest.shard_spec_id, w.ctx.region_values)
    }


def _writer_manifests(writer: TableWriter | RegionWriter | None) -> list[pb.ShardManifest]:
    """The latest manifest each of the writer's region writers committed or loaded."""
    return [w.manifest for w in _region_writers(writer)]


@dataclass(frozen=True)
class PinnedSnapshot:
    """A durable-levels snapshot as plain data (picklable), to plan the same query in other
    processes: the base version and, per region, (region id, spec id, values, unmerged generations
    newest first, merged generations still listed), each generation as (number, path)."""

    base_version: int
    regions: tuple[
        tuple[
            uuid.UUID, int, tuple[Any, ...] | None, tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]
        ],
        ...,
    ]


def pin(snapshot: ReadSnapshot) -> PinnedSnapshot:
    """`snapshot` as plain data; MemTable levels cannot be pinned (they live in one process).
    Unreadable regions are left out: plan the snapshot first, which raises for one the query needs."""

    def gens(levels: Sequence[Level]) -> tuple[tuple[int, str], ...]:
        generations = [lv for lv in levels if isinstance(lv, GenerationLevel)]
        if len(generations) != len(levels):
            raise InvalidConfigError("a snapshot with MemTable levels cannot be pinned")
        return tuple((lv.generation, lv.path) for lv in generations)

    return PinnedSnapshot(
        snapshot.base.version,
        tuple((r.region_id, r.spec_id, r.values, gens(r.levels), gens(r.merged)) for r in snapshot.regions),
    )


def restore(table: TableHandle, pinned: PinnedSnapshot) -> ReadSnapshot:
    """The `ReadSnapshot` that `pin` described, opened through `table` (same table, any process)."""
    table.sync()
    if table.dataset.version == pinned.base_version:
        base, details = table.dataset, table.details
    else:
        options = table.storage_options or None
        session = table.dataset.session()  # Lance's index and metadata caches, shared with the latest version
        base = lance.dataset(table.uri, version=pinned.base_version, storage_options=options, session=session)
        found = memwal_index.read_details(table.uri, options, version=pinned.base_version)
        if found is None:
            raise InvalidConfigError(f"base version {pinned.base_version} has no MemWAL index")
        details = found[0]

    def levels(region_id: uuid.UUID, gens: tuple[tuple[int, str], ...]) -> list[GenerationLevel]:
        return [GenerationLevel(region_id, g, table.storage, p) for g, p in gens]

    regions = [
        RegionLevels(rid, spec_id, values, [*levels(rid, unmerged)], levels(rid, merged))
        for rid, spec_id, values, unmerged, merged in pinned.regions
    ]
    return ReadSnapshot(table.schema, base, details, regions, "latest", table.storage)
