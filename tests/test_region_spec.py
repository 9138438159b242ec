"""Region specs: murmur3 and bucket routing against Lance 14 native, transforms against simple references,
projection soundness, serialization bytes against what `initialize_mem_wal` writes, errors."""

from __future__ import annotations

import datetime as dt
import math
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lance
import mmh3
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from lance.mem_wal import evaluate_sharding_spec
from lance.schema import LanceSchema
from support.optional import not_none

from memwal_df.errors import InvalidRegionSpecError, RegionRoutingError
from memwal_df.format.murmur3 import is_native_bucket_type, murmur3_32_spark, murmur3_multi
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions import spec as rs
from memwal_df.format.regions import transforms as rt
from memwal_df.format.regions import values as rv
from memwal_df.format.regions.intexpr import as_array
from memwal_df.format.regions.predicates import Eq, In, Predicate, Range
from memwal_df.format.regions.sql_expression import Expression

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# References


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return _u32((x << r) | (x >> (32 - r)))


def _mix(h: int, k: int) -> int:
    k = _rotl(_u32(k * 0xCC9E2D51), 15)
    k = _u32(k * 0x1B873593)
    return _u32(_rotl(h ^ k, 13) * 5 + 0xE6546B64)


def _fmix(h: int, n: int) -> int:
    h ^= n
    h ^= h >> 16
    h = _u32(h * 0x85EBCA6B)
    h ^= h >> 13
    h = _u32(h * 0xC2B2AE35)
    return h ^ (h >> 16)


def ref_hash_bytes(b: bytes, seed: int = 0) -> int:
    """Scalar Spark-style Murmur3_x86_32: 4-byte LE blocks, then each tail byte sign-extended."""
    h = seed
    full = len(b) - len(b) % 4
    for i in range(0, full, 4):
        h = _mix(h, int.from_bytes(b[i : i + 4], "little"))
    for byte in b[full:]:
        h = _mix(h, _u32(byte - 256 if byte > 127 else byte))
    return _fmix(h, len(b))


def ref_hash_int(v: int, seed: int = 0) -> int:
    return _fmix(_mix(seed, _u32(v)), 4)


def ref_hash_long(v: int, seed: int = 0) -> int:
    v &= (1 << 64) - 1
    return _fmix(_mix(_mix(seed, v & 0xFFFFFFFF), v >> 32), 8)


def signed(h: int) -> int:
    return h - (1 << 32) if h >= 1 << 31 else h


def native_spec(n: int, source_id: int = 0) -> rs.RegionSpec:
    return rs.RegionSpec(
        1, (rs.RegionField("bucket", (source_id,), rt.Bucket(n), "int32", {"num_buckets": str(n)}),)
    )


def native_buckets(arr: pa.Array, n: int) -> list[int]:
    """Lance 14's own bucket routing of `arr` (through `lance.mem_wal.evaluate_sharding_spec`)."""
    t = pa.table({"k": arr})
    out = evaluate_sharding_spec(
        t.to_batches()[0], native_spec(n).to_dict(), LanceSchema.from_pyarrow(t.schema)
    )
    return out.column(0).to_pylist()


def ours(arr: pa.Array, n: int) -> list[int]:
    return native_spec(n).evaluate(pa.table({"k": arr}), {"k": 0})[0].to_pylist()


# ---------------------------------------------------------------------------------------------
# murmur3 / bucket against native

I64 = (-(1 << 63), (1 << 63) - 1)
INT_RANGES = {
    pa.int8(): (-128, 127),
    pa.int16(): (-(1 << 15), (1 << 15) - 1),
    pa.int32(): (-(1 << 31), (1 << 31) - 1),
    pa.int64(): I64,
    pa.uint8(): (0, 255),
    pa.uint16(): (0, (1 << 16) - 1),
    pa.uint32(): (0, (1 << 32) - 1),
    pa.uint64(): (0, (1 << 64) - 1),
}
TEMPORAL = [
    (pa.date32(), (-(1 << 31), (1 << 31) - 1), pa.int32()),
    (pa.time32("s"), (0, 86399), pa.int32()),
    (pa.time32("ms"), (0, 86_399_999), pa.int32()),
    (pa.time64("us"), (0, 86_399_999_999), pa.int64()),
    (pa.time64("ns"), (0, 86_399_999_999_999), pa.int64()),
    (pa.timestamp("s"), I64, pa.int64()),
    (pa.timestamp("ms", "UTC"), I64, pa.int64()),
    (pa.timestamp("us"), I64, pa.int64()),
    (pa.timestamp("ns", "America/New_York"), I64, pa.int64()),
]
BUCKET_COUNTS = st.sampled_from([1, 2, 7, 16, 1024, 2147483647])


@pytest.mark.parametrize("typ", list(INT_RANGES), ids=str)
@SETTINGS
@given(data=st.data(), n=BUCKET_COUNTS)
def test_bucket_matches_native_integers(typ: pa.DataType, data: st.DataObject, n: int) -> None:
    lo, hi = INT_RANGES[typ]
    edge = st.sampled_from([lo, hi, 0, 1, -1 if lo < 0 else 2, 5])
    values = data.draw(st.lists(st.none() | edge | st.integers(lo, hi), min_size=1, max_size=50))
    arr = pa.array(values, typ)
    assert ours(arr, n) == native_buckets(arr, n)


@pytest.mark.parametrize("typ,bounds,storage", TEMPORAL, ids=lambda x: str(x))
@SETTINGS
@given(data=st.data(), n=BUCKET_COUNTS)
def test_bucket_matches_native_temporal(typ, bounds, storage, data: st.DataObject, n: int) -> None:
    values = data.draw(st.lists(st.none() | st.integers(*bounds), min_size=1, max_size=50))
    arr = pa.array(values, storage).cast(typ)
    assert ours(arr, n) == native_buckets(arr, n)


@pytest.mark.parametrize("typ,width", [(pa.float32(), 32), (pa.float64(), 64)], ids=str)
@SETTINGS
@given(data=st.data(), n=BUCKET_COUNTS)
def test_bucket_matches_native_floats(
    typ: pa.DataType, width: Literal[32, 64], data: st.DataObject, n: int
) -> None:
    special = st.sampled_from([0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1.25])
    values = data.draw(st.lists(st.none() | special | st.floats(width=width), min_size=1, max_size=50))
    arr = pa.array(values, typ)
    assert ours(arr, n) == native_buckets(arr, n)


def test_float_zero_and_nan_are_normalised() -> None:
    h = murmur3_32_spark(pa.array([0.0, -0.0, math.nan, -math.nan], pa.float32())).to_pylist()
    assert h[0] == h[1] == murmur3_32_spark(pa.array([0], pa.int32()))[0].as_py()
    assert h[2] == h[3] == signed(ref_hash_int(0x7FC00000))
    d = murmur3_32_spark(pa.array([-0.0, float("nan")], pa.float64())).to_pylist()
    assert d == [signed(ref_hash_long(0)), signed(ref_hash_long(0x7FF8000000000000))]


