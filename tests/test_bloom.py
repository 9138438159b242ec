"""Tests of memwal_df.format.bloom: SipHash-1-3 against a pure-Python reference, byte identity with the
``bloom_filter.bin`` files Lance 14 writes, and the filter's no-false-negative property."""

from __future__ import annotations

import datetime
import glob
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwal_df.format import bloom
from memwal_df.format.bloom import BloomFilter, hash_primary_keys, siphash13

# No example database: the tests must leave nothing behind in the project tree.
HYP = settings(database=None, deadline=None, max_examples=150)

PK = "lance-schema:unenforced-primary-key"
PK_POS = "lance-schema:unenforced-primary-key:position"
MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------------
# Pure-Python references
# --------------------------------------------------------------------------------------------------


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & MASK64


def ref_siphash13(msg: bytes, k0: int = 0, k1: int = 0) -> int:
    """SipHash-1-3, straight from the reference description (one compression, three finalization rounds)."""
    v = [
        k0 ^ 0x736F6D6570736575,
        k1 ^ 0x646F72616E646F6D,
        k0 ^ 0x6C7967656E657261,
        k1 ^ 0x7465646279746573,
    ]

    def sipround() -> None:
        v[0] = (v[0] + v[1]) & MASK64
        v[1] = _rotl(v[1], 13) ^ v[0]
        v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & MASK64
        v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & MASK64
        v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & MASK64
        v[1] = _rotl(v[1], 17) ^ v[2]
        v[2] = _rotl(v[2], 32)

    full = len(msg) // 8 * 8
    for i in range(0, full, 8):
        m = int.from_bytes(msg[i : i + 8], "little")
        v[3] ^= m
        sipround()
        v[0] ^= m
    b = ((len(msg) & 0xFF) << 56) | int.from_bytes(msg[full:], "little")
    v[3] ^= b
    sipround()
    v[0] ^= b
    v[2] ^= 0xFF
    for _ in range(3):
        sipround()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def ref_hash_stream(type_name: str, value: Any) -> bytes:
    """Rust `Hash` bytes Lance's compute_row_hash feeds for one PK cell (null flag, then the value)."""
    if value is None:
        return b"\x01"
    if type_name == "int32":
        return b"\x00" + struct.pack("<i", value)
    if type_name == "int64":
        return b"\x00" + struct.pack("<q", value)
    if type_name == "utf8":
        return b"\x00" + value.encode("utf-8") + b"\xff"
    if type_name == "binary":
        return b"\x00" + struct.pack("<Q", len(value)) + value
    return b"\x00"  # every other type: the flag only


def ref_row_hashes(type_names: list[str], rows: list[tuple[Any, ...]]) -> list[int]:
    streams = [b"".join(ref_hash_stream(t, v) for t, v in zip(type_names, row, strict=True)) for row in rows]
    return [ref_siphash13(s) for s in streams]


# --------------------------------------------------------------------------------------------------
# 1. Vectorized SipHash == reference
# --------------------------------------------------------------------------------------------------

U64 = st.integers(min_value=0, max_value=MASK64)


def _offsets(msgs: list[bytes]) -> tuple[bytes, np.ndarray]:
    return b"".join(msgs), np.concatenate([[0], np.cumsum([len(m) for m in msgs])]).astype(np.int64)


@HYP
@given(msgs=st.lists(st.binary(max_size=40), max_size=25), k0=U64, k1=U64)
def test_siphash_matches_reference_on_random_messages(msgs: list[bytes], k0: int, k1: int) -> None:
    data, offs = _offsets(msgs)
    got = siphash13(data, offs, k0=k0, k1=k1)
    assert got.dtype == np.uint64
    assert got.tolist() == [ref_siphash13(m, k0, k1) for m in msgs]


