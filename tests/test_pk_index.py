"""`memwal_df.format.pk_index` against the `_pk_index/` files Lance 14's own MemWAL writer produces."""

from __future__ import annotations

import glob
import os
import tempfile
import time
import uuid
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lance.file import LanceFileReader

from memwal_df.errors import NotFoundError
from memwal_df.format.pk_index import (
    PAGE_DATA_FILE,
    PAGE_LOOKUP_FILE,
    canonical_lookup_bytes,
    encode_composite_keys,
    is_supported_pk_type,
    lookup,
    pk_index_key,
    read_pk_index,
    sort_pk_index,
    write_pk_index,
)

PK = "lance-schema:unenforced-primary-key"
PK_POS = "lance-schema:unenforced-primary-key:position"
BATCH_SIZE_ENTRY = b"\x2a\x12\x0a\x0abatch_size\x12\x048192"
RANGE_ENTRY = b"\x2a\x1a\x0a\x11range_partitioned\x12\x05false"


def pk_field(name: str, ty: pa.DataType, position: int | None = None) -> pa.Field:
    meta = {PK: "true"}
    if position is not None:
        meta[PK_POS] = str(position)
    return pa.field(name, ty, nullable=False, metadata=meta)


def native_generation(root, schema: pa.Schema, ops, data_storage_version: str | None = None) -> str:
    """Run Lance's own MemWAL writer over `ops` ([("put"|"delete", table)]); the one generation dir."""
    uri = str(root / "native")
    kwargs: dict[str, Any] = {"data_storage_version": data_storage_version} if data_storage_version else {}
    ds = lance.write_dataset(pa.Table.from_batches([], schema=schema), uri, schema=schema, **kwargs)
    ds.initialize_mem_wal()
    writer = lance.dataset(uri).mem_wal_writer(str(uuid.uuid4()))
    for op, table in ops:
        (writer.put if op == "put" else writer.delete)(table)
    writer.close()
    gens = glob.glob(f"{uri}/_mem_wal/*/*_gen_*")
    assert len(gens) == 1, gens
    return gens[0]


def key_sequence(ops, pk_names: list[str]) -> list[pa.Array]:
    """The PK columns of every written row (puts and tombstones) in forward write order."""
    return [pa.concat_arrays([t.column(n).combine_chunks() for _, t in ops]) for n in pk_names]


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def assert_same_files(native_gen: str, ours_gen: str) -> None:
    native_dir, ours_dir = f"{native_gen}/_pk_index", f"{ours_gen}/_pk_index"
    assert sorted(os.listdir(native_dir)) == [PAGE_DATA_FILE, PAGE_LOOKUP_FILE]
    assert read_bytes(f"{ours_dir}/{PAGE_DATA_FILE}") == read_bytes(f"{native_dir}/{PAGE_DATA_FILE}")
    # Native emits the lookup file's two metadata entries in random (HashMap) order; ours in a fixed one.
    ours_lookup = read_bytes(f"{ours_dir}/{PAGE_LOOKUP_FILE}")
    assert ours_lookup.index(BATCH_SIZE_ENTRY) < ours_lookup.index(RANGE_ENTRY)
    assert ours_lookup == canonical_lookup_bytes(read_bytes(f"{native_dir}/{PAGE_LOOKUP_FILE}"))


def check_against_native(tmp_path, schema, ops, pk_names, data_storage_version=None) -> str:
    native = native_generation(tmp_path, schema, ops, data_storage_version)
    keys = key_sequence(ops, pk_names)
    assert lance.dataset(native).get_fragments()[0].physical_rows == len(keys[0])
    ours = str(tmp_path / "ours" / "abcdef01_gen_1")
    write_pk_index(ours, keys)
    assert_same_files(native, ours)
    return ours


# --------------------------------------------------------------------------------------------------
# Byte identity with Lance 14
# --------------------------------------------------------------------------------------------------