@SETTINGS
@given(values=st.lists(st.none() | st.booleans(), min_size=1, max_size=20), n=BUCKET_COUNTS)
def test_bucket_matches_native_bool(values: list[bool | None], n: int) -> None:
    arr = pa.array(values, pa.bool_())
    assert ours(arr, n) == native_buckets(arr, n)


TEXT = st.text(max_size=40) | st.sampled_from(["", "a", "ab", "abc", "abcd", "é", "日本", "\x80\xff", "😀x"])


@pytest.mark.parametrize("typ", [pa.utf8(), pa.large_utf8()], ids=str)
@SETTINGS
@given(
    values=st.lists(st.none() | TEXT | st.text(min_size=200, max_size=600), min_size=1, max_size=40),
    n=BUCKET_COUNTS,
)
def test_bucket_matches_native_strings(typ: pa.DataType, values: list[str | None], n: int) -> None:
    arr = pa.array(values, typ)
    assert ours(arr, n) == native_buckets(arr, n)


@pytest.mark.parametrize("rows,length", [(5, 20_000), (300, 1_500), (2_000, 37)])
def test_long_strings_match_native(rows: int, length: int) -> None:
    # few very long values take the row-wise finish; many long ones stay column-wise
    rng = np.random.default_rng(rows)
    values = ["".join(map(chr, rng.integers(32, 0x2FFF, int(rng.integers(0, length))))) for _ in range(rows)]
    arr = pa.array(values + ["x" * 100_003, None, ""])
    assert ours(arr, 2147483647) == native_buckets(arr, 2147483647)


@SETTINGS
@given(
    blobs=st.lists(st.none() | st.binary(max_size=300), min_size=1, max_size=30),
    seed=st.integers(0, 0xFFFFFFFF),
)
def test_bytes_hash_matches_scalar_reference(blobs: list[bytes | None], seed: int) -> None:
    got = murmur3_32_spark(pa.array(blobs, pa.binary())).to_pylist()
    assert got == [None if b is None else signed(ref_hash_bytes(b)) for b in blobs]
    # string_view / large_binary hash like binary
    assert murmur3_32_spark(pa.array(blobs, pa.large_binary())).to_pylist() == got


@SETTINGS
@given(
    st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1),
    st.lists(st.integers(*I64), min_size=1),
    st.lists(st.binary(max_size=64).filter(lambda b: len(b) % 4 == 0), min_size=1),
)
def test_agrees_with_mmh3_where_the_variants_agree(
    ints: list[int], longs: list[int], blobs: list[bytes]
) -> None:
    assert murmur3_32_spark(pa.array(ints, pa.int32())).to_pylist() == [
        mmh3.hash(struct.pack("<i", v)) for v in ints
    ]
    assert murmur3_32_spark(pa.array(longs, pa.int64())).to_pylist() == [
        mmh3.hash(struct.pack("<q", v)) for v in longs
    ]
    assert murmur3_32_spark(pa.array(blobs, pa.binary())).to_pylist() == [mmh3.hash(b) for b in blobs]


def test_tail_bytes_differ_from_standard_murmur3() -> None:
    # the Spark variant mixes each tail byte on its own; mmh3 packs the tail into one word
    for s in ["a", "abcde", "é"]:
        assert murmur3_32_spark(pa.array([s]))[0].as_py() == signed(ref_hash_bytes(s.encode()))
    assert murmur3_32_spark(pa.array(["a"]))[0].as_py() != mmh3.hash(b"a")


def test_sliced_chunked_and_dictionary_inputs() -> None:
    arr = pa.array([f"k{i}" * (i % 7) for i in range(100)] + [None])
    full = murmur3_32_spark(arr).to_pylist()
    assert murmur3_32_spark(arr.slice(13, 40)).to_pylist() == full[13:53]
    chunked = pa.chunked_array([arr.slice(0, 30), arr.slice(30)])
    assert murmur3_32_spark(chunked).to_pylist() == full
    assert murmur3_32_spark(arr.dictionary_encode()).to_pylist() == full
    ints = pa.array(range(-50, 50), pa.int16())
    assert murmur3_32_spark(ints.slice(7, 9)).to_pylist() == murmur3_32_spark(ints).to_pylist()[7:16]
    assert murmur3_32_spark(pa.array([], pa.utf8())).to_pylist() == []
    assert murmur3_32_spark(pa.nulls(3)).to_pylist() == [None] * 3


def test_nulls_hash_to_null_and_bucket_zero() -> None:
    arr = pa.array([None, 3, None], pa.int64())
    assert murmur3_32_spark(arr).to_pylist()[0] is None
    assert ours(arr, 16) == native_buckets(arr, 16) == [0, ours(pa.array([3], pa.int64()), 16)[0], 0]


def test_bucket_uses_mask_not_abs() -> None:
    # find a key whose hash is negative: abs() and the native mask give different buckets
    keys = pa.array(range(1000), pa.int64())
    h = np.array(murmur3_32_spark(keys).to_pylist())
    k = int(np.flatnonzero((h < 0) & ((np.abs(h) % 10) != ((h & 0x7FFFFFFF) % 10)))[0])
    got = ours(pa.array([k], pa.int64()), 10)
    assert got == native_buckets(pa.array([k], pa.int64()), 10) == [int(h[k] & 0x7FFFFFFF) % 10]
    assert got != [abs(int(h[k])) % 10]


def test_type_promotion_matches_native_not_spec() -> None:
    # Spec rule 3 wants int32(5) and int64(5) in one region; native hashes them at their width.
    i32, i64 = pa.array([5, -5, 123456], pa.int32()), pa.array([5, -5, 123456], pa.int64())
    assert ours(i32, 1024) == native_buckets(i32, 1024)
    assert ours(i64, 1024) == native_buckets(i64, 1024)
    assert ours(i32, 1024) != ours(i64, 1024)
    # widening within the 4-byte class is stable
    assert ours(pa.array([5, -5], pa.int8()), 1024) == ours(pa.array([5, -5], pa.int32()), 1024)
    # identity values survive promotion
    spec = rs.identity("k").bind({"k": 0}, pa.schema([("k", pa.int32())]), primary_key=["k"])
    assert spec.evaluate(pa.table({"k": i64}), {"k": 0})[0].to_pylist() == [5, -5, 123456]


def test_unsupported_types() -> None:
    with pytest.raises(RegionRoutingError):
        murmur3_32_spark(pa.array([[1]]))
    assert not is_native_bucket_type(pa.binary()) and is_native_bucket_type(pa.large_utf8())
    with pytest.raises(InvalidRegionSpecError):
        rs.bucket("k", 4).bind({"k": 0}, pa.schema([("k", pa.list_(pa.int32()))]), primary_key=["k"])


# ---------------------------------------------------------------------------------------------
# murmur3_multi / multi_bucket


