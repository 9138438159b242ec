"""The MemWAL index of a base table: the `__lance_mem_wal` entry of its Lance manifest.

Lance 14 keeps the whole index inline in the manifest's IndexSection: an `IndexMetadata` named
`__lance_mem_wal` with no fields, no files, no fragment bitmap, `index_version = 0`, `created_at` in
milliseconds and `index_details = Any{"/lance.table.MemWalIndexDetails", MemWalIndexDetails}`. Every
rewrite gives the entry a new uuid and sets `dataset_version` to the version being committed (at
creation native uses the read version instead).

Lance's Python API hides `compacted_sstables` (merge progress) and `index_catchup`, so the details
are read from the manifest file itself (`base_manifest.read_index_section`).

Writes go through Lance's own commit path (`initialize_mem_wal`, or `LanceDataset.commit` with a
`CreateIndex` operation) so that Lance's conflict detection and version hints stay in charge.
"""

from __future__ import annotations

import datetime as _dt
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import lance
import lance.commit
from google.protobuf.message import DecodeError
from lance.dataset import Index, LanceOperation

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    InvalidConfigError,
    InvalidRegionSpecError,
    TableExistsError,
    TableNotFoundError,
)
from memwal_df.format import entry_lease, layout
from memwal_df.format.base_manifest import latest_version, primary_key, read_index_section_with_path
from memwal_df.format.native_init_kwargs import native_init_kwargs
from memwal_df.format.open_storage import open_storage
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec, check_key_only
from memwal_df.format.storage import Storage

MEMWAL_INDEX_NAME = "__lance_mem_wal"
DETAILS_TYPE_URL = "/lance.table.MemWalIndexDetails"
_MAX_REPAIRS = 5

# ------------------------------------------------------------------------------------------------
# Reading the details


def _find_details(
    indices: Sequence[pb.IndexMetadata], path: str
) -> tuple[pb.MemWalIndexDetails, pb.IndexMetadata] | None:
    entries = [i for i in indices if i.name == MEMWAL_INDEX_NAME]
    if not entries:
        return None
    if len(entries) > 1:
        raise CorruptManifestError(f"{len(entries)} {MEMWAL_INDEX_NAME} entries in one manifest", path)
    meta = entries[0]
    if meta.index_details.type_url != DETAILS_TYPE_URL:
        raise CorruptManifestError(
            f"{MEMWAL_INDEX_NAME} details of type {meta.index_details.type_url!r}, not {DETAILS_TYPE_URL}",
            path,
        )
    details = pb.MemWalIndexDetails()
    try:
        details.ParseFromString(meta.index_details.value)
    except DecodeError as e:
        raise CorruptManifestError(f"undecodable MemWalIndexDetails: {e}", path) from e
    return details, meta


def _details_at(
    storage: Storage, version: int | None
) -> tuple[int, tuple[pb.MemWalIndexDetails, pb.IndexMetadata] | None]:
    version, path, indices = read_index_section_with_path(storage, version)
    return version, _find_details(indices, path)


def read_details(
    uri: str, storage_options: dict[str, str] | None = None, version: int | None = None
) -> tuple[pb.MemWalIndexDetails, pb.IndexMetadata] | None:
    """(details, index entry) of the table's MemWAL index at `version` (None: latest), or None when
    the table has no MemWAL index. The entry's `index_details.value` holds the stored bytes."""
    return _details_at(open_storage(uri, storage_options), version)[1]


def merged_generations(details: pb.MemWalIndexDetails) -> dict[uuid.UUID, int]:
    """Region (shard) -> last generation merged into the base table (`compacted_sstables`)."""
    out: dict[uuid.UUID, int] = {}
    for c in details.compacted_sstables:
        shard = uuid.UUID(bytes=c.shard_id.uuid)
        out[shard] = max(out.get(shard, 0), c.generation)
    return out


