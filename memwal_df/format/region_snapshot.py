"""Region snapshots: every region's manifest state in one Lance file (spec "Region Snapshot Storage").

One row per region, the spec's "Region Snapshot Arrow Schema": `region_id` (16 UUID bytes),
`version`, `region_spec_id`, `writer_epoch`, `replay_after_wal_entry_position`,
`wal_entry_position_last_seen`, `current_generation`, `flushed_generations`
(`list<struct<generation, path>>`) and one `region_field_{field_id}` column per region field of the
table's specs, typed by the field's result type.

Where the snapshot lives (fields of `MemWalIndexDetails`):
- `snapshot_ts_millis` > 0 means a snapshot exists; it was taken at that time.
- `inline_snapshots` present: the Lance file's bytes are inline (at most `INLINE_THRESHOLD` regions).
- otherwise the file is `_indices/{snapshot_uuid(snapshot_ts_millis)}/index.lance`.
Field 2 stays Lance 14's `num_shards` (its bucket count), not the spec's `num_regions`.

Guarantees: `decode(encode(ms, specs), specs)` gives back each manifest's region id, version, spec id,
epoch, WAL positions, current generation, flushed generations (generation and path; the optional
SsTable statistics are not stored) and region field entries. A region whose field entries cannot be
represented in the columns (a field id shared by two specs with different result types, or a spec the
table no longer has) gets NULL in every region field column, which reads back as "values unknown":
such a region is never pruned.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import Sequence

import lance.file
import pyarrow as pa

from memwal_df.errors import NotFoundError
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.regions.values import decode_region_value, encode_region_value, result_arrow_type
from memwal_df.format.storage import Storage

INLINE_THRESHOLD = 100
"""Snapshots of at most this many regions are stored inline in the index details."""

INDICES_DIR = "_indices"
SNAPSHOT_FILE = "index.lance"
FIELD_PREFIX = "region_field_"

_GENERATION = pa.struct([pa.field("generation", pa.uint64()), pa.field("path", pa.string())])
BASE_SCHEMA = pa.schema(
    [
        pa.field("region_id", pa.binary(16), nullable=False),
        pa.field("version", pa.uint64(), nullable=False),
        pa.field("region_spec_id", pa.uint32(), nullable=False),
        pa.field("writer_epoch", pa.uint64(), nullable=False),
        pa.field("replay_after_wal_entry_position", pa.uint64(), nullable=False),
        pa.field("wal_entry_position_last_seen", pa.uint64(), nullable=False),
        pa.field("current_generation", pa.uint64(), nullable=False),
        pa.field("flushed_generations", pa.list_(_GENERATION), nullable=False),
    ]
)
_MANIFEST_FIELDS = {  # snapshot column -> ShardManifest field (Lance 14's names)
    "version": "version",
    "region_spec_id": "shard_spec_id",
    "writer_epoch": "writer_epoch",
    "replay_after_wal_entry_position": "replay_after_wal_entry_position",
    "wal_entry_position_last_seen": "wal_entry_position_last_seen",
    "current_generation": "current_generation",
}


def region_field_types(specs: dict[int, RegionSpec]) -> dict[str, pa.DataType]:
    """Region field id -> column type; the newest spec defines the type of a field id used twice."""
    types: dict[str, pa.DataType] = {}
    for spec_id in sorted(specs, reverse=True):
        for f in specs[spec_id].fields:
            types.setdefault(f.field_id, result_arrow_type(f.result_type))
    return types


def snapshot_schema(specs: dict[int, RegionSpec]) -> pa.Schema:
    """The spec's region snapshot schema for a table with these region specs."""
    fields = [pa.field(FIELD_PREFIX + fid, t) for fid, t in region_field_types(specs).items()]
    return pa.schema([*BASE_SCHEMA, *fields])


def snapshot_uuid(snapshot_ts_millis: int) -> uuid.UUID:
    """The index directory of an external snapshot, derived from its timestamp (UUID v4 layout).

    Lance 14 gives the MemWAL index entry a new uuid on every merge commit, so the entry's uuid cannot
    locate the file; the timestamp, which every commit of the entry keeps, can."""
    digest = hashlib.sha256(b"memwal_df.region_snapshot\x00" + snapshot_ts_millis.to_bytes(8, "little"))
    return uuid.UUID(bytes=digest.digest()[:16], version=4)