def ref_multi(rows: list[tuple]) -> list[int | None]:
    out = []
    for row in rows:
        h, seen = 0, False
        for v in row:
            if v is not None:
                h = ref_hash_long(v, h) if isinstance(v, int) else ref_hash_bytes(v.encode(), h)
                seen = True
        out.append(signed(h) if seen else None)
    return out


@SETTINGS
@given(
    st.lists(
        st.tuples(st.none() | st.integers(*I64), st.none() | TEXT, st.none() | st.integers(*I64)),
        min_size=1,
        max_size=40,
    )
)
def test_murmur3_multi_matches_reference(rows: list[tuple]) -> None:
    cols = [
        pa.array([r[0] for r in rows], pa.int64()),
        pa.array([r[1] for r in rows], pa.utf8()),
        pa.array([r[2] for r in rows], pa.int64()),
    ]
    assert murmur3_multi(cols).to_pylist() == ref_multi(rows)
    buckets = rt.MultiBucket(13).apply(cols).to_pylist()
    assert buckets == [0 if h is None else (h & 0x7FFFFFFF) % 13 for h in ref_multi(rows)]


def test_murmur3_multi_single_column_and_nulls() -> None:
    a = pa.array([1, None, 3], pa.int64())
    assert murmur3_multi([a]).to_pylist() == murmur3_32_spark(a).to_pylist()
    assert murmur3_multi([a, pa.nulls(3, pa.utf8())]).to_pylist() == murmur3_32_spark(a).to_pylist()
    assert rt.MultiBucket(8).apply([a]).to_pylist() == rt.Bucket(8).apply([a]).to_pylist()
    with pytest.raises(RegionRoutingError):
        murmur3_multi([])


# ---------------------------------------------------------------------------------------------
# Serialization against Lance's initialize_mem_wal


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7


def _raw_fields(buf: bytes, tag: int) -> list[bytes]:
    """Raw payloads of length-delimited field `tag` in a protobuf message."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            _, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            if key >> 3 == tag:
                out.append(buf[i : i + n])
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise AssertionError(f"wire type {wire}")
    return out


def native_details_bytes(uri: str) -> bytes:
    """MemWalIndexDetails bytes from the newest base manifest's IndexSection."""
    best = None
    for path in Path(uri, "_versions").glob("*.manifest"):
        data = path.read_bytes()
        assert data[-4:] == b"LANC"
        (pos,) = struct.unpack_from("<Q", data, len(data) - 16)
        (n,) = struct.unpack_from("<I", data, pos)
        manifest = pb.Manifest.FromString(data[pos + 4 : pos + 4 + n])
        if best is None or manifest.version > best[0]:
            best = (manifest.version, data, manifest)
    assert best is not None
    _, data, manifest = best
    off = manifest.index_section
    (n,) = struct.unpack_from("<I", data, off)
    section = pb.IndexSection.FromString(data[off + 4 : off + 4 + n])
    (entry,) = [i for i in section.indices if i.name == "__lance_mem_wal"]
    assert entry.index_details.type_url == "/lance.table.MemWalIndexDetails"
    return entry.index_details.value


BASE = pa.table(
    {
        "id": pa.array([1, 2, 3], pa.int64()),
        "user": ["a", "b", None],
        "n32": pa.array([1, 2, 3], pa.int32()),
        "flag": [True, False, None],
        "big": pa.array(["x", "y", "z"], pa.large_string()),
        "u8": pa.array([1, 2, 3], pa.uint8()),
        "f": pa.array([1.5, -0.0, None], pa.float32()),
        "ts": pa.array([0, 10**12, None], pa.timestamp("us")),
    }
)


@pytest.mark.parametrize(
    "kwargs,ours_spec",
    [
        ({"bucket_column": "id", "num_buckets": 4}, rs.bucket("id", 4)),
        ({"bucket_column": "user", "num_buckets": 1024}, rs.bucket("user", 1024)),
        ({"bucket_column": "ts", "num_buckets": 1}, rs.bucket("ts", 1)),
        ({"bucket_column": "f", "num_buckets": 7}, rs.bucket("f", 7)),
        ({"identity_column": "user"}, rs.identity("user")),
        ({"identity_column": "n32"}, rs.identity("n32")),
        ({"identity_column": "flag"}, rs.identity("flag")),
        ({"identity_column": "big"}, rs.identity("big")),
        ({"identity_column": "u8"}, rs.identity("u8")),
        ({"unsharded": True}, rs.unsharded()),
    ],
    ids=lambda x: str(x) if isinstance(x, dict) else "",
)
def test_to_proto_bytes_equal_native(tmp_path: Path, kwargs: dict, ours_spec: rs.UnboundRegionSpec) -> None:
    uri = str(tmp_path / "t")
    ds = lance.write_dataset(BASE, uri)
    ds.initialize_mem_wal(**kwargs)
    ds = lance.dataset(uri)
    raw = native_details_bytes(uri)
    (native_spec_bytes,) = _raw_fields(raw, 7)  # MemWalIndexDetails.sharding_specs
    bound = ours_spec.bind(rs.lance_field_ids(ds), ds.schema, primary_key=ds.schema.names)
    assert bound.to_proto().SerializeToString() == native_spec_bytes
    assert bound.to_dict() == not_none(ds.mem_wal_index_details())["sharding_specs"][0]
    assert (bound.num_regions or 0) == pb.MemWalIndexDetails.FromString(raw).num_shards
    # native bytes decode to the same spec and re-encode unchanged
    decoded = rs.RegionSpec.from_proto(native_spec_bytes)
    assert decoded == bound
    assert decoded.to_proto().SerializeToString() == native_spec_bytes
    assert rs.RegionSpec.from_dict(not_none(ds.mem_wal_index_details())["sharding_specs"][0]) == bound
    # and route like native
    batch = ds.to_table().to_batches()[0]
    native = evaluate_sharding_spec(batch, bound.to_dict(), ds.lance_schema).column(0)
    assert decoded.evaluate(batch, rs.lance_field_ids(ds))[0].to_pylist() == native.to_pylist()


def test_native_proto_shapes() -> None:
    field_ids = {"id": 0, "user": 1}
    schema = pa.schema([("id", pa.int64()), ("user", pa.utf8())])
    b = rs.bucket("id", 4).bind(field_ids, schema, primary_key=schema.names).to_proto()
    assert b.SerializeToString() == bytes.fromhex(
        "0801122c"
        "0a06" + b"bucket".hex() + "120100"
        "1a06" + b"bucket".hex() + "2a05" + b"int32".hex() + "3210"
        "0a0b" + b"num_buckets".hex() + "120134"
    )
    u = rs.unsharded().bind(field_ids, schema, primary_key=schema.names).to_proto().fields[0]
    assert list(u.source_ids) == [] and u.transform == "unsharded" and not u.HasField("expression")
    i = rs.identity("user").bind(field_ids, schema, primary_key=schema.names).to_proto().fields[0]
    assert (i.field_id, list(i.source_ids), i.result_type) == ("bucket", [1], "utf8")


