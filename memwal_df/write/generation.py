"""Flushed generations: a sealed MemTable written as a Lance table at `_mem_wal/{region}/{hex8}_gen_{g}/`.

The table has the base schema plus `_tombstone: bool not null`, one fragment, the base table's data
storage version and V2 manifest naming. Beside it: `bloom_filter.bin` (every key of the MemTable) and
`_pk_index/` (the primary-key sidecar Lance's readers use); in `_indices/`, the maintained indexes
(`memwal_df.write.generation_indexes`: built by Lance on the generation with the base index's
centroids, codebook
and tokenizer, one dataset version each, as Lance's own flush builds every maintained index inside the
generation). Written last, `_memwal_checksums.json` records the size and checksum of every other file
(`memwal_df.format.checksums`; Lance ignores it). memwal_df writes only the newest row of
each key (tombstones included), in forward write order, so a generation never needs a deletion
vector; Lance writes every row and hides older duplicates with one — both read the same.

Field ids: Lance's LSM readers project a generation by the *base table's* field ids, so a generation
must carry them (plus `_tombstone` = max id + 1), as Lance's own flush does. A new Lance dataset gets
ids 0, 1, 2 ... in pre-order, which equals the base's ids until a column is dropped (ids are never
reused). When they differ, the directory is written in two versions: an empty v1, then an Overwrite
that commits the table's `LanceSchema` with the data file columns mapped to its ids (Lance renumbers
the schema of a dataset's first version, so v1 cannot carry them).

Guarantees: `write_generation` either returns the `SsTable` entry of a complete directory (indexes
included, synced) or raises;
a directory it leaves behind after a failure is never referenced by a manifest (the caller retries in
a new directory with a new random prefix).
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import wait
from typing import Any, cast

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError
from memwal_df.format import layout
from memwal_df.format.checksums import verify_generation_once, write_checksums
from memwal_df.format.maintained_indexes import MaintainedIndex
from memwal_df.format.pk_index import write_pk_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.rows import FIELD_ID_KEY, TOMBSTONE
from memwal_df.format.storage import Storage
from memwal_df.format.wire import encode_varint, read_varint
from memwal_df.pools import shared_pool
from memwal_df.write.generation_indexes import write_generation_indexes
from memwal_df.write.memtable import MemTable

# Lance writes generations with usize::MAX rows per file: one fragment whatever the size. From Python
# the limit must stay below 2**32: pylance 14 given 1 << 62 (or 2**32, 2**33 + 5 ...) starts a new
# fragment at input batch boundaries, and `_pk_index` row ids assume a single fragment 0.
_ONE_FRAGMENT = (1 << 31) - 1
_SIDECAR_THREADS = 4  # generations whose bloom filter and pk index are written at once


def primary_key_bytes(table: pa.Table, primary_key: Sequence[str]) -> int:
    """Lance's `primary_key_bytes` statistic: width × rows for fixed-width key columns,
    Σ len(value) + 4 × rows for strings and binaries."""
    total = 0
    for name in primary_key:
        col = table.column(name)
        t = col.type
        if (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
        ):
            lengths = pc.binary_length(col)
            total += int(pc.sum(lengths).as_py() or 0) + 4 * len(col)
        else:
            total += (t.bit_width // 8) * len(col)
    return total


def write_generation(
    storage: Storage,
    region_id: uuid.UUID,
    memtable: MemTable,
    data_storage_version: str,
    indexes: Sequence[MaintainedIndex] = (),
) -> pb.SsTable:
    """Write `memtable` as a new generation directory with its maintained `indexes` and return its
    manifest entry.

    The bloom filter and the `_pk_index` files are written on another thread while pylance writes the
    data (it releases the GIL); the maintained indexes, built on the written dataset, follow; then
    the checksum sidecar of every file, and one concurrent fsync pass over the directory."""
    data = memtable.newest()
    dir_name = layout.generation_dir_name(secrets.token_hex(4), memtable.generation)
    rel = layout.generation_path(region_id, dir_name)
    uri = storage.child_uri(rel)
    options = storage.storage_options or None

    def sidecars() -> None:
        storage.put(f"{rel}/{layout.BLOOM_FILTER_FILE}", memtable.bloom.to_bytes())
        write_pk_index(uri, [data.column(c) for c in memtable.primary_key], options)

    side = shared_pool("generation", _SIDECAR_THREADS).submit(sidecars)
    try:
        ids = table_field_ids(data.schema, storage)
        if ids is None:
            lance.write_dataset(
                data,
                uri,
                mode="create",
                # the base table's own `data_storage_version`: Lance reads it as `str`, takes a literal
                data_storage_version=cast(Any, data_storage_version),
                max_rows_per_file=_ONE_FRAGMENT,
                storage_options=options,
            )
        else:
            _write_with_field_ids(data, uri, ids, data_storage_version, options)
    finally:
        wait([side])  # never leave a sidecar writing into a directory the caller may retry beside
    side.result()
    write_generation_indexes(uri, indexes, options)
    write_checksums(storage, rel)  # last: it lists every other file of the directory
    storage.sync_tree(rel)  # durable before any manifest names it
    return pb.SsTable(
        generation=memtable.generation,
        path=dir_name,
        in_memory_bytes=memtable.nbytes,
        physical_rows=data.num_rows,
        primary_key_bytes=primary_key_bytes(data, memtable.primary_key),
    )


def open_generation(storage: Storage, region_id: uuid.UUID, sstable: pb.SsTable) -> lance.LanceDataset:
    """The Lance dataset of a flushed generation, its files verified once per process
    (`CorruptGenerationError` if one does not match); MissingGenerationError if its directory is gone."""
    rel = layout.generation_path(region_id, sstable.path)
    verify_generation_once(storage, region_id, sstable.generation, rel)  # (gone: the open below fails)
    try:
        return lance.dataset(storage.child_uri(rel), storage_options=storage.storage_options or None)
    except (ValueError, OSError) as e:
        raise MissingGenerationError(
            f"generation {sstable.generation} of region {region_id} is missing: {rel}"
        ) from e


def generation_memtable(
    storage: Storage, region_id: uuid.UUID, sstable: pb.SsTable, schema: pa.Schema, primary_key: Sequence[str]
) -> MemTable:
    """The rows of a flushed generation (`schema`: the region's WAL schema) as a sealed MemTable of its
    generation; `MissingGenerationError` if its directory or files are gone."""
    ds = open_generation(storage, region_id, sstable)
    try:
        rows = ds.to_table(columns=schema.names)
    except (OSError, ValueError) as e:
        raise MissingGenerationError(
            f"generation {sstable.generation} of region {region_id} cannot be read: {e}"
        ) from e
    memtable = MemTable(sstable.generation, schema, primary_key)
    for batch in rows.cast(schema).combine_chunks().to_batches():
        memtable.append(batch)
    memtable.seal()
    return memtable


# ------------------------------------------------------------------------------------------------
# Field ids


def _preorder(fields: Sequence[Any]) -> Iterator[Any]:
    for f in fields:
        yield f
        yield from _preorder(f.children())


def table_field_ids(schema: pa.Schema, storage: Storage) -> dict[int, int] | None:
    """Fresh Lance field id -> the table's field id, for a generation of `schema` (WAL schema: the
    table's columns with `lance:field_id` metadata, then `_tombstone`); None when they are equal.

    Top-level ids come from the metadata; nested ids from the base table's schema (the field with the
    same id), or, if the base no longer has it, at the same offsets from their top-level field as at
    creation. `_tombstone` gets the largest id + 1, as in Lance's own generations."""
    from lance.schema import LanceSchema

    fresh = LanceSchema.from_pyarrow(schema)
    top = [(f, schema.field(f.name())) for f in fresh.fields() if f.name() != TOMBSTONE]
    wanted = {}
    for lf, af in top:
        raw = (af.metadata or {}).get(FIELD_ID_KEY)
        if raw is None:
            return None  # no ids to honour (not a WAL schema)
        wanted[lf.id()] = int(raw)
    if all(fid == tid for fid, tid in wanted.items()):
        return None  # no column was ever dropped: pre-order ids are the table's ids
    try:
        base = lance.dataset(storage.uri, storage_options=storage.storage_options or None).lance_schema
        base_by_id = {f.id(): f for f in _preorder(base.fields())}
    except (OSError, ValueError):
        base_by_id = {}
    mapping: dict[int, int] = {}

    def assign(field: Any, target: int, base_field: Any) -> None:
        mapping[field.id()] = target
        same = base_field is not None and base_field.name() == field.name()
        base_children = {c.name(): c for c in base_field.children()} if same else {}
        for child in field.children():
            b = base_children.get(child.name())
            assign(child, b.id() if b is not None else target + child.id() - field.id(), b)

    for lf, _ in top:
        target = wanted[lf.id()]
        assign(lf, target, base_by_id.get(target))
    tombstone = next(f for f in fresh.fields() if f.name() == TOMBSTONE)
    mapping[tombstone.id()] = max(mapping.values()) + 1
    return mapping