@HYP
@given(seed=st.integers(0, 2**32 - 1), k0=U64, k1=U64)
def test_siphash_every_length_0_to_40(seed: int, k0: int, k1: int) -> None:
    rng = np.random.default_rng(seed)
    mixed = [rng.bytes(n) for n in range(41)]  # every length in one batch: the ragged path
    data, offs = _offsets(mixed)
    assert siphash13(data, offs, k0=k0, k1=k1).tolist() == [ref_siphash13(m, k0, k1) for m in mixed]
    for n in range(41):  # one length per batch: the uniform path
        same = [rng.bytes(n) for _ in range(3)]
        data, offs = _offsets(same)
        assert siphash13(data, offs, k0=k0, k1=k1).tolist() == [ref_siphash13(m, k0, k1) for m in same]


def test_siphash_skewed_lengths_and_offsets() -> None:
    rng = np.random.default_rng(7)
    msgs = [rng.bytes(3000)] + [rng.bytes(int(n)) for n in rng.integers(0, 12, size=200)] + [b""]
    data, offs = _offsets(msgs)
    assert siphash13(np.frombuffer(data, np.uint8), offs).tolist() == [ref_siphash13(m) for m in msgs]
    # The first message need not start at 0.
    assert siphash13(b"junk" + data, offs + 4).tolist() == [ref_siphash13(m) for m in msgs]
    assert siphash13(b"", np.array([0])).size == 0
    with pytest.raises(ValueError):
        siphash13(b"abc", np.array([0, 4]))
    with pytest.raises(ValueError):
        siphash13(b"abc", np.array([2, 1]))