# ---------------------------------------------------------------------------------------------
# Transforms against simple references

TS = st.datetimes(min_value=dt.datetime(1800, 1, 1), max_value=dt.datetime(2200, 1, 1))


@SETTINGS
@given(st.lists(st.none() | TS, min_size=1, max_size=30))
def test_date_parts_match_python(values: list[dt.datetime | None]) -> None:
    arr = pa.array(values, pa.timestamp("us"))
    for t, ref in [(rt.Year(), "year"), (rt.Month(), "month"), (rt.Day(), "day"), (rt.Hour(), "hour")]:
        out = t.apply([arr])
        assert out.type == pa.int32()
        assert out.to_pylist() == [None if v is None else getattr(v, ref) for v in values]
    dates = pa.array([None if v is None else v.date() for v in values], pa.date32())
    assert rt.Month().apply([dates]).to_pylist() == [None if v is None else v.month for v in values]
    assert rt.Hour().apply([dates]).to_pylist() == [None if v is None else 0 for v in values]
    assert rt.Year().apply([dates.cast(pa.date64())]).to_pylist() == [
        None if v is None else v.year for v in values
    ]


def test_date_parts_use_the_columns_time_zone() -> None:
    utc = dt.datetime(2024, 1, 1, 2, 30, tzinfo=dt.UTC)
    arr = pa.array([utc], pa.timestamp("us", "America/New_York"))
    assert [t.apply([arr])[0].as_py() for t in (rt.Year(), rt.Month(), rt.Day(), rt.Hour())] == [
        2023,
        12,
        31,
        21,
    ]


def ref_truncate(v: int, w: int) -> int:
    return v - int(math.copysign(abs(v) % w, v))  # SQL %: the remainder takes the dividend's sign


@pytest.mark.parametrize("typ", [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.uint64()], ids=str)
@SETTINGS
@given(data=st.data(), width=st.integers(1, 1 << 40))
def test_truncate_integers(typ: pa.DataType, data: st.DataObject, width: int) -> None:
    lo, hi = INT_RANGES[typ]
    values = data.draw(st.lists(st.none() | st.integers(lo, hi), min_size=1, max_size=30))
    out = rt.Truncate(width).apply([pa.array(values, typ)])
    assert out.type == typ
    assert out.to_pylist() == [None if v is None else ref_truncate(v, width) for v in values]


@SETTINGS
@given(st.lists(st.none() | TEXT, min_size=1, max_size=30), st.integers(1, 10))
def test_truncate_strings(values: list[str | None], width: int) -> None:
    for typ in (pa.utf8(), pa.large_utf8()):
        out = rt.Truncate(width).apply([pa.array(values, typ)])
        assert out.to_pylist() == [None if v is None else v[:width] for v in values]


def test_identity_and_unsharded() -> None:
    arr = pa.array(["a", None, "b"])
    assert rt.Identity().apply([arr]).to_pylist() == ["a", None, "b"]
    assert rt.Unsharded().apply([], num_rows=3).to_pylist() == [0, 0, 0]
    spec = rs.unsharded().bind({}, pa.schema([]), primary_key=[])
    assert spec.evaluate(pa.table({"x": [1, 2]}), {"x": 0})[0].to_pylist() == [0, 0]
    assert spec.num_regions == 1


# ---------------------------------------------------------------------------------------------
# Projection soundness: P(v) implies project(P)(transform(v))


@st.composite
def predicate_and_value(draw: st.DrawFn, values: st.SearchStrategy) -> tuple:
    v = draw(values)
    kind = draw(st.sampled_from(["eq", "in", "range", "range", "point"]))
    if kind == "eq":
        return Eq(draw(st.just(v) | values)), v
    if kind == "in":
        others = draw(st.lists(values, max_size=5))
        return In(others + ([v] if draw(st.booleans()) else [])), v
    if kind == "point":
        return Range(v, True, v, True), v
    a, b = draw(values), draw(values)
    lo, hi = (min(a, v), max(b, v)) if draw(st.booleans()) else (a, b)
    return Range(
        draw(st.none() | st.just(lo)), draw(st.booleans()), draw(st.none() | st.just(hi)), draw(st.booleans())
    ), v


def _check_sound(t: rt.Transform, typ: pa.DataType, pred: Predicate, v: object) -> None:
    assume(pred.test(v))
    projected = t.project(pred, typ)
    if projected is not None:
        region_value = t.apply([pa.array([v], typ)], 1)[0].as_py()
        assert projected.test(region_value), (t, pred, v, projected, region_value)


