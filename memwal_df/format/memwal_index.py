"""The MemWAL index of a base table: the `__lance_mem_wal` entry of its Lance manifest.

Lance 14 keeps the whole index inline in the manifest's IndexSection: an `IndexMetadata` named
`__lance_mem_wal` with no fields, no files, no fragment bitmap, `index_version = 0`, `created_at` in
milliseconds and `index_details = Any{"/lance.table.MemWalIndexDetails", MemWalIndexDetails}`. Every
rewrite gives the entry a new uuid and sets `dataset_version` to the version being committed (at
creation native uses the read version instead).

Lance's Python API hides `compacted_sstables` (merge progress) and `index_catchup`, so this module
reads the manifest file itself:

    manifest file = ... | IndexSection at s | ... | Manifest at p | u64 p | u16 major | u16 minor | "LANC"
    at p: u32 length + Manifest message; Manifest.index_section (tag 6) = s
    at s: u32 length + IndexSection message

Writes go through Lance's own commit path (`initialize_mem_wal`, or `LanceDataset.commit` with a
`CreateIndex` operation) so that Lance's conflict detection and version hints stay in charge.
"""

from __future__ import annotations

import datetime as _dt
import re
import struct
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lance
import lance.commit
import pyarrow as pa
from google.protobuf.message import DecodeError
from lance.dataset import Index, LanceOperation

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    InvalidConfigError,
    InvalidRegionSpecError,
    NotFoundError,
    SchemaMismatchError,
    TableExistsError,
    TableNotFoundError,
)
from memwal_df.format import entry_lease
from memwal_df.format.open_storage import open_storage
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.region_spec import RegionSpec, check_key_only
from memwal_df.format.storage import Storage

MEMWAL_INDEX_NAME = "__lance_mem_wal"
DETAILS_TYPE_URL = "/lance.table.MemWalIndexDetails"
PRIMARY_KEY_METADATA = "lance-schema:unenforced-primary-key"
PRIMARY_KEY_POSITION_METADATA = "lance-schema:unenforced-primary-key:position"

ManifestNaming = Literal["v1", "v2"]
"""`v1`: `_versions/{v}.manifest`; `v2` (Lance's default): `_versions/{u64::MAX - v:020}.manifest`."""

VERSIONS_DIR = "_versions"

_U64_MAX = (1 << 64) - 1
_DETACHED_BIT = 1 << 63  # Lance's detached versions have the top bit set; they are never "latest".
_FOOTER = struct.Struct("<QHH4s")
_MAGIC = b"LANC"
_MANIFEST_NAME = re.compile(r"^(\d+)\.manifest$")
_MAX_REPAIRS = 5

# ------------------------------------------------------------------------------------------------
# Primary key metadata

_TRUTHY = frozenset({"true", "1", "yes", "y", "on"})  # Lance's str_is_truthy, case-insensitive, untrimmed
_U32_TEXT = re.compile(r"\+?[0-9]+")  # what Rust's `str::parse::<u32>` accepts (range checked apart)
_PK_KEY = PRIMARY_KEY_METADATA.encode()
_PK_POS_KEY = PRIMARY_KEY_POSITION_METADATA.encode()


def _pk_mark(field: pa.Field) -> tuple[bool, int | None]:
    """(is part of the key, 1-based position or None), read the way Lance 14 reads field metadata.

    A position that parses as a u32 marks the field by itself ("0" marks it without a position);
    otherwise the boolean key must be truthy (true/1/yes/y/on, any case) and the position is None.
    """
    md = field.metadata or {}
    raw_pos = md.get(_PK_POS_KEY)
    if raw_pos is not None:
        text = raw_pos.decode("utf-8", "replace")
        if _U32_TEXT.fullmatch(text) and int(text) <= 0xFFFFFFFF:
            pos = int(text)
            return True, (pos if pos > 0 else None)
    flag = md.get(_PK_KEY)
    return flag is not None and flag.decode("utf-8", "replace").lower() in _TRUTHY, None


def primary_key(schema: pa.Schema) -> list[str]:
    """The primary-key columns of `schema`, in key order, as Lance 14 orders them.

    Fields with a position come first, by position (ties by field order); fields marked only by
    the boolean key follow in field-id order, which for a schema without `lance:field_id`s is the
    depth-first field order. Struct children are named by their dotted path (`"s.x"`). Empty when
    the schema has no primary key.
    """
    found: list[tuple[tuple[int, int, int], str]] = []  # (sort key, dotted name)
    order = 0

    def visit(field: pa.Field, path: str) -> None:
        nonlocal order
        name = f"{path}.{field.name}" if path else field.name
        this = order
        order += 1
        is_pk, pos = _pk_mark(field)
        if is_pk:
            found.append(((0, pos, this) if pos is not None else (1, this, this), name))
        if pa.types.is_struct(field.type):
            for i in range(field.type.num_fields):
                visit(field.type.field(i), name)

    for f in schema:
        visit(f, "")
    found.sort(key=lambda item: item[0])
    return [name for _, name in found]