# --------------------------------------------------------------------------------------------------
# 1b. hash_primary_keys == reference encoder + reference SipHash
# --------------------------------------------------------------------------------------------------

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
TYPES: dict[str, tuple[pa.DataType, st.SearchStrategy[Any]]] = {
    "int32": (pa.int32(), I32),
    "int64": (pa.int64(), I64),
    "utf8": (pa.utf8(), st.text(max_size=20)),
    "binary": (pa.binary(), st.binary(max_size=20)),
    # Lance accepts these as key types but hashes only their null flag.
    "uint64": (pa.uint64(), st.integers(0, MASK64)),
    "int16": (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    "large_utf8": (pa.large_utf8(), st.text(max_size=10)),
    "large_binary": (pa.large_binary(), st.binary(max_size=10)),
    "bool": (pa.bool_(), st.booleans()),
    "date32": (pa.date32(), st.dates(datetime.date(1970, 1, 1), datetime.date(2100, 1, 1))),
}


@st.composite
def key_columns(draw: st.DrawFn) -> tuple[list[str], list[tuple[Any, ...]]]:
    names = draw(st.lists(st.sampled_from(sorted(TYPES)), min_size=1, max_size=3))
    nrows = draw(st.integers(0, 30))
    rows = [tuple(draw(st.none() | TYPES[name][1]) for name in names) for _ in range(nrows)]
    return names, rows


def _as_arrow(name: str, values: list[Any], layout: int) -> pa.Array | pa.ChunkedArray:
    """Build the column as a plain array (0), a sliced array with a non-zero offset (1) or chunked (2)."""
    ty = TYPES[name][0]
    if layout == 1:
        return pa.array([values[0] if values else None, *values, None], ty).slice(1, len(values))
    if layout == 2 and len(values) > 1:
        mid = len(values) // 2
        return pa.chunked_array([pa.array(values[:mid], ty), pa.array(values[mid:], ty)])
    return pa.array(values, ty)


@HYP
@given(keys=key_columns(), layout=st.integers(0, 2))
def test_hash_primary_keys_matches_reference(
    keys: tuple[list[str], list[tuple[Any, ...]]], layout: int
) -> None:
    names, rows = keys
    columns = [_as_arrow(name, [row[i] for row in rows], layout) for i, name in enumerate(names)]
    got = hash_primary_keys(columns)
    assert got.dtype == np.uint64 and got.shape == (len(rows),)
    assert got.tolist() == ref_row_hashes(names, rows)


def test_hash_primary_keys_ignores_bytes_behind_null_slots() -> None:
    # A null slot may still span bytes in the data buffer; they must not enter the hash.
    offsets = pa.py_buffer(np.array([0, 2, 8, 10], dtype=np.int32).tobytes())
    data = pa.py_buffer(b"abHIDDENcd")
    validity = pa.py_buffer(bytes([0b101]))
    for ty, vals in ((pa.utf8(), ["ab", None, "cd"]), (pa.binary(), [b"ab", None, b"cd"])):
        arr = pa.Array.from_buffers(ty, 3, [validity, offsets, data], null_count=1)
        assert arr.to_pylist() == vals
        name = "utf8" if ty == pa.utf8() else "binary"
        assert hash_primary_keys([arr]).tolist() == ref_row_hashes([name], [(v,) for v in vals])


def test_hash_primary_keys_long_and_short_mixed() -> None:
    strings = ["x" * 5000, "", "short", "é" * 300] + [str(i) for i in range(100_000)]
    ints = list(range(len(strings)))
    got = hash_primary_keys([pa.array(ints, pa.int64()), pa.array(strings)])
    picks = [0, 1, 2, 3, 4, 70_000, len(strings) - 1]  # rows from first, middle and last chunks
    want = ref_row_hashes(["int64", "utf8"], [(ints[i], strings[i]) for i in picks])
    assert got[picks].tolist() == want


def test_hash_primary_keys_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        hash_primary_keys([])
    with pytest.raises(ValueError):
        hash_primary_keys([pa.array([1, 2]), pa.array(["a"])])
    assert hash_primary_keys([pa.array([], pa.int64())]).size == 0


# --------------------------------------------------------------------------------------------------
# 2. Byte identity with the bloom_filter.bin Lance 14 writes
# --------------------------------------------------------------------------------------------------


def _pk_field(name: str, ty: pa.DataType, position: int | None = None) -> pa.Field:
    meta = {PK: "true"}
    if position is not None:
        meta[PK_POS] = str(position)
    return pa.field(name, ty, nullable=False, metadata=meta)


def native_bloom(
    tmp_path: Path,
    key_fields: list[pa.Field],
    puts: list[list[pa.Array]],
    deletes: Sequence[list[pa.Array]] = (),
) -> bytes:
    """Write ``puts`` then ``deletes`` through Lance's own MemWAL writer; return its bloom_filter.bin."""
    uri = str(tmp_path / "table")
    schema = pa.schema([*key_fields, pa.field("payload", pa.utf8())])

    def table(cols: list[pa.Array]) -> pa.Table:
        n = len(cols[0])
        return pa.Table.from_arrays([*cols, pa.array([f"p{i}" for i in range(n)])], schema=schema)

    lance.write_dataset(table(puts[0]), uri).initialize_mem_wal()
    writer = lance.dataset(uri).mem_wal_writer(str(uuid.uuid4()))
    for cols in puts:
        writer.put(table(cols))
    for cols in deletes:
        writer.delete(pa.Table.from_arrays(cols, schema=pa.schema(key_fields)))
    writer.close()
    files = glob.glob(f"{uri}/_mem_wal/*/*_gen_1/bloom_filter.bin")
    assert len(files) == 1, files
    data = Path(files[0]).read_bytes()
    assert len(data) == BloomFilter.NUM_BYTES
    return data


def _ours(batches: list[list[pa.Array]]) -> BloomFilter:
    bf = BloomFilter.empty()
    for cols in batches:
        bf.insert_keys(cols)
    return bf


RNG = np.random.default_rng(20240614)
MANY_I64 = RNG.choice(2**62, size=4000, replace=False).astype(np.int64) - 2**61
MANY_STR = [f"user-{i:06d}-{'x' * (i % 23)}" for i in RNG.permutation(3000)]


def _a(values: Any, ty: pa.DataType) -> pa.Array:
    return pa.array(values, ty)


# case -> (key fields in schema order = key order, put batches, delete batches); columns in key order.
NATIVE_CASES: dict[str, tuple[list[pa.Field], list[list[pa.Array]], list[list[pa.Array]]]] = {
    "int64": (
        [_pk_field("id", pa.int64())],
        [[_a([1, 2, 3, -5, 2**62], pa.int64())], [_a([2, 40], pa.int64())]],
        [[_a([3, 99], pa.int64())]],
    ),
    "int32": (
        [_pk_field("id", pa.int32())],
        [[_a([0, 1, -1, 2**31 - 1, -(2**31)], pa.int32())]],
        [[_a([7], pa.int32())]],
    ),
    "utf8": (
        [_pk_field("id", pa.utf8())],
        [[_a(["", "a", "bb", "hello wörld", "ключ", "x" * 100], pa.utf8())]],
        [[_a(["deleted", "a"], pa.utf8())]],
    ),
    "binary": (
        [_pk_field("id", pa.binary())],
        [[_a([b"", b"\x00", b"\xff" * 9, b"abcdefgh", b"0123456789abcdef0"], pa.binary())]],
        [[_a([b"gone"], pa.binary())]],
    ),
    "composite_int64_utf8": (
        [_pk_field("id", pa.int64()), _pk_field("name", pa.utf8())],
        [[_a([1, 1, 2, 3], pa.int64()), _a(["x", "y", "", "zzzzzzzzzz"], pa.utf8())]],
        [[_a([1, 9], pa.int64()), _a(["x", "q"], pa.utf8())]],
    ),
    "uint64": (
        [_pk_field("id", pa.uint64())],
        [[_a([1, 2, 2**64 - 1], pa.uint64())]],
        [[_a([5], pa.uint64())]],
    ),
    "large_utf8": (
        [_pk_field("id", pa.large_utf8())],
        [[_a(["a", "bb", "ccc"], pa.large_utf8())]],
        [[_a(["d"], pa.large_utf8())]],
    ),
    "many_int64": (
        [_pk_field("id", pa.int64())],
        [[_a(MANY_I64[:1500], pa.int64())], [_a(MANY_I64[1500:3800], pa.int64())]],
        [[_a(MANY_I64[3800:], pa.int64())], [_a(MANY_I64[:100], pa.int64())]],
    ),
    "many_utf8": (
        [_pk_field("id", pa.utf8())],
        [[_a(MANY_STR[:2800], pa.utf8())]],
        [[_a(MANY_STR[2800:], pa.utf8())]],
    ),
}


@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
def test_bloom_bytes_identical_to_lance(tmp_path: Path, case: str) -> None:
    fields, puts, deletes = NATIVE_CASES[case]
    native = native_bloom(tmp_path, fields, puts, deletes)
    ours = _ours([*puts, *deletes])  # tombstone keys are inserted too
    assert ours.to_bytes() == native
    assert BloomFilter.from_bytes(native) == ours
    for cols in [*puts, *deletes]:
        assert ours.might_contain(cols).all()


def test_composite_key_follows_position_metadata(tmp_path: Path) -> None:
    # Schema order (name, id); key order by `...:position` is (id, name): Lance hashes in key order.
    fields = [_pk_field("name", pa.utf8(), position=2), _pk_field("id", pa.int64(), position=1)]
    names, ids = _a(["x", "yy", "zzz", ""], pa.utf8()), _a([1, 2, 3, 4], pa.int64())
    native = native_bloom(tmp_path, fields, [[names, ids]])
    assert _ours([[ids, names]]).to_bytes() == native
    assert _ours([[names, ids]]).to_bytes() != native


def test_each_generation_has_its_own_filter(tmp_path: Path) -> None:
    uri = str(tmp_path / "table")
    field = _pk_field("id", pa.int64())
    schema = pa.schema([field, pa.field("payload", pa.utf8())])

    def table(ids: list[int]) -> pa.Table:
        return pa.Table.from_arrays(
            [_a(ids, pa.int64()), pa.array([None] * len(ids), pa.utf8())], schema=schema
        )

    lance.write_dataset(table([0]), uri).initialize_mem_wal()
    writer = lance.dataset(uri).mem_wal_writer(str(uuid.uuid4()), max_memtable_rows=4)
    for ids in ([1, 2], [3, 4], [5, 6], [7, 8], [9]):
        writer.put(table(ids))
    writer.close()
    gens = {}
    for path in glob.glob(f"{uri}/_mem_wal/*/*_gen_*/bloom_filter.bin"):
        gen_dir = Path(path).parent
        gens[int(gen_dir.name.split("_gen_")[1])] = (gen_dir, Path(path).read_bytes())
    assert sorted(gens) == [1, 2, 3]
    for gen_dir, data in gens.values():
        ids = lance.dataset(str(gen_dir)).to_table(columns=["id"])["id"]
        assert _ours([[ids]]).to_bytes() == data  # a fresh filter per memtable: its own keys only


@pytest.mark.parametrize(
    ("ty", "values"),
    [
        (pa.uint64(), [1, 2, 3]),
        (pa.uint32(), [1, 2, 3]),
        (pa.int16(), [1, 2, 3]),
        (pa.int8(), [1, 2, 3]),
        (pa.bool_(), [True, False]),
        (pa.large_utf8(), ["a", "b", "c"]),
        (pa.large_binary(), [b"a", b"b", b"c"]),
    ],
    ids=str,
)
def test_types_lance_hashes_by_null_flag_only(tmp_path: Path, ty: pa.DataType, values: list[Any]) -> None:
    native = native_bloom(tmp_path, [_pk_field("id", ty)], [[_a(values, ty)]])
    assert _ours([[_a(values, ty)]]).to_bytes() == native
    # Every key collides on the hash of b"\x00": one block, one bit per word.
    assert int(np.unpackbits(np.frombuffer(native, np.uint8)).sum()) == 8
    assert len(set(hash_primary_keys([_a(values, ty)]).tolist())) == 1


# --------------------------------------------------------------------------------------------------
# 3. Filter properties
# --------------------------------------------------------------------------------------------------


def test_no_false_negatives_and_low_false_positive_rate() -> None:
    rng = np.random.default_rng(1)
    keys = rng.permutation(np.unique(rng.integers(-(2**63), 2**63 - 1, size=210_000, dtype=np.int64)))
    present, absent = keys[:8192], keys[8192:]
    bf = BloomFilter.empty()
    bf.insert_keys([pa.array(present)])
    assert bf.might_contain([pa.array(present)]).all()
    fpr = float(bf.might_contain([pa.array(absent)]).mean())
    print(f"false-positive rate with 8192 keys: {fpr:.6f}")
    assert fpr < 0.01


@HYP
@given(values=st.lists(st.text(max_size=12), max_size=60), probes=st.lists(st.text(max_size=12), max_size=60))
def test_might_contain_strings(values: list[str], probes: list[str]) -> None:
    bf = BloomFilter.empty()
    bf.insert_keys([pa.array(values, pa.utf8())])
    assert bf.might_contain([pa.array(values, pa.utf8())]).all()
    hits = bf.might_contain([pa.array(probes, pa.utf8())])
    assert hits.dtype == bool and hits.shape == (len(probes),)
    assert all(hits[i] for i, p in enumerate(probes) if p in set(values))


def test_insert_hashes_with_duplicates_matches_one_by_one() -> None:
    rng = np.random.default_rng(3)
    hashes = rng.integers(0, 2**64, size=5000, dtype=np.uint64)
    hashes = np.concatenate([hashes, hashes[:1000], hashes[:10]])
    batch, single = BloomFilter.empty(), BloomFilter.empty()
    batch.insert_hashes(hashes)
    for h in hashes[::7].tolist() + hashes.tolist():
        single.insert_hashes(np.array([h], dtype=np.uint64))
    assert batch == single
    assert batch.contains_hashes(hashes).all()


@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 40])
def test_scalar_and_vectorized_hashing_agree(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Small batches are hashed with Python integers, large ones vectorized: the same hashes, equal
    to the reference SipHash of each row's Rust Hash stream, for every key type and NULLs."""
    rng = np.random.default_rng(n)
    words = ["", "a", "\u00e9t\u00e9", "x" * 7, "y" * 8, "z" * 23]
    columns = [
        pa.array(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)),
        pa.array(
            [None if i % 3 == 1 else int(v) for i, v in enumerate(rng.integers(-99, 99, n))], pa.int32()
        ),
        pa.array([words[i % len(words)] for i in range(n)]),
        pa.array([bytes(rng.integers(0, 256, i % 17, dtype=np.uint8)) for i in range(n)], pa.binary()),
    ]
    for cols in ([columns[0]], [columns[2]], columns):
        small = hash_primary_keys(cols)
        monkeypatch.setattr(bloom, "_SCALAR_ROWS", 0)
        assert hash_primary_keys(cols).tolist() == small.tolist()
        monkeypatch.setattr(bloom, "_SCALAR_ROWS", 1 << 20)
        assert hash_primary_keys(cols).tolist() == small.tolist()
        monkeypatch.undo()
    rows = list(zip(*(c.to_pylist() for c in columns), strict=True))
    assert hash_primary_keys(columns).tolist() == ref_row_hashes(["int64", "int32", "utf8", "binary"], rows)