PROJECTION_CASES = [
    (rt.Identity(), pa.int64(), st.integers(*I64)),
    (rt.Bucket(16), pa.int64(), st.integers(*I64)),
    (rt.Bucket(7), pa.int32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    (rt.Bucket(5), pa.utf8(), TEXT),
    (rt.Truncate(10), pa.int64(), st.integers(-(1 << 62), 1 << 62)),
    (rt.Truncate(3), pa.int16(), st.integers(-(1 << 15), (1 << 15) - 1)),
    (rt.Truncate(2), pa.utf8(), TEXT),
    (rt.Year(), pa.timestamp("us"), TS),
    (rt.Month(), pa.timestamp("us"), TS),
    (rt.Day(), pa.timestamp("us"), TS),
    (rt.Hour(), pa.timestamp("us"), TS),
    (rt.Day(), pa.date32(), st.dates()),
    (rt.Hour(), pa.timestamp("us", "UTC"), TS.map(lambda d: d.replace(tzinfo=dt.UTC))),
    (rt.Hour(), pa.timestamp("us", "Asia/Kolkata"), TS.map(lambda d: d.replace(tzinfo=dt.UTC))),
    (Expression("col0 % 7"), pa.int64(), st.integers(-(1 << 40), 1 << 40)),
    (rt.MultiBucket(9), pa.int64(), st.integers(*I64)),
]


@pytest.mark.parametrize("t,typ,values", PROJECTION_CASES, ids=lambda x: str(x))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(data=st.data())
def test_project_is_sound(
    t: rt.Transform, typ: pa.DataType, values: st.SearchStrategy, data: st.DataObject
) -> None:
    pred, v = data.draw(predicate_and_value(values))
    _check_sound(t, typ, pred, v)


CYCLIC_CASES = [
    (rt.Month(), dt.timedelta(days=200)),
    (rt.Day(), dt.timedelta(days=40)),
    (rt.Hour(), dt.timedelta(hours=30)),
]


@pytest.mark.parametrize("t,spread", CYCLIC_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("tz", [None, "UTC"])
@SETTINGS
@given(v=TS, before=st.floats(0, 1), after=st.floats(0, 1), inc=st.tuples(st.booleans(), st.booleans()))
def test_cyclic_projection_of_short_ranges_is_sound(
    t: rt.Transform,
    spread: dt.timedelta,
    tz: str | None,
    v: dt.datetime,
    before: float,
    after: float,
    inc: tuple,
) -> None:
    if tz is not None:
        v = v.replace(tzinfo=dt.UTC)
    pred = Range(v - spread * before, inc[0], v + spread * after, inc[1])
    typ = pa.timestamp("us", tz)
    _check_sound(t, typ, pred, v)
    if spread * (before + after) < dt.timedelta(hours=20):
        assert t.project(pred, typ) is not None  # short ranges do prune


@SETTINGS
@given(st.integers(*I64), TEXT, st.lists(st.integers(*I64), max_size=4), st.lists(TEXT, max_size=4))
def test_multi_bucket_projection_is_sound(a: int, s: str, more_a: list[int], more_s: list[str]) -> None:
    t = rt.MultiBucket(11)
    types = [pa.int64(), pa.utf8()]
    projected = t.project_sources([In([a, *more_a]), In([*more_s, s])], types)
    region_value = t.apply([pa.array([a], types[0]), pa.array([s], types[1])])[0].as_py()
    assert projected is not None and projected.test(region_value)
    assert t.project_sources([Eq(a), Range(lo=s)], types) is None


def test_projection_shapes() -> None:
    assert rt.Bucket(4).project(Eq(5), pa.int64()) == Eq(rt.Bucket(4).apply([pa.array([5])])[0].as_py())
    assert rt.Bucket(4).project(Range(1, True, 9, True), pa.int64()) is None
    assert rt.Identity().project(Range(1, False, 9, True)) == Range(1, False, 9, True)
    assert rt.Year().project(
        Range(dt.datetime(2020, 5, 1), False, dt.datetime(2022, 1, 1), False), pa.timestamp("us")
    ) == Range(2020, True, 2022, True)
    assert rt.Year().project(Range(lo=dt.date(2020, 5, 1)), pa.date32()) == Range(2020, True, None, True)
    assert rt.Truncate(10).project(Range(15, True, 31, True), pa.int64()) == Range(10, True, 30, True)
    assert rt.Truncate(2).project(In(["abc", "abd", "x"]), pa.utf8()) == In(["ab", "x"])
    assert rt.Month().project(
        Range(dt.datetime(2023, 11, 5), True, dt.datetime(2024, 2, 1), True), pa.timestamp("us")
    ) == In([1, 2, 11, 12])
    assert (
        rt.Month().project(
            Range(dt.datetime(2023, 1, 5), True, dt.datetime(2024, 2, 1), True), pa.timestamp("us")
        )
        is None
    )
    assert rt.Hour().project(
        Range(dt.datetime(2024, 1, 1, 22), True, dt.datetime(2024, 1, 2, 1), True), pa.timestamp("us")
    ) == In([0, 1, 22, 23])
    assert rt.Unsharded().project(Eq(1)) is None
    # values that cannot be of the column's type do not prune
    assert rt.Bucket(4).project(Eq("x"), pa.int64()) is None
    assert rt.Bucket(4).project(In([]), pa.int64()) == In([])


# ---------------------------------------------------------------------------------------------
# Pruning


def test_prune_bucket_spec() -> None:
    schema = pa.schema([("user_id", pa.int64()), ("name", pa.utf8())])
    spec = rs.bucket("user_id", 10).bind({"user_id": 0, "name": 1}, schema, primary_key=["user_id"])
    regions = [(b,) for b in range(10)]
    want = rt.Bucket(10).apply([pa.array([123], pa.int64())])[0].as_py()
    assert spec.prune(regions, {"user_id": Eq(123)}) == [(want,)]
    assert spec.prune(regions, {0: Eq(123)}) == [(want,)]
    assert spec.prune(regions, {"uid": Eq(123)}, field_ids={"uid": 0}) == [(want,)]
    assert spec.prune(regions, {"user_id": Range(0, True, 100, True)}) == regions
    assert spec.prune(regions, {"name": Eq("x")}) == regions
    assert spec.prune(regions, {"user_id": [Eq(123), In([123, 5])]}) == [(want,)]
    assert spec.prune(regions, {"user_id": In([])}) == []
    got = {v for (v,) in spec.prune(regions, {"user_id": In([1, 2, 3])})}
    assert got == set(rt.Bucket(10).apply([pa.array([1, 2, 3], pa.int64())]).to_pylist())


def test_prune_multi_field_spec() -> None:
    schema = pa.schema([("ts", pa.timestamp("us")), ("tenant", pa.utf8()), ("id", pa.int64())])
    ids = {"ts": 0, "tenant": 1, "id": 2}
    spec = (
        rs.year("ts", field_id="y")
        + rs.identity("tenant", field_id="t")
        + rs.multi_bucket(["tenant", "id"], 4, field_id="b")
    ).bind(ids, schema, primary_key=list(ids))
    regions = [(y, t, b) for y in (2022, 2023, 2024) for t in ("a", "b", None) for b in range(4)]
    bucket_a7 = rt.MultiBucket(4).apply([pa.array(["a"]), pa.array([7], pa.int64())])[0].as_py()
    kept = spec.prune(regions, {"ts": Range(lo=dt.datetime(2023, 6, 1)), "tenant": Eq("a"), "id": Eq(7)})
    assert kept == [(2023, "a", bucket_a7), (2024, "a", bucket_a7)]
    # identity regions whose value is NULL never match an equality
    assert all(r[1] is not None for r in spec.prune(regions, {"tenant": In(["a", "b"])}))


# ---------------------------------------------------------------------------------------------
# SQL expressions


def _eval(spec: rs.UnboundRegionSpec, table: pa.Table) -> list[list]:
    ids = {n: i for i, n in enumerate(table.schema.names)}
    return [
        a.to_pylist()
        for a in spec.bind(ids, table.schema, primary_key=table.column_names).evaluate(table, ids)
    ]


@pytest.mark.parametrize(
    "typ",
    [
        pa.int32(),
        pa.int64(),
        pa.uint64(),
        pa.utf8(),
        pa.large_utf8(),
        pa.float32(),
        pa.date32(),
        pa.timestamp("ns", "UTC"),
        pa.bool_(),
    ],
    ids=str,
)
def test_expression_murmur3_equals_bucket(typ: pa.DataType) -> None:
    rng = np.random.default_rng(1)
    raw = [int(x) for x in rng.integers(-(1 << 31), 1 << 31, 500)]
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        col = pa.array([f"s{v}" for v in raw], typ)
    elif pa.types.is_boolean(typ):
        col = pa.array([v % 2 == 0 for v in raw])
    elif pa.types.is_floating(typ):
        col = pa.array([v / 7 for v in raw], typ)
    elif pa.types.is_unsigned_integer(typ):
        col = pa.array([v & 0xFFFFFFFF for v in raw], typ)
    else:
        col = pa.array(raw, pa.int32() if typ.bit_width == 32 else pa.int64()).cast(typ)
    col = pa.concat_arrays([col, pa.nulls(3, typ)])
    table = pa.table({"k": col})
    sql = "coalesce((murmur3(col0) & 2147483647) % 16, 0)"
    assert _eval(rs.expression(sql, ["k"], "int32"), table) == _eval(rs.bucket("k", 16), table)


def test_expression_murmur3_multi_equals_multi_bucket() -> None:
    table = pa.table({"a": pa.array([1, None, 3, None], pa.int32()), "b": ["x", "y", None, None]})
    sql = "coalesce((murmur3_multi(col0, col1) & 2147483647) % 8, 0)"
    assert _eval(rs.expression(sql, ["a", "b"], "int32"), table) == _eval(
        rs.multi_bucket(["a", "b"], 8), table
    )
    # NULL in, NULL out for the hash itself
    raw = _eval(rs.expression("murmur3(col0)", ["a"], pa.int32()), table)[0]
    assert raw == murmur3_32_spark(table.column("a")).to_pylist() and raw[1] is None


def test_expression_equals_date_parts_and_truncate() -> None:
    table = pa.table(
        {
            "ts": pa.array(
                [dt.datetime(1969, 12, 31, 23), dt.datetime(2024, 2, 29, 5), None], pa.timestamp("us")
            ),
            "n": pa.array([-7, 13, None], pa.int32()),
            "s": ["héllo", "ab", None],
        }
    )
    for part, make in [("year", rs.year), ("month", rs.month), ("day", rs.day), ("hour", rs.hour)]:
        assert _eval(rs.expression(f"date_part('{part}', col0)", ["ts"], "int32"), table) == _eval(
            make("ts"), table
        )
    assert _eval(rs.expression("col0 - (col0 % 4)", ["n"], "int32"), table) == _eval(
        rs.truncate("n", 4), table
    )
    assert _eval(rs.expression("left(col0, 3)", ["s"], "utf8"), table) == _eval(rs.truncate("s", 3), table)


def test_expression_sql_handling() -> None:
    table = pa.table({"k": pa.array([1, 2], pa.int32()), "s": ["a", "b"]})
    # quoted text is not rewritten; nested and upper-case calls are
    got = _eval(rs.expression("concat('murmur3(', col1, ')')", ["k", "s"], "utf8"), table)
    assert got == [["murmur3(a)", "murmur3(b)"]]
    nested = _eval(rs.expression("MURMUR3(murmur3(col0))", ["k"], "int32"), table)[0]
    assert nested == murmur3_32_spark(murmur3_32_spark(table.column("k"))).to_pylist()
    # the result is cast to result_type
    assert _eval(rs.expression("col0 + 1", ["k"], "int64"), table) == [[2, 3]]


def test_expression_errors() -> None:
    schema = pa.schema([("k", pa.int64())])
    for sql in [
        "random() * col0",
        "now()",
        "col0 + ",
        "col1",
        "nosuchfn(col0)",
        "murmur3()",
        "murmur3(col0, col0)",
        "'unterminated",
    ]:
        with pytest.raises(InvalidRegionSpecError):
            rs.expression(sql, ["k"], "int64").bind({"k": 0}, schema, primary_key=["k"])
    assert Expression("'now()' || col0").sql  # quoted volatile names are fine


def test_expression_is_deterministic_and_cached() -> None:
    t = Expression("coalesce((murmur3(col0) & 2147483647) % 5, 0)")
    a = pa.array(range(1000), pa.int64())
    assert t.apply([a]).to_pylist() == t.apply([a]).to_pylist()
    assert len(t._cache) == 1
    t.apply([a.cast(pa.int32())])
    assert len(t._cache) == 2


# ---------------------------------------------------------------------------------------------
# Column removal and NULL safety


def test_removed_source_column_reads_as_null(tmp_path: Path) -> None:
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "tenant": ["a", "b"], "v": [1.0, 2.0]})
    ds = lance.write_dataset(table, str(tmp_path / "t"))
    ids = rs.lance_field_ids(ds)
    spec = (
        rs.bucket("tenant", 8, field_id="b")
        + rs.identity("tenant", field_id="i")
        + rs.expression("coalesce(col0, 'none')", ["tenant"], "utf8", field_id="e")
    ).bind(ids, ds.schema, primary_key=ds.schema.names)
    ds.drop_columns(["tenant"])
    ds = lance.dataset(str(tmp_path / "t"))
    ids_after = rs.lance_field_ids(ds)
    assert "tenant" not in ids_after and ids_after["v"] == ids["v"]
    rebound = rs.RegionSpec.from_proto(spec.to_proto().SerializeToString()).bind(ids_after, ds.schema)
    for s in (spec, rebound):
        b, i, e = s.evaluate(ds.to_table(), ids_after)
        assert b.to_pylist() == [0, 0] and i.to_pylist() == [None, None] and e.to_pylist() == ["none", "none"]
        assert i.type == pa.utf8()