def with_primary_key(schema: pa.Schema, columns: Sequence[str]) -> pa.Schema:
    """`schema` with exactly `columns` as its primary key, in that order.

    Each key column gets `lance-schema:unenforced-primary-key = "true"` (so readers that predate
    positions still see it) and `...:position = "1"`, `"2"`, ... (1-based, Lance 14's composite-key
    order). Lance refuses a nullable key column or key ancestor, so those become non-nullable. Key
    marks on other columns are removed. Struct children are addressed by dotted path. Raises
    `SchemaMismatchError` for an empty, duplicated, unknown or non-leaf (struct/list/map) column.
    """
    cols = list(columns)
    if not cols:
        raise SchemaMismatchError("a primary key needs at least one column")
    if len(set(cols)) != len(cols):
        raise SchemaMismatchError(f"duplicate primary key column in {cols}")
    positions = {c: i + 1 for i, c in enumerate(cols)}
    seen: set[str] = set()

    def rebuild(field: pa.Field, path: str) -> tuple[pa.Field, bool]:
        name = f"{path}.{field.name}" if path else field.name
        md = {k: v for k, v in (field.metadata or {}).items() if k not in (_PK_KEY, _PK_POS_KEY)}
        ftype, nullable, holds_key = field.type, field.nullable, False
        if pa.types.is_struct(ftype):
            children = [rebuild(ftype.field(i), name) for i in range(ftype.num_fields)]
            ftype = pa.struct([child for child, _ in children])
            holds_key = any(h for _, h in children)
        if name in positions:
            if pa.types.is_nested(ftype):
                raise SchemaMismatchError(f"primary key column {name!r} must be a leaf, not {ftype}")
            md[_PK_KEY] = b"true"
            md[_PK_POS_KEY] = str(positions[name]).encode()
            seen.add(name)
            holds_key = True
        if holds_key:
            nullable = False
        return pa.field(field.name, ftype, nullable, metadata=md or None), holds_key

    fields = [rebuild(f, "")[0] for f in schema]
    missing = [c for c in cols if c not in seen]
    if missing:
        raise SchemaMismatchError(f"primary key columns not in the schema: {missing}")
    return pa.schema(fields, metadata=schema.metadata)


# ------------------------------------------------------------------------------------------------
# Reading the base table's manifest


def manifest_path(version: int, naming: ManifestNaming = "v2") -> str:
    """Path of a base-table manifest relative to the table root, in `naming`'s scheme."""
    if not 0 <= version <= _U64_MAX:
        raise ValueError(f"version {version} does not fit in a u64")
    if naming == "v2":
        return f"{VERSIONS_DIR}/{_U64_MAX - version:020d}.manifest"
    if naming == "v1":
        return f"{VERSIONS_DIR}/{version}.manifest"
    raise ValueError(f"unknown manifest naming {naming!r}")


def _parse_manifest_name(name: str) -> tuple[int, ManifestNaming] | None:
    """(version, naming) of a `_versions/` file name; V2 names are always 20 zero-padded digits."""
    m = _MANIFEST_NAME.match(name.rsplit("/", 1)[-1])
    if m is None:
        return None
    digits = m.group(1)
    if len(digits) == 20:
        n = int(digits)
        return (_U64_MAX - n, "v2") if n <= _U64_MAX else None
    return int(digits), "v1"


def latest_version(storage: Storage) -> int:
    """The table's latest version: the newest manifest a listing of `_versions/` finds (detached
    versions excluded). Always a listing: no hint or probe past a known version can prove "latest",
    since version cleanup deletes old versions (a missing version + 1 among them) while newer ones
    exist. Raises `TableNotFoundError` when there is no manifest."""
    try:
        names = storage.list_dir(VERSIONS_DIR)
    except NotFoundError:
        names = []
    versions = [
        parsed[0]
        for name in names
        if (parsed := _parse_manifest_name(name)) is not None and not parsed[0] & _DETACHED_BIT
    ]
    if not versions:
        raise TableNotFoundError(f"no Lance table (no manifest under {VERSIONS_DIR}/) at {storage.uri}")
    return max(versions)