def _with_ids(field_proto: bytes, field_id: int, parent_id: int) -> bytes:
    """A `lance.file.Field` message with `id` (tag 3) and `parent_id` (tag 4) replaced."""
    parts: list[tuple[int, bytes]] = []
    i = 0
    while i < len(field_proto):
        start = i
        key, i = read_varint(field_proto, i)
        wire = key & 7
        if wire == 0:
            _, i = read_varint(field_proto, i)
        elif wire == 2:
            length, i = read_varint(field_proto, i)
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a Lance field message")
        if key >> 3 not in (3, 4):
            parts.append((key >> 3, field_proto[start:i]))
    if field_id:
        parts.append((3, b"\x18" + encode_varint(field_id)))
    parts.append((4, b"\x20" + encode_varint(parent_id)))
    parts.sort(key=lambda p: p[0])
    return b"".join(p for _, p in parts)


def _lance_schema_with_ids(schema: pa.Schema, ids: dict[int, int]) -> Any:
    """`LanceSchema.from_pyarrow(schema)` with its field ids mapped through `ids` (via the
    `lance.file.Field` messages LanceSchema pickles to)."""
    from lance.schema import LanceSchema

    fresh = LanceSchema.from_pyarrow(schema)
    reduced = cast(tuple[Any, ...], fresh.__reduce__())  # a pickle tuple (never a global's name)
    rebuild, (metadata_json, *protos) = reduced
    fields = list(_preorder(fresh.fields()))
    if len(fields) != len(protos):
        raise RuntimeError("unexpected LanceSchema pickle layout")
    parents = {c.id(): f.id() for f in fields for c in f.children()}
    rewritten = [
        _with_ids(proto, ids[f.id()], ids[parents[f.id()]] if f.id() in parents else -1)
        for proto, f in zip(protos, fields, strict=True)
    ]
    return rebuild(metadata_json, *rewritten)