def test_zero_rows() -> None:
    schema = pa.schema([("ts", pa.timestamp("us")), ("n", pa.int64()), ("s", pa.utf8())])
    table = schema.empty_table()
    spec = (
        rs.year("ts")
        + rs.truncate("n", 3, field_id="t")
        + rs.bucket("s", 4, field_id="b")
        + rs.multi_bucket(["n", "s"], 4, field_id="m")
        + rs.expression("murmur3(col0)", ["s"], "int32", field_id="e")
        + rs.unsharded(field_id="u")
    )
    ids = {"ts": 0, "n": 1, "s": 2}
    assert [len(a) for a in spec.bind(ids, schema, primary_key=list(ids)).evaluate(table, ids)] == [0] * 6


def test_missing_column_in_data_is_an_error() -> None:
    spec = rs.bucket("id", 4).bind({"id": 0}, pa.schema([("id", pa.int64())]), primary_key=["id"])
    with pytest.raises(RegionRoutingError):
        spec.evaluate(pa.table({"other": [1]}), {"id": 0, "other": 1})


def test_null_safety() -> None:
    table = pa.table(
        {"ts": pa.nulls(2, pa.timestamp("us")), "n": pa.nulls(2, pa.int64()), "s": pa.nulls(2, pa.utf8())}
    )
    assert _eval(
        rs.year("ts")
        + rs.truncate("n", 3, field_id="t")
        + rs.truncate("s", 3, field_id="u")
        + rs.bucket("s", 4, field_id="b")
        + rs.identity("n", field_id="i"),
        table,
    ) == [[None, None], [None, None], [None, None], [0, 0], [None, None]]


# ---------------------------------------------------------------------------------------------
# Errors