def test_reference_example(tmp_path) -> None:
    schema = pa.schema([pk_field("id", pa.int64()), pa.field("val", pa.string())])
    ops = [
        ("put", pa.table({"id": [10, 11], "val": ["a", "b"]}, schema=schema)),
        ("put", pa.table({"id": [10, 11], "val": ["c", "d"]}, schema=schema)),
        ("delete", pa.table({"id": pa.array([30], pa.int64())})),
    ]
    ours = check_against_native(tmp_path, schema, ops, ["id"])
    values, ids = read_pk_index(ours)
    assert values.to_pylist() == [10, 10, 11, 11, 30]
    assert ids.tolist() == [0, 2, 1, 3, 4]
    lookup_table = LanceFileReader(f"{ours}/_pk_index/{PAGE_LOOKUP_FILE}").read_all().to_table()
    assert lookup_table.to_pydict() == {"min": [10], "max": [30], "null_count": [0], "page_idx": [0]}
    assert lookup_table.schema.metadata == {b"range_partitioned": b"false", b"batch_size": b"8192"}


def _random_keys(rng: np.random.Generator, kind: str, n: int, span: int) -> list[pa.Array]:
    ints = rng.integers(-span, span, n)
    words = ["", "a", "a\x00", "a\x00b", "é", "ß\x00", "zz", "\U0001f600", "A"]
    strs = [f"{words[i % len(words)]}{i // len(words)}" for i in rng.integers(0, span, n)]
    if kind == "int64":
        return [pa.array(ints, pa.int64())]
    if kind == "int32":
        return [pa.array(ints, pa.int32())]
    if kind == "utf8":
        return [pa.array(strs, pa.string())]
    if kind == "composite":
        return [pa.array(ints % 7 - 3, pa.int64()), pa.array(strs, pa.string())]
    raise AssertionError(kind)


KINDS: dict[str, tuple[list[tuple[str, pa.DataType, int | None]], list[str]]] = {
    "int64": ([("id", pa.int64(), None)], ["id"]),
    "int32": ([("id", pa.int32(), None)], ["id"]),
    "utf8": ([("id", pa.string(), None)], ["id"]),
    # Schema order (name, id) but key order (id, name), declared with the position metadata.
    "composite": ([("name", pa.string(), 2), ("id", pa.int64(), 1)], ["id", "name"]),
}