def _without_field_id(field: pa.Field) -> pa.Field:
    meta = {k: v for k, v in (field.metadata or {}).items() if k != FIELD_ID_KEY}
    return field.with_metadata(meta or None)


def _write_with_field_ids(
    data: pa.Table, uri: str, ids: dict[int, int], data_storage_version: str, options: dict | None
) -> None:
    from lance.fragment import FragmentMetadata, write_fragments

    # write_fragments honours `lance:field_id` metadata (numbering unlabelled fields after the
    # largest); without it, ids are the pre-order ones `ids` maps from.
    plain = pa.schema([_without_field_id(f) for f in data.schema], metadata=data.schema.metadata)
    data = pa.Table.from_arrays(data.columns, schema=plain)
    target = _lance_schema_with_ids(plain, ids)
    lance.write_dataset(
        data.schema.empty_table(),
        uri,
        mode="create",
        data_storage_version=cast(Any, data_storage_version),  # as in `write_generation`
        storage_options=options,
    )
    fragments = []
    for fragment in write_fragments(
        data,
        uri,
        mode="overwrite",
        max_rows_per_file=_ONE_FRAGMENT,
        data_storage_version=data_storage_version,
        storage_options=options,
    ):
        meta = fragment.to_json()
        for data_file in meta["files"]:
            data_file["fields"] = [ids.get(f, f) for f in data_file["fields"]]
        fragments.append(FragmentMetadata.from_json(json.dumps(meta)))
    ds = lance.LanceDataset.commit(
        uri, lance.LanceOperation.Overwrite(target, fragments), read_version=1, storage_options=options
    )
    got = {f.name(): f.id() for f in _preorder(ds.lance_schema.fields())}
    want = {f.name(): f.id() for f in _preorder(target.fields())}
    if got != want:
        raise RuntimeError(f"Lance renumbered the generation's field ids: {got} != {want}")