def test_spec_errors() -> None:
    schema = pa.schema([("id", pa.int64()), ("s", pa.utf8())])
    ids = {"id": 0, "s": 1}
    bad_counts: list[Any] = [0, -1, 1025, "4", True, 2.0]
    for n in bad_counts:
        with pytest.raises(InvalidRegionSpecError):
            rs.bucket("id", n)
    with pytest.raises(InvalidRegionSpecError):
        rt.Bucket(0)
    with pytest.raises(InvalidRegionSpecError):
        rs.truncate("id", 0)
    with pytest.raises(InvalidRegionSpecError, match="unknown columns"):
        rs.bucket("nope", 4).bind(ids, schema, primary_key=list(ids))
    with pytest.raises(InvalidRegionSpecError):
        rs.year("s").bind(ids, schema, primary_key=list(ids))
    with pytest.raises(InvalidRegionSpecError):
        rs.truncate("s", 2).bind(
            ids, pa.schema([("id", pa.int64()), ("s", pa.float64())]), primary_key=list(ids)
        )
    with pytest.raises(InvalidRegionSpecError, match="duplicate"):
        (rs.bucket("id", 4) + rs.identity("s")).bind(ids, schema, primary_key=list(ids))
    with pytest.raises(InvalidRegionSpecError):
        rs.multi_bucket([], 4)
    with pytest.raises(InvalidRegionSpecError):
        rs.expression("col0", ["id"], "no_such_type")


def _proto(
    transform: str | None = "bucket",
    params: dict | None = None,
    expression: str | None = None,
    result_type: str = "int32",
    source_ids: tuple = (0,),
) -> pb.ShardingSpec:
    msg = pb.ShardingSpec(spec_id=1)
    f = msg.fields.add(field_id="bucket", source_ids=list(source_ids), result_type=result_type)
    if transform is not None:
        f.transform = transform
    if expression is not None:
        f.expression = expression
    f.parameters.update(params or {})
    return msg


@pytest.mark.parametrize(
    "msg",
    [
        _proto("zorder"),
        _proto("bucket", {}),
        _proto("bucket", {"num_buckets": "abc"}),
        _proto("bucket", {"num_buckets": "0"}),
        _proto("truncate", {"width": "-3"}),
        _proto(None),
        _proto("identity", expression="col0"),
        _proto("identity", result_type="mystery"),
        _proto("identity", source_ids=()),
        _proto("unsharded", source_ids=(1,)),
    ],
    ids=lambda m: str(m.fields[0].transform or m.fields[0].expression or "none"),
)
def test_from_proto_rejects_malformed(msg: pb.ShardingSpec) -> None:
    with pytest.raises(InvalidRegionSpecError):
        rs.RegionSpec.from_proto(msg)


def test_from_proto_accepts_large_bucket_counts_like_native_evaluation() -> None:
    spec = rs.RegionSpec.from_proto(_proto("bucket", {"num_buckets": "5000"}))
    assert spec.num_regions == 5000
    with pytest.raises(InvalidRegionSpecError):
        rs.RegionSpec(0, spec.fields)


# ---------------------------------------------------------------------------------------------
# Region values, field ids, type names


@pytest.mark.parametrize(
    "value,typ,raw",
    [
        (5, "int32", b"\x05\x00\x00\x00"),
        (-2, "int64", b"\xfe" + b"\xff" * 7),
        (300, "uint16", b"\x2c\x01"),
        ("héllo", "utf8", "héllo".encode()),
        ("", "large_utf8", b""),
        (True, "boolean", b"\x01"),
        (b"\x00\x01", "binary", b"\x00\x01"),
        (1.5, "float64", struct.pack("<d", 1.5)),
        (dt.date(1970, 1, 2), "date32", b"\x01\x00\x00\x00"),
        (dt.datetime(1970, 1, 1, 0, 0, 1), "timestamp[ms]", struct.pack("<q", 1000)),
    ],
)
def test_region_value_encoding(value: object, typ: str, raw: bytes) -> None:
    assert rv.encode_region_value(value, typ) == raw
    assert rv.encode_region_value(value, rv.result_arrow_type(typ)) == raw
    assert rv.decode_region_value(raw, typ) == value


def test_region_value_encoding_edges() -> None:
    assert rv.encode_region_value(None, "int32") is None and rv.decode_region_value(None, "int32") is None
    assert rv.encode_region_value(pa.scalar(7, pa.int32()), pa.int32()) == b"\x07\x00\x00\x00"
    with pytest.raises(InvalidRegionSpecError):
        rv.decode_region_value(b"\x01\x02", "int32")
    with pytest.raises(RegionRoutingError):
        rv.encode_region_value(1 << 40, "int32")
    with pytest.raises(InvalidRegionSpecError):
        rv.encode_region_value([1], pa.list_(pa.int32()))


@pytest.mark.parametrize(
    "typ",
    [
        pa.int8(),
        pa.uint64(),
        pa.utf8(),
        pa.large_utf8(),
        pa.bool_(),
        pa.float32(),
        pa.date32(),
        pa.timestamp("us"),
        pa.timestamp("ns", "Europe/Paris"),
        pa.time32("ms"),
        pa.decimal128(12, 3),
        pa.large_binary(),
    ],
    ids=str,
)
def test_type_names_round_trip(typ: pa.DataType) -> None:
    assert rv.result_arrow_type(rv.result_type_name(typ)) == typ


def test_native_type_names() -> None:
    assert [
        rv.result_type_name(t) for t in (pa.int32(), pa.utf8(), pa.large_utf8(), pa.bool_(), pa.uint8())
    ] == ["int32", "utf8", "large_utf8", "boolean", "uint8"]


def test_lance_field_ids(tmp_path: Path) -> None:
    schema = pa.schema(
        [("a", pa.int64()), ("s", pa.struct([("x", pa.int32()), ("y", pa.utf8())])), ("b", pa.utf8())]
    )
    assert rs.lance_field_ids(schema) == {"a": 0, "s": 1, "b": 4}
    ds = lance.write_dataset(schema.empty_table(), str(tmp_path / "t"))
    assert rs.lance_field_ids(ds) == rs.lance_field_ids(ds.lance_schema) == {"a": 0, "s": 1, "b": 4}
    ds.drop_columns(["a"])
    ds.add_columns({"c": "b"})
    ds.alter_columns({"path": "b", "name": "b2"})  # type: ignore[dict-item]  # lance types each as an Iterable
    assert rs.lance_field_ids(lance.dataset(str(tmp_path / "t"))) == {"s": 1, "b2": 4, "c": 5}
    with pytest.raises(TypeError):
        rs.lance_field_ids(42)


def test_describe() -> None:
    spec = rs.bucket("id", 4).bind({"id": 3}, pa.schema([("id", pa.int64())]), primary_key=["id"])
    d = spec.describe()
    assert d["fields"][0]["columns"] == ["id"] and d["fields"][0]["display"] == "bucket[4](id)"
    assert rs.RegionSpec.from_proto(spec.to_proto()).describe()["fields"][0]["display"] == "bucket[4](#3)"


# ---------------------------------------------------------------------------------------------
# Throughput (printed, not asserted)