def test_contains_reads_the_bits_insert_sets() -> None:
    """`contains_hashes` (word reads of the hashed blocks) against the bit image of the whole filter."""
    rng = np.random.default_rng(9)
    bf = BloomFilter.empty()
    bf.insert_hashes(rng.integers(0, 2**64, size=20_000, dtype=np.uint64))
    probes = rng.integers(0, 2**64, size=5000, dtype=np.uint64)
    image = np.unpackbits(np.frombuffer(bf.to_bytes(), np.uint8), bitorder="little").astype(bool)
    want = image[bf._bit_index(probes)].all(axis=1)
    assert 0 < want.sum() < len(probes)  # both answers occur
    assert bf.contains_hashes(probes).tolist() == want.tolist()
    # Up to `_SCALAR_ROWS` hashes are checked on Python integers: the same answers.
    small = [bf.contains_hashes(probes[i : i + 7]) for i in range(0, len(probes), 7)]
    assert all(len(part) <= bloom._SCALAR_ROWS for part in small)
    assert np.concatenate(small).tolist() == want.tolist()


def test_insert_rule_by_hand() -> None:
    h = 0x0123456789ABCDEF
    bf = BloomFilter.empty()
    bf.insert_hashes(np.array([h], dtype=np.uint64))
    words = np.frombuffer(bf.to_bytes(), dtype="<u4").reshape(1024, 8)
    block = ((h >> 32) * 1024) >> 32
    expect = [1 << (((h & 0xFFFFFFFF) * int(s)) % 2**32 >> 27) for s in BloomFilter.SALT]
    assert words[block].tolist() == expect
    assert int(np.count_nonzero(words)) == 8


# --------------------------------------------------------------------------------------------------
# 4. Serialization
# --------------------------------------------------------------------------------------------------


def test_empty_round_trip() -> None:
    bf = BloomFilter.empty()
    assert bf.to_bytes() == bytes(BloomFilter.NUM_BYTES)
    assert not bf.contains_hashes(np.arange(100, dtype=np.uint64)).any()
    assert BloomFilter.from_bytes(bf.to_bytes()) == bf
    bf.insert_keys([pa.array(["k"])])
    again = BloomFilter.from_bytes(bytearray(bf.to_bytes()))
    assert again == bf and again.to_bytes() == bf.to_bytes()


@pytest.mark.parametrize("size", [0, 1, 32, 32767, 32769, 65536])
def test_from_bytes_rejects_wrong_length(size: int) -> None:
    with pytest.raises(ValueError):
        BloomFilter.from_bytes(bytes(size))