def index_catchup(details: pb.MemWalIndexDetails) -> dict[str, dict[uuid.UUID, int]]:
    """Base index name -> (region -> last merged generation the index covers)."""
    out: dict[str, dict[uuid.UUID, int]] = {}
    for progress in details.index_catchup:
        per_region = out.setdefault(progress.index_name, {})
        for c in progress.caught_up_generations:
            shard = uuid.UUID(bytes=c.shard_id.uuid)
            per_region[shard] = max(per_region.get(shard, 0), c.generation)
    return out


def encode_details(details: pb.MemWalIndexDetails) -> bytes:
    """The details message as stored: fields in tag order (as prost writes them), map entries sorted
    by key. Native bytes equal these except for the order of `writer_config_defaults` entries, which
    native writes in Rust HashMap order."""
    return details.SerializeToString(deterministic=True)


# ------------------------------------------------------------------------------------------------
# Creating the index

_TRANSFORMS = frozenset(
    {"identity", "year", "month", "day", "hour", "bucket", "multi_bucket", "truncate", "unsharded"}
)


def _lance_field_ids(ds: lance.LanceDataset) -> tuple[dict[int, str], set[int]]:
    """(top-level field id -> name, every field id) of the dataset's Lance schema."""
    top = {f.id(): f.name() for f in ds.lance_schema.fields()}
    every: set[int] = set()
    stack = list(ds.lance_schema.fields())
    while stack:
        f = stack.pop()
        every.add(f.id())
        stack.extend(f.children())
    return top, every


def _validate(details: pb.MemWalIndexDetails, ds: lance.LanceDataset, field_ids: set[int]) -> None:
    """Structural checks of new details against the dataset (transform semantics are region_spec's)."""
    spec_ids: set[int] = set()
    for spec in details.sharding_specs:
        if spec.spec_id <= 0 or spec.spec_id in spec_ids:
            raise InvalidRegionSpecError(f"region spec ids must be positive and unique, got {spec.spec_id}")
        spec_ids.add(spec.spec_id)
        if not spec.fields:
            raise InvalidRegionSpecError(f"region spec {spec.spec_id} has no fields")
        names: set[str] = set()
        for f in spec.fields:
            if not f.field_id or f.field_id in names:
                raise InvalidRegionSpecError(
                    f"region field ids must be non-empty and unique, got {f.field_id!r}"
                )
            names.add(f.field_id)
            if f.HasField("transform") == f.HasField("expression"):
                raise InvalidRegionSpecError(
                    f"region field {f.field_id!r} needs exactly one of transform/expression"
                )
            if f.HasField("transform") and f.transform not in _TRANSFORMS:
                raise InvalidRegionSpecError(
                    f"region field {f.field_id!r}: unknown transform {f.transform!r}"
                )
            if not f.result_type:
                raise InvalidRegionSpecError(f"region field {f.field_id!r} has no result type")
            unknown = [i for i in f.source_ids if i not in field_ids]
            if unknown:
                raise InvalidRegionSpecError(f"region field {f.field_id!r}: no column has field id {unknown}")
            if not f.source_ids and f.transform != "unsharded":
                raise InvalidRegionSpecError(f"region field {f.field_id!r} has no source column")
    _check_new_specs(details, lambda: ds)
    existing = {i.name for i in ds.describe_indices()}
    missing = [n for n in details.maintained_indexes if n not in existing]
    if missing:
        raise InvalidConfigError(f"maintained_indexes names indexes the table does not have: {missing}")


def _check_new_specs(
    details: pb.MemWalIndexDetails,
    dataset: Callable[[], lance.LanceDataset],
    known: Sequence[pb.ShardingSpec] = (),
) -> None:
    """NonKeyRegionColumnError if a region spec of `details` that is not in `known` (one being added
    or changed) reads a column outside the primary key of the table (`dataset()`, opened only then):
    a key must map to exactly one region."""
    new = [s for s in details.sharding_specs if s not in known]
    if new:
        ds = dataset()
        top = {f.name(): f.id() for f in ds.lance_schema.fields()}
        for spec in new:
            check_key_only(RegionSpec.from_proto(spec), primary_key(ds.schema), top)