def test_routing_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    n = 1_000_000
    ints = pa.table({"k": pa.array(np.random.default_rng(0).integers(-(1 << 62), 1 << 62, n))})
    strs = pa.table({"k": pa.array([f"user-{i:09d}" for i in range(n)])})
    spec = rs.RegionSpec(1, native_spec(1024).fields)
    lines = []
    for name, table in [("int64", ints), ("string", strs)]:
        spec.evaluate(table, {"k": 0})  # warm up
        best = min(_timed(lambda t=table: spec.evaluate(t, {"k": 0})) for _ in range(3))
        batch = table.combine_chunks().to_batches()[0]
        native = min(
            _timed(
                lambda b=batch, s=table.schema: evaluate_sharding_spec(
                    b, spec.to_dict(), LanceSchema.from_pyarrow(s)
                )
            )
            for _ in range(3)
        )
        lines.append(
            f"bucket routing, 1M {name} keys: {best * 1e3:.1f} ms ({n / best / 1e6:.1f} M rows/s); "
            f"native {native * 1e3:.1f} ms"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- vectorized integer expressions against DataFusion --------------------------------------------

_SIGNED = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]


def _int_expressions(ncols: int) -> st.SearchStrategy[str]:
    leaves = st.one_of(
        st.sampled_from([f"col{i}" for i in range(ncols)]),
        st.one_of(st.integers(0, 9), st.sampled_from([2**31, 2**63 - 1])).map(str),
    )
    return st.recursive(
        leaves,
        lambda c: st.one_of(
            st.tuples(c, st.sampled_from("+-*/%"), c).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            c.map(lambda x: f"-({x})"),
            c.map(lambda x: f"abs({x})"),
            c.map(lambda x: f"MURMUR3({x})"),
            st.lists(c, min_size=1, max_size=3).map(lambda xs: f"murmur3_multi({', '.join(xs)})"),
        ),
        max_leaves=6,
    )


@st.composite
def _int_cases(draw: st.DrawFn) -> tuple[str, list[pa.Array]]:
    types = draw(st.lists(st.sampled_from(_SIGNED), min_size=1, max_size=2))
    n = draw(st.integers(1, 6))
    cols = []
    for t in types:
        lo, hi = -(1 << (t.bit_width - 1)), (1 << (t.bit_width - 1)) - 1
        values = st.one_of(st.none(), st.integers(lo, hi), st.sampled_from([lo, hi, -1, 0]))
        cols.append(pa.array(draw(st.lists(values, min_size=n, max_size=n)), t))
    return draw(_int_expressions(len(types))), cols


def _outcome(run: Callable[..., pa.Array]) -> tuple[str, object, object]:
    try:
        out = run()
    except (RegionRoutingError, InvalidRegionSpecError):
        return ("error", None, None)
    return ("value", out.type, out.to_pylist())


@SETTINGS
@given(_int_cases())
def test_vectorized_int_expressions_equal_datafusion(case: tuple[str, list[pa.Array]]) -> None:
    """Every expression of the vectorized subset gives DataFusion's values, NULLs, type and errors."""
    sql, cols = case
    expr = Expression(sql)
    types = [c.type for c in cols]
    fast = expr.vectorized(types)
    assert fast is not None, sql
    batch = pa.RecordBatch.from_arrays(cols, names=[f"col{i}" for i in range(len(cols))])
    n = len(cols[0])
    got = _outcome(lambda: as_array(fast(cols, n), n))
    want = _outcome(lambda: expr.compile(types).evaluate(batch))
    assert got == want, sql


@pytest.mark.parametrize("t", _SIGNED)
@pytest.mark.parametrize(
    "sql", ["col0 / col1", "col0 % col1", "col0 / -1", "col0 % -(1)", "abs(col0) % col1"]
)
def test_vectorized_int_expressions_at_the_edges_equal_datafusion(t: pa.DataType, sql: str) -> None:
    """The minimum value divided by -1, zero divisors, NULLs: row by row, DataFusion's outcome."""
    lo = -(1 << (t.bit_width - 1))
    cols = [pa.array([lo, lo, 5, None, lo, 7, -7, lo], t), pa.array([-1, 0, -1, -1, None, -2, 2, 1], t)]
    expr = Expression(sql)
    fast = expr.vectorized([t, t])
    assert fast is not None
    for i in range(len(cols[0])):
        row = [c.slice(i, 1) for c in cols]
        batch = pa.RecordBatch.from_arrays(row, names=["col0", "col1"])
        got = _outcome(lambda row=row: as_array(fast(row, 1), 1))
        assert got == _outcome(lambda batch=batch: expr.compile([t, t]).evaluate(batch)), (sql, i)


_HASHED = {
    "string": pa.array(["a", "", None, "h\u00e9llo"]),
    "large_string": pa.array(["a", "", None, "x"], pa.large_string()),
    "binary": pa.array([b"a", b"", None, b"\x00"]),
    "date32": pa.array([dt.date(2024, 1, 1), None, dt.date(1969, 12, 31), dt.date(2000, 2, 29)]),
    "float64": pa.array([1.5, -0.0, None, float("nan")]),
    "float32": pa.array([1.5, -0.0, None, 2.0], pa.float32()),
    "bool": pa.array([True, False, None, True]),
    "timestamp": pa.array([dt.datetime(2024, 1, 1), None, dt.datetime(1960, 1, 1), None], pa.timestamp("us")),
    "uint32": pa.array([1, 2, None, 2**32 - 1], pa.uint32()),
}


@pytest.mark.parametrize("column", list(_HASHED))
@pytest.mark.parametrize("sql", ["murmur3(col0)", "murmur3(col0) % 4", "abs(murmur3_multi(col0, col1)) % 3"])
def test_vectorized_hashes_of_every_type_equal_datafusion(column: str, sql: str) -> None:
    cols = [_HASHED[column], pa.array([1, None, 3, 4], pa.int64())][: 2 if "col1" in sql else 1]
    types = [c.type for c in cols]
    expr = Expression(sql)
    fast = expr.vectorized(types)
    assert fast is not None
    batch = pa.RecordBatch.from_arrays(cols, names=[f"col{i}" for i in range(len(cols))])
    assert _outcome(lambda: as_array(fast(cols, 4), 4)) == _outcome(
        lambda: expr.compile(types).evaluate(batch)
    )


def test_expressions_outside_the_vectorized_subset_use_datafusion() -> None:
    text = pa.array(["abc", None])
    for sql, types in [
        ("left(col0, 1)", [pa.string()]),
        ("col0 + 1", [pa.string()]),
        ("col0 % 3", [pa.uint64()]),
        ("col0 * 1.5", [pa.int64()]),
        ("coalesce(col0, 1)", [pa.int64()]),
        ("col0 --1", [pa.int64()]),
        ("col0 /* a comment */ % 2", [pa.int64()]),
    ]:
        assert Expression(sql).vectorized(types) is None, sql
    assert Expression("left(col0, 1)").apply([text]).to_pylist() == ["a", None]
    assert Expression("col0 --1").apply([pa.array([5], pa.int64())]).to_pylist() == [5]
