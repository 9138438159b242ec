"""memwal_df.format.memwal_index and base_manifest against real Lance 14 tables: what native writes,
what we read and write."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from lance.mem_wal import CompactedSsTable
from lance.schema import LanceSchema

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    InvalidConfigError,
    InvalidRegionSpecError,
    NonKeyRegionColumnError,
    SchemaMismatchError,
    TableExistsError,
    TableNotFoundError,
)
from memwal_df.format import base_manifest as bm
from memwal_df.format import memwal_index as mi
from memwal_df.format.open_storage import open_storage
from memwal_df.format.proto import memwal_pb2 as pb

PK = bm.PRIMARY_KEY_METADATA
POS = bm.PRIMARY_KEY_POSITION_METADATA
WRITER_DEFAULTS = {
    "durable_write": "true",
    "max_wal_buffer_size": "10485760",
    "max_wal_flush_interval_ms": "100",
    "max_memtable_size": "268435456",
    "max_memtable_rows": "100000",
    "max_memtable_batches": "8000",
    "max_unflushed_memtable_bytes": "1073741824",
    "manifest_scan_batch_size": "2",
    "backpressure_log_interval_ms": "30000",
    "stats_log_interval_ms": "60000",
    "max_wal_persist_retries": "3",
    "wal_persist_retry_base_delay_ms": "50",
    "enable_memtable": "true",
}

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, metadata={PK: "true"}),
        pa.field("user", pa.string()),
        pa.field("val", pa.float32()),
        pa.field("ts", pa.timestamp("us")),
    ]
)


def rows(ids: list[int]) -> pa.Table:
    return pa.table(
        {
            "id": ids,
            "user": [f"u{i % 3}" for i in ids],
            "val": [float(i) for i in ids],
            "ts": pa.array([1_700_000_000_000_000 + i for i in ids], pa.timestamp("us")),
        },
        schema=SCHEMA,
    )


def make_table(path: Path, **kwargs: Any) -> str:
    uri = str(path)
    lance.write_dataset(rows([1, 2, 3]), uri, **kwargs)
    return uri


def native(uri: str, **kwargs: Any) -> tuple[pb.MemWalIndexDetails, pb.IndexMetadata]:
    lance.dataset(uri).initialize_mem_wal(**kwargs)
    got = stored_details(uri)
    assert got is not None
    return got


def stored_details(
    uri: str, storage_options: dict[str, str] | None = None, version: int | None = None
) -> tuple[pb.MemWalIndexDetails, pb.IndexMetadata]:
    """mi.read_details of a table that has a MemWAL index."""
    got = mi.read_details(uri, storage_options, version=version)
    assert got is not None
    return got


def uid(b: pb.UUID) -> uuid.UUID:
    return uuid.UUID(bytes=b.uuid)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def wire_records(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """The top-level records of a protobuf message: (tag, record bytes, length-delimited payload)."""
    out: list[tuple[int, bytes, bytes]] = []
    i = 0
    while i < len(data):
        start = i
        key, i = _varint(data, i)
        payload = b""
        if key & 7 == 0:
            _, i = _varint(data, i)
        elif key & 7 == 2:
            n, i = _varint(data, i)
            payload, i = data[i : i + n], i + n
        else:
            raise AssertionError(f"unexpected wire type {key & 7}")
        out.append((key >> 3, data[start:i], payload))
    return out


def sorted_map_entries(data: bytes) -> bytes:
    """`data` (a MemWalIndexDetails) with its writer_config_defaults records (tag 11) sorted by key:
    the only thing native leaves to chance (Rust HashMap order)."""
    records = wire_records(data)
    entry = pb.MemWalIndexDetails.WriterConfigDefaultsEntry
    ordered = iter(sorted((r for r in records if r[0] == 11), key=lambda r: entry.FromString(r[2]).key))
    return b"".join(next(ordered)[1] if tag == 11 else whole for tag, whole, _ in records)


# ------------------------------------------------------------------------------------------------
# Reading what native writes


@pytest.mark.parametrize(
    ("kwargs", "num_shards", "field"),
    [
        (
            {"bucket_column": "id", "num_buckets": 4},
            4,
            {
                "transform": "bucket",
                "source_ids": [0],
                "result_type": "int32",
                "parameters": {"num_buckets": "4"},
            },
        ),
        (
            {"identity_column": "user"},
            0,
            {"transform": "identity", "source_ids": [1], "result_type": "utf8", "parameters": {}},
        ),
        (
            {"unsharded": True},
            1,
            {"transform": "unsharded", "source_ids": [], "result_type": "int32", "parameters": {}},
        ),
        ({}, 0, None),
    ],
    ids=["bucket4", "identity", "unsharded", "manual"],
)
def test_parse_native_initialize(tmp_path: Path, kwargs: dict, num_shards: int, field: dict | None) -> None:
    uri = make_table(tmp_path / "t")
    details, meta = native(uri, **kwargs)

    assert meta.name == mi.MEMWAL_INDEX_NAME
    assert meta.index_details.type_url == mi.DETAILS_TYPE_URL
    assert list(meta.fields) == [] and not meta.files
    assert meta.fragment_bitmap == b""  # native omits the field
    assert meta.HasField("index_version") and meta.index_version == 0
    assert meta.HasField("created_at") and meta.created_at > 1_600_000_000_000
    assert meta.dataset_version == 1  # the read version at creation
    assert details.num_shards == num_shards
    assert details.HasField("maintain_all_indexes") and details.maintain_all_indexes
    assert not details.maintained_indexes and not details.writer_config_defaults
    assert not details.compacted_sstables and not details.index_catchup
    assert not details.HasField("inline_snapshots") and details.snapshot_ts_millis == 0
    if field is None:
        assert not details.sharding_specs
    else:
        (spec,) = details.sharding_specs
        assert spec.spec_id == 1
        (f,) = spec.fields
        assert f.field_id == "bucket"
        assert not f.HasField("expression")
        got = {
            "transform": f.transform,
            "source_ids": list(f.source_ids),
            "result_type": f.result_type,
            "parameters": dict(f.parameters),
        }
        assert got == field
    # our re-encoding is byte-identical to what native stored
    assert mi.encode_details(details) == meta.index_details.value
    # and agrees with pylance's own (partial) view
    view = lance.dataset(uri).mem_wal_index_details()
    assert view is not None
    assert view["num_shards"] == details.num_shards
    assert view["maintain_all_indexes"] == details.maintain_all_indexes
    assert len(view["sharding_specs"]) == len(details.sharding_specs)


def test_index_section_reencodes_identically(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    lance.dataset(uri).initialize_mem_wal(bucket_column="id", num_buckets=4)
    storage = open_storage(uri)
    version, indices = bm.read_index_section(storage)
    assert version == lance.dataset(uri).version == 2
    raw = storage.get(bm.manifest_path(version))
    section = pb.IndexSection(indices=indices).SerializeToString()
    assert section in raw  # the IndexSection bytes, as stored, re-encoded from our parse


def test_maintained_indexes_omitted_vs_empty(tmp_path: Path) -> None:
    omitted = make_table(tmp_path / "a")
    empty = make_table(tmp_path / "b")
    d1, m1 = native(omitted)
    d2, m2 = native(empty, maintained_indexes=[])
    assert m1.index_details.value == bytes.fromhex("6001")
    assert m2.index_details.value == bytes.fromhex("6000")
    assert d1.maintain_all_indexes and not d2.maintain_all_indexes
    assert d2.HasField("maintain_all_indexes")
    assert mi.encode_details(d1) == m1.index_details.value
    assert mi.encode_details(d2) == m2.index_details.value


def test_maintained_index_list(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    details, meta = native(uri, maintained_indexes=["id_idx"])
    assert list(details.maintained_indexes) == ["id_idx"] and not details.maintain_all_indexes
    assert mi.encode_details(details) == meta.index_details.value


def test_writer_config_defaults(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    details, meta = native(uri, durable_write=False, max_memtable_rows=5000, stats_log_interval_ms=0)
    expected = dict(WRITER_DEFAULTS, durable_write="false", max_memtable_rows="5000")
    del expected["stats_log_interval_ms"]  # 0 is stored as absent
    assert dict(details.writer_config_defaults) == expected
    # byte-identical except for the HashMap order of the map entries
    assert mi.encode_details(details) == sorted_map_entries(meta.index_details.value)


def test_writer_config_defaults_hnsw(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    details, meta = native(uri, hnsw_params={"vec_idx": {"num_edges": 8}}, unsharded=True)
    wcd = dict(details.writer_config_defaults)
    assert wcd["hnsw.vec_idx.num_edges"] == "8"
    assert {"hnsw.vec_idx.ef_construction", "hnsw.vec_idx.max_level"} <= set(wcd)
    assert mi.encode_details(details) == sorted_map_entries(meta.index_details.value)


def test_compacted_sstables_after_native_merge(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    _, before = native(uri, unsharded=True)
    shard = uuid.uuid4()
    ds = lance.dataset(uri)
    (
        ds.merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(shard), 3)])
        .execute(rows([3, 4]))
    )
    details, meta = stored_details(uri)
    assert mi.merged_generations(details) == {shard: 3}
    (c,) = details.compacted_sstables
    assert uid(c.shard_id) == shard and c.generation == 3
    assert meta.uuid != before.uuid  # a new uuid on every rewrite
    assert meta.dataset_version == lance.dataset(uri).version == 3
    assert mi.encode_details(details) == meta.index_details.value
    # the previous version still holds the old details
    old, _ = stored_details(uri, version=2)
    assert not old.compacted_sstables


def test_index_catchup_after_create_scalar_index(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    native(uri, unsharded=True)
    shard = uuid.uuid4()
    (
        lance.dataset(uri)
        .merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(shard), 2)])
        .execute(rows([5]))
    )
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    details, meta = stored_details(uri)
    assert mi.index_catchup(details) == {"id_idx": {shard: 2}}
    assert mi.merged_generations(details) == {shard: 2}
    assert mi.encode_details(details) == meta.index_details.value


def test_no_memwal_index_and_no_table(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    assert mi.read_details(uri) is None
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    assert mi.read_details(uri) is None  # other indexes only
    assert [i.name for i in bm.read_index_section(open_storage(uri))[1]] == ["id_idx"]
    with pytest.raises(TableNotFoundError):
        mi.read_details(str(tmp_path / "missing"))
    with pytest.raises(TableNotFoundError):
        mi.read_details(uri, version=99)


def test_overwrite_drops_the_index(tmp_path: Path) -> None:
    """Native behaviour worth knowing: an overwrite commit drops every index, the MemWAL one too."""
    uri = make_table(tmp_path / "t")
    native(uri, unsharded=True)
    lance.write_dataset(rows([7]), uri, mode="overwrite")
    assert mi.read_details(uri) is None
    assert mi.read_details(uri, version=2) is not None


def test_corrupt_manifest(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    native(uri, unsharded=True)
    path = Path(uri) / bm.manifest_path(2)
    data = path.read_bytes()
    path.write_bytes(data[:-20] + data[-16:])  # footer now points at garbage
    with pytest.raises(CorruptManifestError):
        mi.read_details(uri, version=2)
    path.write_bytes(data[:-4] + b"XXXX")
    with pytest.raises(CorruptManifestError):
        mi.read_details(uri, version=2)


# ------------------------------------------------------------------------------------------------
# Manifest naming and the latest version


def test_manifest_path() -> None:
    assert bm.manifest_path(2) == "_versions/18446744073709551613.manifest"
    assert bm.manifest_path(2, "v2") == "_versions/18446744073709551613.manifest"
    assert bm.manifest_path(2, "v1") == "_versions/2.manifest"
    assert bm.manifest_path((1 << 63) + 5, "v2") == f"_versions/{(1 << 63) - 6:020d}.manifest"
    with pytest.raises(ValueError):
        bm.manifest_path(-1)


def test_v1_manifest_naming(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t", enable_v2_manifest_paths=False)
    assert (Path(uri) / "_versions" / "1.manifest").exists()
    native(uri, bucket_column="id", num_buckets=2)
    storage = open_storage(uri)
    assert bm.latest_version(storage) == 2
    details, _ = stored_details(uri)
    assert details.num_shards == 2
    assert mi.read_details(uri, version=1) is None


def test_latest_version_past_versions_removed_by_cleanup(tmp_path: Path) -> None:
    """The latest version is found even when version cleanup removed the successor of a version that
    is still present (kept by a tag) or that a `latest_version_hint.json` (written by other Lance
    writers) names."""
    uri = make_table(tmp_path / "t")
    for i in range(4):
        lance.dataset(uri).insert(rows([10 + i]))
    storage = open_storage(uri)
    assert bm.latest_version(storage) == lance.dataset(uri).version == 5
    lance.dataset(uri).tags.create("kept", 2)
    lance.dataset(uri).cleanup_old_versions(
        older_than=datetime.timedelta(0), delete_unverified=True, error_if_tagged_old_versions=False
    )
    assert sorted(v["version"] for v in lance.dataset(uri).versions()) == [2, 5]
    for hint in ({"version": 2}, {"version": 1}, "garbage", None):
        path = Path(uri) / "_versions" / "latest_version_hint.json"
        if hint is None:
            path.unlink()
        else:
            path.write_text(json.dumps(hint))
        assert bm.latest_version(storage) == 5, hint
        assert bm.read_index_section(storage)[0] == 5


# ------------------------------------------------------------------------------------------------
# initialize()


def bucket_spec(n: int, source: int = 0) -> pb.ShardingSpec:
    return pb.ShardingSpec(
        spec_id=1,
        fields=[
            pb.ShardingField(
                field_id="bucket",
                source_ids=[source],
                transform="bucket",
                result_type="int32",
                parameters={"num_buckets": str(n)},
            )
        ],
    )


NATIVE_CASES: dict[str, tuple[pb.MemWalIndexDetails, dict[str, Any]]] = {
    "bucket4": (
        pb.MemWalIndexDetails(num_shards=4, sharding_specs=[bucket_spec(4)], maintain_all_indexes=True),
        {"bucket_column": "id", "num_buckets": 4},
    ),
    "identity": (
        pb.MemWalIndexDetails(
            sharding_specs=[
                pb.ShardingSpec(
                    spec_id=1,
                    fields=[
                        pb.ShardingField(
                            field_id="bucket", source_ids=[0], transform="identity", result_type="int64"
                        )
                    ],
                )
            ],
            maintain_all_indexes=True,
        ),
        {"identity_column": "id"},
    ),
    "unsharded_empty_list": (
        pb.MemWalIndexDetails(
            num_shards=1,
            sharding_specs=[
                pb.ShardingSpec(
                    spec_id=1,
                    fields=[pb.ShardingField(field_id="bucket", transform="unsharded", result_type="int32")],
                )
            ],
            maintain_all_indexes=False,
        ),
        {"unsharded": True, "maintained_indexes": []},
    ),
    "manual_writer_defaults": (
        pb.MemWalIndexDetails(
            maintain_all_indexes=True,
            writer_config_defaults={
                **{k: v for k, v in WRITER_DEFAULTS.items() if k != "stats_log_interval_ms"},
                "max_memtable_rows": "777",
                "hnsw.v.num_edges": "12",
                "hnsw.v.ef_construction": "99",
                "hnsw.v.max_level": "5",
            },
        ),
        {
            "max_memtable_rows": 777,
            "stats_log_interval_ms": 0,
            "hnsw_params": {"v": {"num_edges": 12, "ef_construction": 99, "max_level": 5}},
        },
    ),
}


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_initialize_native_expressible(tmp_path: Path, case: str) -> None:
    details, kwargs = NATIVE_CASES[case]
    ours = make_table(tmp_path / "ours")
    twin = make_table(tmp_path / "twin")
    mi.initialize(ours, details)
    got, meta = stored_details(ours)
    assert got == details
    # went through native: no fragment bitmap, and the same entry as native's own call
    assert meta.fragment_bitmap == b""
    assert lance.dataset(ours).version == 2
    twin_details, twin_meta = native(twin, **kwargs)
    assert twin_details == details
    for m in (meta, twin_meta):
        m.ClearField("uuid")
        m.ClearField("created_at")
    assert sorted_map_entries(meta.index_details.value) == sorted_map_entries(twin_meta.index_details.value)
    meta.index_details.value = twin_meta.index_details.value = b""
    assert meta == twin_meta


def _one_field_spec(field: pb.ShardingField, **details: Any) -> pb.MemWalIndexDetails:
    return pb.MemWalIndexDetails(sharding_specs=[pb.ShardingSpec(spec_id=1, fields=[field])], **details)


# writer_config_defaults: partial, which native cannot express
_PARTIAL = {"maintain_all_indexes": True, "writer_config_defaults": {"max_memtable_rows": "500"}}


def _year_spec() -> pb.MemWalIndexDetails:
    field = pb.ShardingField(field_id="ts_year", source_ids=[3], transform="year", result_type="int32")
    return _one_field_spec(field, **_PARTIAL)


def _truncate_spec() -> pb.MemWalIndexDetails:
    field = pb.ShardingField(
        field_id="id_10",
        source_ids=[0],
        transform="truncate",
        result_type="int64",
        parameters={"width": "10"},
    )
    return _one_field_spec(field, **_PARTIAL)


def _multi_bucket_spec() -> pb.MemWalIndexDetails:
    field = pb.ShardingField(
        field_id="mb",
        source_ids=[0],
        transform="multi_bucket",
        result_type="int32",
        parameters={"num_buckets": "8"},
    )
    return _one_field_spec(field, num_shards=8, maintained_indexes=["id_idx"], maintain_all_indexes=False)


@pytest.mark.parametrize("make", [_truncate_spec, _multi_bucket_spec], ids=["truncate", "multi_bucket"])
def test_initialize_non_native_roundtrip(tmp_path: Path, make: Callable[[], pb.MemWalIndexDetails]) -> None:
    details = make()
    uri = make_table(tmp_path / "t")
    if details.maintained_indexes:
        lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    read_version = lance.dataset(uri).version
    mi.initialize(uri, details)
    got, meta = stored_details(uri)
    assert got == details
    assert meta.index_details.value == mi.encode_details(details)
    assert meta.index_details.type_url == mi.DETAILS_TYPE_URL
    assert meta.name == mi.MEMWAL_INDEX_NAME and not meta.fields and not meta.files
    assert meta.HasField("index_version") and meta.index_version == 0
    assert meta.HasField("created_at") and meta.created_at > 1_600_000_000_000
    assert meta.dataset_version == read_version  # like native at creation
    assert meta.fragment_bitmap == bytes.fromhex("3a30000000000000")  # the one byte difference from native

    # native pylance still accepts the table
    ds = lance.dataset(uri)
    view = ds.mem_wal_index_details()
    assert view is not None
    assert (
        view["sharding_specs"][0]["fields"][0]["transform"] == details.sharding_specs[0].fields[0].transform
    )
    assert view["maintain_all_indexes"] == details.maintain_all_indexes
    shard = uuid.uuid4()
    writer = ds.mem_wal_writer(str(shard))
    writer.put(rows([40, 41]))
    writer.close()
    assert (Path(uri) / "_mem_wal" / str(shard) / "manifest").is_dir()
    # and a native merge rewrites the entry the native way, keeping our details
    (
        lance.dataset(uri)
        .merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(shard), 1)])
        .execute(rows([40, 41]))
    )
    after, meta2 = stored_details(uri)
    assert mi.merged_generations(after) == {shard: 1}
    after.ClearField("compacted_sstables")
    assert after == details
    assert meta2.fragment_bitmap == b""


def test_initialize_errors(tmp_path: Path) -> None:
    with pytest.raises(TableNotFoundError):
        mi.initialize(str(tmp_path / "missing"), pb.MemWalIndexDetails(maintain_all_indexes=True))
    uri = make_table(tmp_path / "t")
    bad_source = pb.MemWalIndexDetails(maintain_all_indexes=True, sharding_specs=[bucket_spec(4, source=42)])
    with pytest.raises(InvalidRegionSpecError):
        mi.initialize(uri, bad_source)
    bad_transform = _truncate_spec()
    bad_transform.sharding_specs[0].fields[0].transform = "century"
    with pytest.raises(InvalidRegionSpecError):
        mi.initialize(uri, bad_transform)
    with pytest.raises(
        NonKeyRegionColumnError, match=r"\['ts'\], which are not primary-key columns \['id'\]"
    ):
        mi.initialize(uri, _year_spec())  # a key must map to exactly one region
    with pytest.raises(InvalidConfigError):
        mi.initialize(uri, pb.MemWalIndexDetails(maintained_indexes=["nope"], maintain_all_indexes=False))
    assert mi.read_details(uri) is None  # nothing was committed
    mi.initialize(uri, pb.MemWalIndexDetails(maintain_all_indexes=True))
    with pytest.raises(TableExistsError):
        mi.initialize(uri, pb.MemWalIndexDetails(maintain_all_indexes=True))
    with pytest.raises(TableExistsError):
        mi.initialize(uri, _truncate_spec())


# ------------------------------------------------------------------------------------------------
# replace_details()


def _merge(uri: str, shard: uuid.UUID, gen: int, ds: lance.LanceDataset | None = None) -> None:
    (
        (ds or lance.dataset(uri))
        .merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(shard), gen)])
        .execute(rows([gen * 100]))
    )


def test_replace_details(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")  # v2
    native(uri, unsharded=True)  # v3
    shard = uuid.uuid4()
    _merge(uri, shard, 3)  # v4
    details, meta = stored_details(uri)
    progress = details.index_catchup.add(index_name="id_idx")
    progress.caught_up_generations.add(shard_id=pb.UUID(uuid=shard.bytes), generation=2)
    details.snapshot_ts_millis = 1234
    version = mi.replace_details(uri, details, 4)  # v5: the entry lease's fence
    assert version == 6 == lance.dataset(uri).version
    got, meta2 = stored_details(uri)
    assert got == details
    assert mi.index_catchup(got) == {"id_idx": {shard: 2}}
    assert meta2.uuid != meta.uuid and meta2.dataset_version == 6
    assert meta2.index_details.value == mi.encode_details(details)
    assert meta2.fragment_bitmap == bytes.fromhex("3a30000000000000")
    view = lance.dataset(uri).mem_wal_index_details()
    assert view is not None and view["num_shards"] == 1


def test_lance_normalises_index_catchup_on_commit(tmp_path: Path) -> None:
    """Native behaviour: a commit of the MemWAL entry keeps index_catchup only for indexes the table
    has, clamps each region to its compacted generation, and drops regions not compacted at all."""
    uri = make_table(tmp_path / "t")
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")
    native(uri, unsharded=True)
    a, b = uuid.uuid4(), uuid.uuid4()
    _merge(uri, a, 3)
    details, _ = stored_details(uri)
    for name, gens in {"id_idx": {a: 5, b: 1}, "gone_idx": {a: 1}}.items():
        progress = details.index_catchup.add(index_name=name)
        for shard, gen in gens.items():
            progress.caught_up_generations.add(shard_id=pb.UUID(uuid=shard.bytes), generation=gen)
    mi.replace_details(uri, details, lance.dataset(uri).version)
    assert mi.index_catchup(stored_details(uri)[0]) == {"id_idx": {a: 3}}


def test_replace_details_merges_concurrent_merge_progress(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    details, _ = native(uri, unsharded=True)  # v2
    a, b = uuid.uuid4(), uuid.uuid4()
    _merge(uri, a, 5)  # v3, after our read
    details.snapshot_ts_millis = 99
    details.compacted_sstables.add(shard_id=pb.UUID(uuid=a.bytes), generation=2)  # stale knowledge
    details.compacted_sstables.add(shard_id=pb.UUID(uuid=b.bytes), generation=1)
    version = mi.replace_details(uri, details, 2)
    assert version == 5  # after the fence (v4)
    got, _ = stored_details(uri)
    assert got.snapshot_ts_millis == 99
    assert mi.merged_generations(got) == {a: 5, b: 1}
    _merge(uri, a, 6)  # native merges keep working on top
    assert mi.merged_generations(stored_details(uri)[0]) == {a: 6, b: 1}


def test_replace_details_conflicts(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    details, _ = native(uri, unsharded=True)
    first = pb.MemWalIndexDetails()
    first.CopyFrom(details)
    first.snapshot_ts_millis = 1
    second = pb.MemWalIndexDetails()
    second.CopyFrom(details)
    second.snapshot_ts_millis = 2
    assert mi.replace_details(uri, first, 2) == 4  # v3: the fence
    with pytest.raises(CommitConflictError):
        mi.replace_details(uri, second, 2)
    # a change to another field merges
    third = pb.MemWalIndexDetails()
    third.CopyFrom(details)
    third.maintained_indexes.append("i")
    third.maintain_all_indexes = False
    assert mi.replace_details(uri, third, 2) == 7  # the conflicting call's fence took v5
    got, _ = stored_details(uri)
    assert got.snapshot_ts_millis == 1 and list(got.maintained_indexes) == ["i"]
    with pytest.raises(TableNotFoundError):
        mi.replace_details(uri, details, 1)  # version 1 has no MemWAL index


def test_replace_details_repairs_a_rebased_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge by a writer that ignores the entry lease, committed between our read of the latest
    version and our commit: Lance rebases our CreateIndex over it without a conflict (dropping its
    merge progress); we put it back in a repair commit."""
    uri = make_table(tmp_path / "t")
    details, _ = native(uri, unsharded=True)
    shard = uuid.uuid4()
    real_commit = lance.LanceDataset.commit
    calls: list[tuple[str, object]] = []

    def racing_commit(*args: Any, **kwargs: Any) -> lance.LanceDataset:
        kind = type(args[1]).__name__
        calls.append((kind, kwargs.get("read_version")))
        if kind == "CreateIndex" and len(calls) == 2:
            _merge(uri, shard, 7)  # lands first, at version 4
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(racing_commit))
    details.snapshot_ts_millis = 5
    version = mi.replace_details(uri, details, 2)
    # the fence (v3), the rebased commit (v5), then the repair on top of it
    assert calls == [("Merge", 2), ("CreateIndex", 3), ("CreateIndex", 5)]
    assert version == 6
    got, meta = stored_details(uri)
    assert got.snapshot_ts_millis == 5
    assert mi.merged_generations(got) == {shard: 7}
    assert meta.dataset_version == 6
    assert not mi.merged_generations(stored_details(uri, version=5)[0])  # the window a reader could see