def _commit_details(
    uri: str,
    details: pb.MemWalIndexDetails,
    read_version: int,
    dataset_version: int,
    removed: Sequence[pb.IndexMetadata],
    storage_options: dict[str, str] | None,
) -> int:
    """Commit a `CreateIndex` that puts `details` in a fresh MemWAL entry; returns the new version,
    durable."""
    new = Index(
        uuid=str(uuid.uuid4()),
        name=MEMWAL_INDEX_NAME,
        fields=[],
        dataset_version=dataset_version,
        # pylance cannot omit the bitmap (it writes an empty one, 8 bytes); it takes a set where its
        # annotation names only `Bitmap`
        fragment_ids=set(),  # type: ignore[arg-type]
        index_version=0,
        created_at=_dt.datetime.now(_dt.UTC),
        index_details=(DETAILS_TYPE_URL, encode_details(details)),
    )
    gone = [
        Index(
            uuid=str(uuid.UUID(bytes=m.uuid.uuid)),
            name=m.name,
            fields=list(m.fields),
            dataset_version=m.dataset_version,
            fragment_ids=set(),  # type: ignore[arg-type]  # a set, as above
            index_version=m.index_version,
        )
        for m in removed
    ]
    try:
        with open_storage(uri, storage_options).synced_changes(skip=layout.NOT_BASE):
            ds = lance.LanceDataset.commit(
                uri,
                LanceOperation.CreateIndex(new_indices=[new], removed_indices=gone),
                read_version=read_version,
                storage_options=storage_options,
            )
    except lance.commit.CommitConflictError as e:
        raise CommitConflictError(f"MemWAL index commit on version {read_version} lost a race: {e}") from e
    return int(ds.version)


def initialize(
    uri: str, details: pb.MemWalIndexDetails, storage_options: dict[str, str] | None = None
) -> None:
    """Create the table's MemWAL index holding `details`.

    When native Lance can write the same details (bucket / identity / unsharded / no sharding, a
    maintained set or "all", writer defaults as native materialises them, nothing else) this calls
    `LanceDataset.initialize_mem_wal`, so the bytes are native's. Otherwise it commits a `CreateIndex`
    whose entry differs from native only by an empty 8-byte `fragment_bitmap` (pylance cannot omit
    it) and `writer_config_defaults` order. Either way the stored details equal `details` afterwards
    (if native ever wrote something else, a `replace_details` commit follows), except that Lance
    normalises `index_catchup` on commit (see `replace_details`).

    Raises `TableNotFoundError`, `TableExistsError` (already initialized), `InvalidRegionSpecError`
    (`NonKeyRegionColumnError` for a spec reading a column outside the primary key),
    `InvalidConfigError` (unknown maintained index) or `CommitConflictError` (a concurrent initialization).
    """
    storage = open_storage(uri, storage_options)
    latest_version(storage)  # TableNotFoundError before Lance's less specific error
    ds = lance.dataset(uri, storage_options=storage_options)
    version, existing = _details_at(storage, ds.version)
    if existing is not None:
        raise TableExistsError(f"the table at {uri} already has a MemWAL index (version {version})")
    top_ids, all_ids = _lance_field_ids(ds)
    _validate(details, ds, all_ids)
    kwargs = native_init_kwargs(details, ds.schema, top_ids)
    if kwargs is None:
        _commit_details(uri, details, version, version, [], storage_options)
        return
    try:
        with storage.synced_changes(skip=layout.NOT_BASE):
            ds.initialize_mem_wal(**kwargs)
    except (TypeError, OverflowError):  # a value pylance cannot convert; nothing was committed
        _commit_details(uri, details, version, version, [], storage_options)
        return
    except lance.commit.CommitConflictError as e:
        raise CommitConflictError(f"MemWAL initialization on version {version} lost a race: {e}") from e
    except OSError as e:
        if "already initialized" in str(e):
            raise TableExistsError(f"the table at {uri} already has a MemWAL index") from e
        if "Invalid user input" in str(e):  # e.g. a maintained index the MemWAL cannot maintain
            raise InvalidConfigError(f"Lance refused the MemWAL configuration: {e}") from e
        raise
    new_version, stored = _details_at(storage, int(ds.version))
    if stored is None or stored[0] != details:  # native wrote something else: store what was asked
        replace_details(uri, details, new_version, storage_options)