def _message_at(data: bytes, offset: int, cls: Any, path: str, what: str) -> Any:
    """The u32-length-prefixed protobuf message `cls` at `offset` of a manifest file."""
    limit = len(data) - _FOOTER.size
    if offset < 0 or offset + 4 > limit:
        raise CorruptManifestError(f"{what} offset {offset} outside the manifest", path)
    (length,) = struct.unpack_from("<I", data, offset)
    if offset + 4 + length > limit:
        raise CorruptManifestError(f"{what} of {length} bytes at {offset} runs past the footer", path)
    msg = cls()
    try:
        msg.ParseFromString(data[offset + 4 : offset + 4 + length])
    except DecodeError as e:
        raise CorruptManifestError(f"undecodable {what}: {e}", path) from e
    return msg


def _read_index_section(storage: Storage, version: int | None) -> tuple[int, str, list[pb.IndexMetadata]]:
    if version is None:
        version = latest_version(storage)
    for naming in ("v2", "v1"):
        path = manifest_path(version, naming)
        try:
            data = storage.get(path)
            break
        except NotFoundError:
            continue
    else:
        raise TableNotFoundError(f"version {version} of the table at {storage.uri} does not exist")
    if len(data) < _FOOTER.size:
        raise CorruptManifestError("file shorter than the manifest footer", path)
    manifest_pos, _major, _minor, magic = _FOOTER.unpack_from(data, len(data) - _FOOTER.size)
    if magic != _MAGIC:
        raise CorruptManifestError(f"bad magic {magic!r}, not a Lance manifest", path)
    manifest: pb.Manifest = _message_at(data, manifest_pos, pb.Manifest, path, "manifest")
    if manifest.version != version:
        raise CorruptManifestError(f"manifest says version {manifest.version}, file name {version}", path)
    if not manifest.HasField("index_section"):
        return version, path, []
    section: pb.IndexSection = _message_at(
        data, manifest.index_section, pb.IndexSection, path, "index section"
    )
    return version, path, list(section.indices)


def read_index_section(storage: Storage, version: int | None = None) -> tuple[int, list[pb.IndexMetadata]]:
    """(version, IndexSection entries) of the base table at `version` (None: latest, see `latest_version`).

    A manifest without an index section gives `[]`. Raises `TableNotFoundError` when the version does
    not exist and `CorruptManifestError` when the file cannot be decoded.
    """
    version, _, indices = _read_index_section(storage, version)
    return version, indices


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
    version, path, indices = _read_index_section(storage, version)
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

# Native writer-config defaults, materialised as a whole when any writer kwarg is given.
_WRITER_INT_KEYS = (
    "max_wal_buffer_size",
    "max_wal_flush_interval_ms",
    "max_memtable_size",
    "max_memtable_rows",
    "max_memtable_batches",
    "max_unflushed_memtable_bytes",
    "manifest_scan_batch_size",
    "backpressure_log_interval_ms",
    "stats_log_interval_ms",
)
_WRITER_FIXED = {
    "max_wal_persist_retries": "3",
    "wal_persist_retry_base_delay_ms": "50",
    "enable_memtable": "true",
}
_HNSW_KEYS = ("num_edges", "ef_construction", "max_level")
_BOOL_TEXT = {"true": True, "false": False}

# Native bucket sharding accepts these Arrow types; identity sharding these, with this result type.
_BUCKET_TYPES: tuple[Callable[[pa.DataType], bool], ...] = (
    pa.types.is_boolean,
    pa.types.is_integer,
    pa.types.is_float32,
    pa.types.is_float64,
    pa.types.is_date32,
    pa.types.is_time32,
    pa.types.is_time64,
    pa.types.is_timestamp,
    pa.types.is_string,
    pa.types.is_large_string,
)
_IDENTITY_RESULT_TYPES = {
    pa.int8(): "int8",
    pa.int16(): "int16",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.uint8(): "uint8",
    pa.uint16(): "uint16",
    pa.uint32(): "uint32",
    pa.uint64(): "uint64",
    pa.string(): "utf8",
    pa.large_string(): "large_utf8",
    pa.bool_(): "boolean",
}
_TRANSFORMS = frozenset(
    {"identity", "year", "month", "day", "hour", "bucket", "multi_bucket", "truncate", "unsharded"}
)


def _canonical_uint(text: str) -> int | None:
    return int(text) if re.fullmatch(r"0|[1-9][0-9]{0,18}", text) and int(text) < 1 << 63 else None