def test_replace_details_keeps_concurrent_index_catchup(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    details, _ = native(uri, unsharded=True)
    shard = uuid.uuid4()
    _merge(uri, shard, 1)  # v3
    lance.dataset(uri).create_scalar_index("id", "BTREE", name="id_idx")  # v4, derives index_catchup
    details.snapshot_ts_millis = 7
    mi.replace_details(uri, details, 2)
    got, _ = stored_details(uri)
    assert mi.index_catchup(got) == {"id_idx": {shard: 1}}
    assert mi.merged_generations(got) == {shard: 1}


# ------------------------------------------------------------------------------------------------
# Primary keys


def lance_order(schema: pa.Schema) -> list[str]:
    return [f.name() for f in LanceSchema.from_pyarrow(schema).unenforced_primary_key()]


def test_primary_key_single() -> None:
    assert bm.primary_key(SCHEMA) == ["id"]
    assert bm.primary_key(pa.schema([pa.field("a", pa.int64())])) == []
    for truthy in ("true", "TRUE", "1", "yes", "Y", "on"):
        s = pa.schema([pa.field("a", pa.int64(), False, {PK: truthy}), pa.field("b", pa.int64())])
        assert bm.primary_key(s) == lance_order(s) == ["a"]
    for falsy in ("false", "0", "t", "", "true "):
        s = pa.schema([pa.field("a", pa.int64(), False, {PK: falsy})])
        assert bm.primary_key(s) == lance_order(s) == []


@pytest.mark.parametrize(
    "fields",
    [
        # boolean key only: field order
        [("a", {PK: "true"}), ("x", {}), ("b", {PK: "true"})],
        # positions decide, whatever the field order
        [("a", {PK: "true", POS: "2"}), ("b", {PK: "true", POS: "1"}), ("c", {PK: "true", POS: "3"})],
        # the position key alone marks the column; "0" marks it without a position
        [("a", {POS: "2"}), ("b", {POS: "1"}), ("c", {POS: "0"})],
        # positioned columns before unpositioned ones; gaps allowed; ties by field order
        [("a", {PK: "true"}), ("b", {POS: "5"}), ("c", {POS: "3"}), ("d", {POS: "3"})],
        # an unparsable position falls back to the boolean key
        [("a", {PK: "true", POS: "abc"}), ("b", {POS: "+1"}), ("c", {PK: "false", POS: "x"})],
    ],
    ids=["legacy", "positions", "position-only", "mixed", "unparsable"],
)
def test_primary_key_composite_matches_lance(fields: list[tuple[str, dict]]) -> None:
    schema = pa.schema([pa.field(n, pa.int64(), not md, md or None) for n, md in fields])
    assert bm.primary_key(schema) == lance_order(schema)


def test_primary_key_nested() -> None:
    schema = pa.schema(
        [
            pa.field(
                "s",
                pa.struct([pa.field("x", pa.int64()), pa.field("y", pa.int64(), False, {PK: "1"})]),
                False,
            ),
            pa.field("b", pa.int64(), False, {POS: "1"}),
        ]
    )
    assert bm.primary_key(schema) == ["b", "s.y"]
    assert [n.split(".")[-1] for n in bm.primary_key(schema)] == lance_order(schema)


def test_with_primary_key(tmp_path: Path) -> None:
    base = pa.schema(
        [
            pa.field("id", pa.int64(), False, {PK: "true", "other": "kept"}),
            pa.field("region", pa.string()),  # nullable: becomes non-nullable
            pa.field("ts", pa.timestamp("us")),
            pa.field("s", pa.struct([pa.field("k", pa.int32())])),
        ],
        metadata={"table": "meta"},
    )
    schema = bm.with_primary_key(base, ["ts", "region", "s.k"])
    assert bm.primary_key(schema) == ["ts", "region", "s.k"]
    assert schema.metadata == {b"table": b"meta"}
    assert schema.field("id").metadata == {b"other": b"kept"}
    assert schema.field("region").metadata == {PK.encode(): b"true", POS.encode(): b"2"}
    assert not schema.field("region").nullable and not schema.field("ts").nullable
    assert not schema.field("s").nullable and not schema.field("s").type.field("k").nullable
    assert schema.field("id").nullable is False  # untouched
    # Lance agrees, and keeps it through a write
    assert lance_order(schema) == ["ts", "region", "k"]
    data = pa.table(
        {
            "id": [1],
            "region": ["eu"],
            "ts": pa.array([5], pa.timestamp("us")),
            "s": [{"k": 3}],
        },
        schema=schema,
    )
    ds = lance.write_dataset(data, str(tmp_path / "t"))
    assert [f.name() for f in ds.lance_schema.unenforced_primary_key()] == ["ts", "region", "k"]
    assert bm.primary_key(ds.schema) == ["ts", "region", "s.k"]
    # a single key, and re-keying replaces the old marks
    assert bm.primary_key(bm.with_primary_key(schema, ["id"])) == ["id"]


def test_with_primary_key_errors() -> None:
    schema = pa.schema(
        [pa.field("a", pa.int64()), pa.field("l", pa.list_(pa.int64())), pa.field("s", pa.struct([]))]
    )
    for cols in ([], ["a", "a"], ["zz"], ["l"], ["s"]):
        with pytest.raises(SchemaMismatchError):
            bm.with_primary_key(schema, cols)


def test_lance_refuses_nullable_primary_key() -> None:
    """Why with_primary_key makes key columns non-nullable."""
    schema = pa.schema([pa.field("a", pa.int64(), True, {PK: "true"})])
    with pytest.raises(Exception, match="must not be nullable"):
        LanceSchema.from_pyarrow(schema)
    LanceSchema.from_pyarrow(bm.with_primary_key(schema, ["a"]))


def test_initialize_falls_back_when_pylance_cannot_convert(tmp_path: Path) -> None:
    """num_edges beyond u32 is expressible as a map entry but not as a pylance argument."""
    details, _ = NATIVE_CASES["manual_writer_defaults"]
    details = pb.MemWalIndexDetails.FromString(details.SerializeToString())
    details.writer_config_defaults["hnsw.v.num_edges"] = str(1 << 40)
    uri = make_table(tmp_path / "t")
    mi.initialize(uri, details)
    got, meta = stored_details(uri)
    assert got == details
    assert meta.fragment_bitmap == bytes.fromhex("3a30000000000000")  # the CreateIndex path
    assert lance.dataset(uri).version == 2


def test_both_backends(table_uri: str, table_storage_options: dict[str, str] | None) -> None:
    """Everything above through storage_options: local paths and S3 (moto)."""
    opts = table_storage_options
    lance.write_dataset(rows([1, 2, 3]), table_uri, storage_options=opts)
    assert mi.read_details(table_uri, opts) is None
    lance.dataset(table_uri, storage_options=opts).initialize_mem_wal(bucket_column="id", num_buckets=4)
    details, meta = stored_details(table_uri, opts)
    assert details.num_shards == 4 and mi.encode_details(details) == meta.index_details.value
    shard = uuid.uuid4()
    (
        lance.dataset(table_uri, storage_options=opts)
        .merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(shard), 2)])
        .execute(rows([4]))
    )
    details, _ = stored_details(table_uri, opts)
    assert mi.merged_generations(details) == {shard: 2}
    assert bm.latest_version(open_storage(table_uri, opts)) == 3
    details.snapshot_ts_millis = 42
    assert mi.replace_details(table_uri, details, 3, opts) == 5  # v4: the entry lease's fence
    assert stored_details(table_uri, opts)[0] == details
    assert stored_details(table_uri, opts, version=2)[0].num_shards == 4

    other = f"{table_uri}-truncate"
    lance.write_dataset(rows([1]), other, storage_options=opts)
    mi.initialize(other, _truncate_spec(), opts)
    assert stored_details(other, opts)[0] == _truncate_spec()
    assert lance.dataset(other, storage_options=opts).mem_wal_index_details() is not None


def test_replace_details_region_removal_merges(tmp_path: Path) -> None:
    uri = make_table(tmp_path / "t")
    native(uri, unsharded=True)
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    _merge(uri, a, 3)
    _merge(uri, c, 1)
    read_version = lance.dataset(uri).version
    details, _ = stored_details(uri)
    kept = [x for x in details.compacted_sstables if uid(x.shard_id) not in (a, c)]
    del details.compacted_sstables[:]
    details.compacted_sstables.extend(kept)  # we drop regions a and c
    _merge(uri, b, 2)  # concurrently: a new region ...
    _merge(uri, c, 4)  # ... and c moves on
    mi.replace_details(uri, details, read_version)
    assert mi.merged_generations(stored_details(uri)[0]) == {b: 2, c: 4}