# ------------------------------------------------------------------------------------------------
# Replacing the details (index builder)

_CONFIG_FIELDS = (
    "snapshot_ts_millis",
    "num_shards",
    "inline_snapshots",
    "sharding_specs",
    "maintained_indexes",
    "writer_config_defaults",
    "maintain_all_indexes",
)


def _only(msg: pb.MemWalIndexDetails, name: str) -> pb.MemWalIndexDetails:
    part = pb.MemWalIndexDetails()
    part.CopyFrom(msg)
    for f in part.DESCRIPTOR.fields:
        if f.name != name:
            part.ClearField(f.name)
    return part


def _three_way(base: Any, ours: Any, theirs: Any) -> tuple[Any, bool]:
    """(merged value, conflict): the side that changed wins; a conflict keeps ours."""
    if ours == theirs or theirs == base:
        return ours, False
    if ours == base:
        return theirs, False
    return ours, True


def _merge_details(
    base: pb.MemWalIndexDetails,
    ours: pb.MemWalIndexDetails,
    theirs: pb.MemWalIndexDetails,
    prefer_theirs: bool,
) -> tuple[pb.MemWalIndexDetails, list[str]]:
    """Three-way merge of our new details and a concurrent writer's, both derived from `base`.

    Each configuration field, each region's `compacted_sstables` generation and each index's
    `index_catchup` entry is merged on its own: the side that changed it wins. When both changed a
    region's merged generation the larger one wins (merge progress only grows; a region one side
    removed and the other advanced stays). When both changed anything else differently it is a
    conflict, resolved for `theirs` if `prefer_theirs` else for `ours`. Returns (merged, conflicts).
    """
    merged = pb.MemWalIndexDetails()
    merged.CopyFrom(ours)
    conflicts: list[str] = []
    for name in _CONFIG_FIELDS:
        value, conflict = _three_way(_only(base, name), _only(ours, name), _only(theirs, name))
        if conflict:
            conflicts.append(name)
            if prefer_theirs:
                value = _only(theirs, name)
        merged.ClearField(name)
        merged.MergeFrom(value)

    b_gen, o_gen, t_gen = merged_generations(base), merged_generations(ours), merged_generations(theirs)
    merged.ClearField("compacted_sstables")
    for shard in list(t_gen) + [s for s in o_gen if s not in t_gen]:
        gen, conflict = _three_way(b_gen.get(shard), o_gen.get(shard), t_gen.get(shard))
        if conflict:
            gen = max(g for g in (o_gen.get(shard), t_gen.get(shard)) if g is not None)
        if gen is not None:
            merged.compacted_sstables.add(shard_id=pb.UUID(uuid=shard.bytes), generation=gen)

    b_idx, o_idx, t_idx = ({p.index_name: p for p in d.index_catchup} for d in (base, ours, theirs))
    merged.ClearField("index_catchup")
    for name in list(t_idx) + [n for n in o_idx if n not in t_idx]:
        progress, conflict = _three_way(b_idx.get(name), o_idx.get(name), t_idx.get(name))
        if conflict:
            conflicts.append(f"index_catchup[{name}]")
            if prefer_theirs:
                progress = t_idx.get(name)
        if progress is not None:
            merged.index_catchup.add().CopyFrom(progress)
    return merged, conflicts


