"""The base table's Lance manifest, as memwal_df reads it: the primary key marked in the schema, the
manifest files under `_versions/` (paths, naming, latest version) and the manifest's IndexSection.

Lance's Python API hides parts of the IndexSection (the MemWAL entry's merge progress), so this
module reads the manifest file itself:

    manifest file = ... | IndexSection at s | ... | Manifest at p | u64 p | u16 major | u16 minor | "LANC"
    at p: u32 length + Manifest message; Manifest.index_section (tag 6) = s
    at s: u32 length + IndexSection message
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import Any, Literal

import pyarrow as pa
from google.protobuf.message import DecodeError

from memwal_df.errors import CorruptManifestError, NotFoundError, SchemaMismatchError, TableNotFoundError
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage

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


def read_index_section_with_path(
    storage: Storage, version: int | None
) -> tuple[int, str, list[pb.IndexMetadata]]:
    """`read_index_section` with the path of the manifest file read, for errors that name it."""
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
    version, _, indices = read_index_section_with_path(storage, version)
    return version, indices