def external_path(snapshot_ts_millis: int) -> str:
    """`_indices/{uuid}/index.lance` of the snapshot taken at `snapshot_ts_millis`."""
    return f"{INDICES_DIR}/{snapshot_uuid(snapshot_ts_millis)}/{SNAPSHOT_FILE}"


def _field_values(
    m: pb.ShardManifest, specs: dict[int, RegionSpec], types: dict[str, pa.DataType]
) -> dict[str, object]:
    """Column name -> region value of one region; empty when its entries cannot be represented."""
    spec = specs.get(m.shard_spec_id)
    if spec is None or not m.shard_field_entries:
        return {}
    if any(result_arrow_type(f.result_type) != types[f.field_id] for f in spec.fields):
        return {}
    entries = {e.field_id: e.value for e in m.shard_field_entries}
    return {
        FIELD_PREFIX + f.field_id: decode_region_value(entries.get(f.field_id), types[f.field_id])
        for f in spec.fields
    }


def to_table(manifests: Sequence[pb.ShardManifest], specs: dict[int, RegionSpec]) -> pa.Table:
    """The snapshot rows of these region manifests, in the given order."""
    schema = snapshot_schema(specs)
    types = region_field_types(specs)
    values = [_field_values(m, specs, types) for m in manifests]
    columns: dict[str, list[object]] = {
        "region_id": [m.shard_id.uuid for m in manifests],
        **{col: [getattr(m, name) for m in manifests] for col, name in _MANIFEST_FIELDS.items()},
        "flushed_generations": [
            [{"generation": s.generation, "path": s.path} for s in m.sstables] for m in manifests
        ],
    }
    for fid in types:
        columns[FIELD_PREFIX + fid] = [v.get(FIELD_PREFIX + fid) for v in values]
    return pa.table({f.name: pa.array(columns[f.name], f.type) for f in schema}, schema=schema)


def from_table(rows: pa.Table, specs: dict[int, RegionSpec]) -> list[pb.ShardManifest]:
    """Manifest-equivalent messages of snapshot rows (inverse of `to_table`)."""
    cols = {name: rows.column(name).to_pylist() for name in rows.column_names}
    out = []
    for i in range(rows.num_rows):
        m = pb.ShardManifest(**{name: cols[col][i] for col, name in _MANIFEST_FIELDS.items()})
        m.shard_id.uuid = cols["region_id"][i]
        for g in cols["flushed_generations"][i]:
            m.sstables.add(generation=g["generation"], path=g["path"])
        spec = specs.get(m.shard_spec_id)
        for f in spec.fields if spec is not None else ():
            column = cols.get(FIELD_PREFIX + f.field_id)
            value = None if column is None else column[i]
            if value is not None:
                encoded = encode_region_value(value, result_arrow_type(f.result_type))
                m.shard_field_entries.add(field_id=f.field_id, value=encoded)
        out.append(m)
    return out


def encode(manifests: Sequence[pb.ShardManifest], specs: dict[int, RegionSpec]) -> bytes:
    """The Lance file bytes of a snapshot of these regions (pylance writes files to paths only)."""
    rows = to_table(manifests, specs)
    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        writer = lance.file.LanceFileWriter(path, rows.schema)
        writer.write_batch(rows)
        writer.close()
        with open(path, "rb") as f:
            return f.read()


def decode(data: bytes, specs: dict[int, RegionSpec]) -> list[pb.ShardManifest]:
    """The regions of a snapshot's Lance file bytes (inverse of `encode`)."""
    with tempfile.TemporaryDirectory(prefix="memwal-snapshot-") as d:
        path = os.path.join(d, SNAPSHOT_FILE)
        with open(path, "wb") as f:
            f.write(data)
        rows = lance.file.LanceFileReader(path).read_all().to_table()
    return from_table(rows, specs)


def load(
    storage: Storage, details: pb.MemWalIndexDetails, specs: dict[int, RegionSpec]
) -> list[pb.ShardManifest] | None:
    """The region states of the index's snapshot: one read of the details (inline) or of one file.

    None when there is no snapshot: none was ever built, or its external file is gone (Lance's
    `cleanup_old_versions` removes `_indices/` directories no retained version's entry names)."""
    if details.HasField("inline_snapshots"):
        return decode(details.inline_snapshots, specs)
    if details.snapshot_ts_millis <= 0:
        return None
    try:
        data = storage.get(external_path(details.snapshot_ts_millis))
    except NotFoundError:
        return None
    return decode(data, specs)