def replace_details(
    uri: str,
    details: pb.MemWalIndexDetails,
    read_version: int,
    storage_options: dict[str, str] | None = None,
) -> int:
    """Commit `details`, derived from the index at `read_version`, as a new MemWAL entry (new uuid,
    `dataset_version` = the version committed); returns that version.

    The commit runs inside `entry_lease.exclusive` (lease + fence): no merge commit can land between
    our read of the latest details and our commit, so the committed version never shows less merge
    progress than the version before it (see `memwal_df/format/entry_lease.py`). Each call commits two
    versions: the fence, then the entry.

    Re-reads and merges, never blindly overwrites: if the table moved past `read_version`, our
    changes are three-way merged onto the latest details (see `_merge_details`: per field, per
    region's merged generation, per index's catch-up entry; concurrent merge progress is never
    lowered) and anything else both sides changed raises `CommitConflictError` before anything is
    written. Without concurrency `details` is committed as given (it may lower or drop entries).

    Lance still rebases our `CreateIndex` over commits the fence does not hold back (an index build,
    a merger's delete pass, or a writer that does not follow the lease protocol); what such a commit
    changed in the entry (catch-up recorded by an index build) is merged back in a repair commit. A
    conflicting change found only then is restored to the concurrent writer's value and reported
    with `CommitConflictError`. Two concurrent `replace_details` (or `initialize`) calls serialize
    on the lease. Raises `TableNotFoundError` when `read_version` or the latest version has no
    MemWAL index, and `NonKeyRegionColumnError` (nothing written) when a region spec that
    `read_version` does not have (a new or changed one) reads a column outside the primary key.

    Lance itself normalises `index_catchup` when it commits the entry: it keeps entries only for
    indexes the table has, clamps each region's generation to that region's `compacted_sstables`
    generation, and drops regions (and then entries) that are not compacted at all.
    """
    storage = open_storage(uri, storage_options)
    _, at_read = _details_at(storage, read_version)
    if at_read is None:
        raise TableNotFoundError(f"version {read_version} of {uri} has no MemWAL index")
    _check_new_specs(
        details,
        lambda: lance.dataset(uri, version=read_version, storage_options=storage_options),
        at_read[0].sharding_specs,
    )
    with entry_lease.exclusive(storage, uri, storage_options):
        return _replace_fenced(storage, uri, at_read[0], details, read_version, storage_options)


def _replace_fenced(
    storage: Storage,
    uri: str,
    at_read: pb.MemWalIndexDetails,
    details: pb.MemWalIndexDetails,
    read_version: int,
    storage_options: dict[str, str] | None,
) -> int:
    """`replace_details` once the lease is held and the fence committed."""
    version, current = _details_at(storage, None)
    if current is None:
        raise TableNotFoundError(f"the latest version ({version}) of {uri} has no MemWAL index")
    ours = details
    if version != read_version:
        ours, conflicts = _merge_details(at_read, details, current[0], prefer_theirs=False)
        if conflicts:
            raise CommitConflictError(
                f"MemWAL details changed concurrently since version {read_version}: {', '.join(conflicts)}"
            )
    lost: list[str] = []
    for _ in range(_MAX_REPAIRS):
        committed = _commit_details(uri, ours, version, version + 1, [current[1]], storage_options)
        if committed == version + 1:
            break
        _, replaced = _details_at(storage, committed - 1)  # the state our rebased commit replaced
        if replaced is None:
            raise CommitConflictError(f"the MemWAL index was dropped concurrently before version {committed}")
        fixed, conflicts = _merge_details(current[0], ours, replaced[0], prefer_theirs=True)
        lost += conflicts
        if fixed == ours:
            break
        _, mine = _details_at(storage, committed)
        if mine is None:
            raise CommitConflictError(f"the MemWAL index vanished at version {committed}")
        version, current, ours = committed, mine, fixed
    else:
        raise CommitConflictError(
            f"MemWAL details kept changing concurrently; gave up at version {committed}"
        )
    if lost:
        raise CommitConflictError(
            f"concurrent MemWAL changes to {', '.join(lost)} were kept instead of ours (version {committed})"
        )
    return committed