def _ops_for(kind: str, rows_per_put: int, puts: int, seed: int, span: int):
    pk_defs, pk_names = KINDS[kind]
    schema = pa.schema([pk_field(n, t, p) for n, t, p in pk_defs] + [pa.field("v", pa.int32())])
    rng = np.random.default_rng(seed)
    ops = []
    for i in range(puts):
        cols = dict(zip(pk_names, _random_keys(rng, kind, rows_per_put, span), strict=True))
        cols["v"] = pa.array(np.full(rows_per_put, i), pa.int32())
        ops.append(("put", pa.table({f.name: cols[f.name] for f in schema}, schema=schema)))
        cols = dict(zip(pk_names, _random_keys(rng, kind, rows_per_put // 10 + 1, span), strict=True))
        ops.append(("delete", pa.table({n: cols[n] for n in pk_names})))
    return schema, ops, pk_names


@pytest.mark.parametrize("kind", list(KINDS))
def test_byte_identical_small(tmp_path, kind) -> None:
    schema, ops, pk_names = _ops_for(kind, rows_per_put=20, puts=3, seed=1, span=15)
    check_against_native(tmp_path, schema, ops, pk_names)


@pytest.mark.parametrize("kind", list(KINDS))
def test_byte_identical_several_pages(tmp_path, kind) -> None:
    # 4 x (5000 puts + 501 deletes) = 22,004 keys -> pages of 8192, 8192, 5620
    schema, ops, pk_names = _ops_for(kind, rows_per_put=5000, puts=4, seed=2, span=9000)
    ours = check_against_native(tmp_path, schema, ops, pk_names)
    pages = LanceFileReader(f"{ours}/_pk_index/{PAGE_LOOKUP_FILE}").read_all().to_table()
    assert pages.column("page_idx").to_pylist() == [0, 1, 2]
    values, _ = read_pk_index(ours)
    assert pages.column("min").to_pylist() == values.take([0, 8192, 16384]).to_pylist()
    assert pages.column("max").to_pylist() == values.take([8191, 16383, len(values) - 1]).to_pylist()


def test_byte_identical_every_supported_type_composite(tmp_path) -> None:
    types = {
        "u8": pa.uint8(), "u64": pa.uint64(), "b": pa.bool_(), "bin": pa.binary(),
        "lu": pa.large_string(), "lb": pa.large_binary(), "i8": pa.int8(), "u32": pa.uint32(),
        "i16": pa.int16(), "u16": pa.uint16(),
    }  # fmt: skip
    assert all(is_supported_pk_type(t) for t in types.values())
    schema = pa.schema([pk_field(n, t) for n, t in types.items()] + [pa.field("v", pa.int32())])
    data: dict[str, list[Any]] = {
        "u8": [200, 1, 200], "u64": [2**64 - 1, 2, 2**64 - 1], "b": [True, False, True],
        "bin": [b"\x00\x01", b"", b"\x00\x01"], "lu": ["q", "\x00", "q"], "lb": [b"z", b"\x00\x00", b"z"],
        "i8": [-1, 5, -1], "u32": [7, 2**32 - 1, 7], "i16": [-300, 300, -300], "u16": [0, 65535, 0],
        "v": [1, 2, 3],
    }  # fmt: skip
    ops = [("put", pa.table(data, schema=schema)), ("delete", pa.table({n: data[n][1:2] for n in types}))]
    ops[1] = ("delete", ops[1][1].cast(pa.schema([pa.field(n, t) for n, t in types.items()])))
    check_against_native(tmp_path, schema, ops, list(types))


@pytest.mark.parametrize(
    "ty,vals",
    [
        (pa.uint64(), [3, 1, 3, 2**63 + 5]),
        (pa.int8(), [3, -1, 3, -128]),
        (pa.bool_(), [True, False, True, False]),
        (pa.binary(), [b"b", b"a\x00", b"b", b""]),
        (pa.large_string(), ["b", "", "b", "\x00"]),
    ],
)
def test_byte_identical_single_other_types(tmp_path, ty, vals) -> None:
    schema = pa.schema([pk_field("id", ty), pa.field("v", pa.int32())])
    ops = [("put", pa.table({"id": pa.array(vals, ty), "v": pa.array(range(4), pa.int32())}, schema=schema))]
    check_against_native(tmp_path, schema, ops, ["id"])


@pytest.mark.parametrize("data_storage_version", ["2.1", "2.2"])
def test_files_are_lance_v2_0_on_any_table_version(tmp_path, data_storage_version) -> None:
    schema, ops, pk_names = _ops_for("int64", rows_per_put=50, puts=2, seed=3, span=40)
    ours = check_against_native(tmp_path, schema, ops, pk_names, data_storage_version)
    for name in (PAGE_DATA_FILE, PAGE_LOOKUP_FILE):
        meta = LanceFileReader(f"{ours}/_pk_index/{name}").metadata()
        # the lance stub leaves the version fields out of LanceFileMetadata
        assert (meta.major_version, meta.minor_version) == (0, 3)  # type: ignore[attr-defined]


def test_native_lookup_metadata_order_is_canonicalised(tmp_path) -> None:
    schema, ops, pk_names = _ops_for("int64", rows_per_put=5, puts=1, seed=4, span=5)
    native = read_bytes(f"{native_generation(tmp_path, schema, ops)}/_pk_index/{PAGE_LOOKUP_FILE}")
    canonical = canonical_lookup_bytes(native)
    assert canonical.index(BATCH_SIZE_ENTRY) < canonical.index(RANGE_ENTRY)
    swapped = canonical.replace(BATCH_SIZE_ENTRY + RANGE_ENTRY, RANGE_ENTRY + BATCH_SIZE_ENTRY)
    assert swapped != canonical and len(swapped) == len(canonical)
    assert canonical_lookup_bytes(swapped) == canonical
    assert canonical_lookup_bytes(canonical) == canonical


# --------------------------------------------------------------------------------------------------
# Our own files
# --------------------------------------------------------------------------------------------------


def test_writes_are_deterministic_and_version_0_3(tmp_path) -> None:
    keys = [pa.array(np.random.default_rng(5).integers(0, 50, 300))]
    for gen in ("a", "b"):
        write_pk_index(str(tmp_path / gen), keys)
    for name in (PAGE_DATA_FILE, PAGE_LOOKUP_FILE):
        a, b = (read_bytes(str(tmp_path / g / "_pk_index" / name)) for g in ("a", "b"))
        assert a == b
        meta = LanceFileReader(str(tmp_path / "a" / "_pk_index" / name)).metadata()
        # the lance stub leaves the version fields out of LanceFileMetadata
        assert (meta.major_version, meta.minor_version) == (0, 3)  # type: ignore[attr-defined]


def test_file_uri_and_empty_keys(tmp_path) -> None:
    write_pk_index(f"file://{tmp_path}/g", [pa.array(["b", "a"])])
    values, ids = read_pk_index(f"file://{tmp_path}/g")
    assert values.to_pylist() == ["a", "b"] and ids.tolist() == [1, 0]
    with pytest.raises(ValueError):
        write_pk_index(str(tmp_path / "e"), [pa.array([], pa.int64())])
    with pytest.raises(NotFoundError):
        read_pk_index(str(tmp_path / "missing"))


def test_read_round_trip_composite(tmp_path) -> None:
    cols = [pa.array([2, 1, 2, 1], pa.int32()), pa.array(["x", "y", "x", "a"])]
    write_pk_index(str(tmp_path), cols)
    values, ids = read_pk_index(str(tmp_path))
    assert values.type == pa.binary()
    assert ids.dtype == np.uint64 and ids.tolist() == [3, 1, 0, 2]
    assert values.to_pylist() == encode_composite_keys(cols).take([3, 1, 0, 2]).to_pylist()
    assert lookup(values, ids, pk_index_key([pa.array([2, 1, 3]), pa.array(["x", "y", "x"])])).tolist() == [
        2,
        1,
        -1,
    ]


# --------------------------------------------------------------------------------------------------
# Composite encoding
# --------------------------------------------------------------------------------------------------


def test_encoding_reference_and_nulls() -> None:
    assert encode_composite_keys([pa.array([1]), pa.array(["x"])])[0].as_py() == bytes.fromhex(
        "01 8000000000000001 01 78 0000"
    )
    enc = encode_composite_keys(
        [pa.array([None, -1, 0], pa.int16()), pa.array(["a\x00b", None, ""]), pa.array([None, True, False])]
    ).to_pylist()
    assert enc == [
        bytes.fromhex("00 01 6100ff62 0000 00"),
        bytes.fromhex("01 7fffffffffffffff 00 01 01"),
        bytes.fromhex("01 8000000000000000 01 0000 01 00"),
    ]
    assert encode_composite_keys([pa.array([1, 2], pa.date32())]).to_pylist() == [
        bytes.fromhex("01 8000000000000001"),
        bytes.fromhex("01 8000000000000002"),
    ]
    assert encode_composite_keys([pa.array([b"\x00b", None], pa.binary(2))]).to_pylist() == [
        bytes.fromhex("01 00ff62 0000"),
        b"\x00",
    ]
    sliced = pa.chunked_array([pa.array(["zz", "q\x00", "r"])]).combine_chunks().slice(1, 2)
    assert encode_composite_keys([pa.array([7, 8], pa.uint8()), sliced]).to_pylist() == [
        bytes.fromhex("01 0000000000000007 01 7100ff 0000"),
        bytes.fromhex("01 0000000000000008 01 72 0000"),
    ]


@pytest.mark.parametrize("ty", [pa.float64(), pa.float32(), pa.timestamp("us"), pa.decimal128(25, 2)])
def test_unsupported_types_raise(ty) -> None:
    assert not is_supported_pk_type(ty)
    with pytest.raises(TypeError):
        encode_composite_keys([pa.array([1]), pa.array([1], pa.int64()).cast(ty)])


def test_single_column_key_is_the_column_itself() -> None:
    arr = pa.array(["a", "b"])
    assert pk_index_key([arr]) is arr
    assert pk_index_key([pa.chunked_array([arr])]).equals(arr)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
            st.one_of(st.none(), st.text(max_size=6)),
            st.integers(0, 2**64 - 1),
            st.binary(max_size=4),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_encoding_preserves_tuple_order(rows) -> None:
    cols = [
        pa.array([r[0] for r in rows], pa.int64()),
        pa.array([r[1] for r in rows], pa.string()),
        pa.array([r[2] for r in rows], pa.uint64()),
        pa.array([r[3] for r in rows], pa.large_binary()),
    ]
    encoded = encode_composite_keys(cols).to_pylist()

    def sort_key(r):  # nulls first, strings by UTF-8 bytes
        return tuple(
            (v is not None, v.encode() if isinstance(v, str) else v if v is not None else 0) for v in r
        )

    by_tuple = sorted(range(len(rows)), key=lambda i: (sort_key(rows[i]), i))
    by_bytes = sorted(range(len(rows)), key=lambda i: (encoded[i], i))
    assert [sort_key(rows[i]) for i in by_bytes] == [sort_key(rows[i]) for i in by_tuple]
    assert len(set(encoded)) == len({sort_key(r) for r in rows})


# --------------------------------------------------------------------------------------------------
# Lookup
# --------------------------------------------------------------------------------------------------


def _reference(keys: list) -> dict:
    newest: dict = {}
    for offset, key in enumerate(keys):
        newest[key] = offset
    return newest


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-20, 20), max_size=60), st.lists(st.integers(-25, 25), max_size=30))
def test_lookup_int_matches_dict(keys, probes) -> None:
    values, ids = sort_pk_index([pa.array(keys, pa.int64())])
    ref = _reference(keys)
    got = lookup(values, ids, pa.array(probes, pa.int64()))
    assert got.tolist() == [ref.get(p, -1) for p in probes]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.text(alphabet="ab\x00é", max_size=3), max_size=60),
    st.lists(st.text(alphabet="ab\x00é", max_size=3), max_size=30),
)
def test_lookup_str_matches_dict(keys, probes) -> None:
    values, ids = sort_pk_index([pa.array(keys, pa.string())])
    ref = _reference(keys)
    assert lookup(values, ids, pa.array(probes, pa.string())).tolist() == [ref.get(p, -1) for p in probes]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["", "a", "a\x00", "b"])), min_size=1, max_size=50),
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["", "a", "a\x00", "b", "c"])), max_size=20),
)
def test_lookup_composite_round_trip_matches_dict(keys, probes) -> None:
    cols = [pa.array([k[0] for k in keys], pa.int64()), pa.array([k[1] for k in keys])]
    with tempfile.TemporaryDirectory() as d:
        write_pk_index(d, cols)
        values, ids = read_pk_index(d)
    ref = _reference(keys)
    probe_key = pk_index_key(
        [pa.array([p[0] for p in probes], pa.int64()), pa.array([p[1] for p in probes], pa.string())]
    )
    assert lookup(values, ids, probe_key).tolist() == [ref.get(p, -1) for p in probes]