def _native_writer_kwargs(defaults: dict[str, str]) -> dict[str, Any] | None:
    """Writer kwargs of `initialize_mem_wal` that materialise exactly `defaults`, or None."""
    if not defaults:
        return {}
    kwargs: dict[str, Any] = {}
    rest = dict(defaults)
    for key, value in _WRITER_FIXED.items():
        if rest.pop(key, None) != value:
            return None
    durable = _BOOL_TEXT.get(rest.pop("durable_write", ""))
    if durable is None:
        return None
    kwargs["durable_write"] = durable
    for key in _WRITER_INT_KEYS:
        text = rest.pop(key, None)
        if text is None:
            if key != "stats_log_interval_ms":  # native stores a 0 interval as an absent key
                return None
            kwargs[key] = 0
            continue
        value = _canonical_uint(text)
        if value is None or (key == "stats_log_interval_ms" and value == 0):
            return None
        kwargs[key] = value
    hnsw: dict[str, dict[str, int]] = {}
    for key, text in rest.items():
        if not key.startswith("hnsw."):
            return None
        index_name, _, param = key[len("hnsw.") :].rpartition(".")
        value = _canonical_uint(text)
        if not index_name or param not in _HNSW_KEYS or value is None:
            return None
        hnsw.setdefault(index_name, {})[param] = value
    if any(len(params) != len(_HNSW_KEYS) for params in hnsw.values()):
        return None
    if hnsw:
        kwargs["hnsw_params"] = hnsw
    return kwargs


def _native_init_kwargs(
    details: pb.MemWalIndexDetails, schema: pa.Schema, ids: dict[int, str]
) -> dict[str, Any] | None:
    """Arguments of `LanceDataset.initialize_mem_wal` that write exactly `details`, or None when
    native cannot express them. `ids` maps top-level Lance field ids to column names."""
    if (
        details.snapshot_ts_millis
        or details.HasField("inline_snapshots")
        or details.compacted_sstables
        or details.index_catchup
        or not details.HasField("maintain_all_indexes")
    ):
        return None
    kwargs: dict[str, Any] = {}
    if details.maintain_all_indexes:
        if details.maintained_indexes:
            return None
    else:
        kwargs["maintained_indexes"] = list(details.maintained_indexes)

    specs = details.sharding_specs
    if not specs:
        if details.num_shards:
            return None
    else:
        if len(specs) != 1 or specs[0].spec_id != 1 or len(specs[0].fields) != 1:
            return None
        f = specs[0].fields[0]
        if f.field_id != "bucket" or f.HasField("expression") or not f.HasField("transform"):
            return None
        params = dict(f.parameters)
        column = ids.get(f.source_ids[0]) if len(f.source_ids) == 1 else None
        ctype = schema.field(column).type if column is not None else None
        if f.transform == "unsharded":
            if f.source_ids or params or f.result_type != "int32" or details.num_shards != 1:
                return None
            kwargs["unsharded"] = True
        elif f.transform == "bucket":
            n = _canonical_uint(params.get("num_buckets", ""))
            if (
                ctype is None
                or not any(ok(ctype) for ok in _BUCKET_TYPES)
                or set(params) != {"num_buckets"}
                or n is None
                or not 1 <= n <= 1024
                or f.result_type != "int32"
                or details.num_shards != n
            ):
                return None
            kwargs["bucket_column"], kwargs["num_buckets"] = column, n
        elif f.transform == "identity":
            if (
                ctype is None
                or params
                or details.num_shards
                or f.result_type != _IDENTITY_RESULT_TYPES.get(ctype)
            ):
                return None
            kwargs["identity_column"] = column
        else:
            return None

    writer = _native_writer_kwargs(dict(details.writer_config_defaults))
    if writer is None:
        return None
    return kwargs | writer


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
    """Commit a `CreateIndex` that puts `details` in a fresh MemWAL entry; returns the new version."""
    new = Index(
        uuid=str(uuid.uuid4()),
        name=MEMWAL_INDEX_NAME,
        fields=[],
        dataset_version=dataset_version,
        fragment_ids=set(),  # pylance cannot omit the bitmap: it writes an empty one (8 bytes)
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
            fragment_ids=set(),
            index_version=m.index_version,
        )
        for m in removed
    ]
    try:
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
    kwargs = _native_init_kwargs(details, ds.schema, top_ids)
    if kwargs is None:
        _commit_details(uri, details, version, version, [], storage_options)
        return
    try:
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
    progress than the version before it (see `memwal_df/entry_lease.py`). Each call commits two
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