def test_lookup_edge_cases() -> None:
    values, ids = sort_pk_index([pa.array([5, 1, 5], pa.int32())])
    assert lookup(values, ids, pa.array([5, None, 1, 0, 9], pa.int64())).tolist() == [2, -1, 1, -1, -1]
    assert lookup(values, ids, pa.array([], pa.int32())).tolist() == []
    empty_values, empty_ids = pa.array([], pa.int32()), np.array([], np.uint64)
    assert lookup(empty_values, empty_ids, pa.array([1], pa.int32())).tolist() == [-1]
    bvals, bids = sort_pk_index([pa.array([True, False, True])])
    assert lookup(bvals, bids, pa.array([True, False])).tolist() == [2, 1]
    svals, sids = sort_pk_index([pa.array(["b", "a", "b"])])
    assert lookup(svals, sids, pa.array(["b", None, "c", "a"])).tolist() == [2, -1, -1, 1]


def test_write_time_100k_int64(tmp_path) -> None:
    keys = [pa.array(np.random.default_rng(6).integers(0, 60_000, 100_000), pa.int64())]
    start = time.perf_counter()
    write_pk_index(str(tmp_path), keys)
    elapsed = time.perf_counter() - start
    values, ids = read_pk_index(str(tmp_path))
    assert len(values) == 100_000
    print(f"\nwrite_pk_index: 100,000 int64 keys in {elapsed * 1000:.1f} ms")
