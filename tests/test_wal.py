"""WAL entries: encode/decode round trips, fence sentinels, Lance 14's own entries (both directions),
truncated / corrupt / malformed entries, and the Wal store (append, read, scan, has_data_after)."""

from __future__ import annotations

import datetime
import decimal
import threading
import uuid

import lance
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.optional import not_none
from support.wal_oracle import unchecked

from memwal_df.errors import CorruptWalEntryError
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore, new_manifest
from memwal_df.format.open_storage import open_storage
from memwal_df.format.regions.spec import lance_field_ids
from memwal_df.format.rows import TOMBSTONE, wal_schema
from memwal_df.format.storage import Storage
from memwal_df.format.wal import (
    CHECKSUM_KEY,
    Wal,
    WalEntry,
    decode_entry,
    encode_entry,
    encode_fence_sentinel,
)

PK = "lance-schema:unenforced-primary-key"
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
HYP = settings(database=None, deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])

# A realistic table: every column kind a MemWAL table commonly has.
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata={PK: "true"}),
        pa.field("name", pa.utf8()),
        pa.field("score", pa.float64()),
        pa.field("small", pa.int32()),
        pa.field("flag", pa.bool_()),
        pa.field("ts", pa.timestamp("us")),
        pa.field("day", pa.date32()),
        pa.field("blob", pa.binary()),
        pa.field("tags", pa.list_(pa.utf8())),
        pa.field("emb", pa.list_(pa.float32(), 4)),
        pa.field("big", pa.large_utf8()),
        pa.field("price", pa.decimal128(10, 2)),
        pa.field("attrs", pa.struct([("a", pa.int32()), ("b", pa.utf8())])),
    ]
)
FIELD_IDS = lance_field_ids(SCHEMA)
WAL_SCHEMA = wal_schema(SCHEMA, FIELD_IDS)


def entry_bytes(batches: list[pa.RecordBatch], writer_epoch: int, generation: int) -> bytes:
    """An encoded entry as bytes (encode_entry returns a view of an Arrow buffer)."""
    return encode_entry(batches, writer_epoch, generation).tobytes()


def rows(ids: list[int]) -> pa.Table:
    """Rows of SCHEMA with some NULLs."""
    t0 = datetime.datetime(2024, 1, 1)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": [f"n{i}" if i % 3 else None for i in ids],
            "score": [i / 2 if i % 4 else None for i in ids],
            "small": [i - 1000 for i in ids],
            "flag": [None if i % 5 == 0 else i % 2 == 0 for i in ids],
            "ts": [t0 + datetime.timedelta(seconds=i, microseconds=i) for i in ids],
            "day": [datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in ids],
            "blob": [bytes([i % 256]) * (i % 5) for i in ids],
            "tags": [[f"t{j}" for j in range(i % 3)] if i % 7 else None for i in ids],
            "emb": [[float(i), -float(i), 0.5, 1e30] for i in ids],
            "big": ["ü" * (i % 9) for i in ids],
            "price": [decimal.Decimal(i) / 100 for i in ids],
            "attrs": [{"a": i, "b": str(i)} if i % 2 else None for i in ids],
        },
        schema=SCHEMA,
    )


def wal_batch(table: pa.Table, tombstone: bool = False) -> pa.RecordBatch:
    columns = [c.combine_chunks() for c in table.columns]
    return pa.RecordBatch.from_arrays(
        [*columns, pa.array([tombstone] * table.num_rows, pa.bool_())], schema=WAL_SCHEMA
    )


def tombstones(ids: list[int]) -> pa.RecordBatch:
    """Delete rows: the key set, every other column NULL, `_tombstone` true (what Lance writes)."""
    n = len(ids)
    columns = [pa.array(ids, pa.int64())] + [pa.nulls(n, f.type) for f in SCHEMA][1:]
    return pa.RecordBatch.from_arrays([*columns, pa.array([True] * n)], schema=WAL_SCHEMA)


def assert_same_batches(
    got: tuple[pa.RecordBatch, ...], want: list[pa.RecordBatch], nested_metadata: bool = True
) -> None:
    """Same values and types, and the same field metadata (top level only when `nested_metadata` is
    False: Lance also puts `lance:field_id` on list items and struct children, we do not)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if nested_metadata:
            assert g.schema.remove_metadata().equals(w.schema.remove_metadata(), check_metadata=True)
        else:
            assert [f.metadata for f in g.schema] == [f.metadata for f in w.schema]
        assert g.equals(w)
        assert g.to_pylist() == w.to_pylist()


def raw_schema(data: bytes) -> pa.Schema:
    return ipc.open_stream(data).schema


def unchecked_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """A fence sentinel's schema metadata without the checksum key, after checking its form."""
    meta = dict(schema.metadata or {})
    checksum = meta.pop(CHECKSUM_KEY)
    assert len(checksum) == 10 and checksum.isdigit()
    return meta


def last_batch_metadata(data: bytes) -> dict[bytes, bytes]:
    """The custom metadata of the last batch message of an entry (where its checksum is)."""
    reader = ipc.open_stream(data)
    found = []
    while True:
        try:
            found.append(reader.read_next_batch_with_custom_metadata().custom_metadata)
        except StopIteration:
            break
    assert all(m is None for m in found[:-1])
    return dict(found[-1])


@pytest.fixture
def storage(table_uri: str, table_storage_options: dict[str, str] | None) -> Storage:
    return open_storage(table_uri, table_storage_options)


# ------------------------------------------------------------------ schema and encoding


def test_wal_schema() -> None:
    assert WAL_SCHEMA.names == [*SCHEMA.names, TOMBSTONE]
    for f, src in zip(WAL_SCHEMA, SCHEMA, strict=False):
        assert f.type == src.type and f.nullable == src.nullable
        assert f.metadata[b"lance:field_id"] == str(FIELD_IDS[f.name]).encode()
    assert WAL_SCHEMA.field("id").metadata[PK.encode()] == b"true"  # the PK marker is kept
    # Lance numbers fields depth-first: nested children take ids too
    assert [FIELD_IDS[n] for n in ("id", "name", "tags", "emb", "big", "attrs")] == [0, 1, 8, 10, 11, 13]
    tomb = WAL_SCHEMA.field(TOMBSTONE)
    assert tomb.type == pa.bool_() and not tomb.nullable and not tomb.metadata
    assert WAL_SCHEMA.metadata is None
    assert SCHEMA.field("name").metadata is None  # the input schema is not modified


def test_encode_decode_round_trip_multi_batch() -> None:
    batches = [wal_batch(rows([1, 2, 3])), tombstones([2]), wal_batch(rows(list(range(10, 60))))]
    data = entry_bytes(batches, writer_epoch=7, generation=3)
    assert data[:4] == b"\xff\xff\xff\xff" and data.endswith(EOS) and b"ARROW1" not in data  # IPC stream
    assert raw_schema(data).metadata == {b"generation": b"3", b"writer_epoch": b"7"}  # decimal strings
    checksum = last_batch_metadata(data)[CHECKSUM_KEY]  # in the last batch message, not the schema
    assert len(checksum) == 10 and checksum.isdigit()
    entry = decode_entry(data, 12, "some/path.arrow")
    assert isinstance(entry, WalEntry)
    assert (entry.position, entry.writer_epoch, entry.generation, entry.is_sentinel) == (12, 7, 3, False)
    assert entry.num_rows == 3 + 1 + 50
    assert_same_batches(entry.batches, batches)
    for b in entry.batches:
        assert b.schema.metadata == {b"generation": b"3", b"writer_epoch": b"7"}
    dead = entry.batches[1].to_pylist()[0]
    assert dead["id"] == 2 and dead[TOMBSTONE] is True
    assert all(v is None for k, v in dead.items() if k not in ("id", TOMBSTONE))


def test_encode_large_numbers_and_empty_batches() -> None:
    u64 = 2**64 - 1
    batches = [wal_batch(rows([])), wal_batch(rows([5]))]
    entry = decode_entry(entry_bytes(batches, writer_epoch=u64, generation=u64), 1, "p")
    assert entry.writer_epoch == u64 and entry.generation == u64
    assert_same_batches(entry.batches, batches)
    with pytest.raises(ValueError):
        encode_entry([], 1, 1)


@HYP
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(-(2**63), 2**63 - 1), st.none() | st.text(max_size=5), st.booleans()),
            max_size=6,
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)
def test_round_trip_property(batches_rows: list, epoch: int, generation: int) -> None:
    schema = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("s", pa.utf8())])
    ws = wal_schema(schema, {"k": 0, "s": 1})
    batches = [
        pa.RecordBatch.from_arrays(
            [
                pa.array([r[0] for r in b], pa.int64()),
                pa.array([r[1] for r in b], pa.utf8()),
                pa.array([r[2] for r in b], pa.bool_()),
            ],
            schema=ws,
        )
        for b in batches_rows
    ]
    entry = decode_entry(entry_bytes(batches, epoch, generation), 1, "p")
    assert (entry.writer_epoch, entry.generation) == (epoch, generation)
    assert_same_batches(entry.batches, batches)


def _stream_writer_bytes(
    batches: list[pa.RecordBatch], writer_epoch: int, generation: int, checksum: bytes | None = None
) -> bytes:
    """The reference encoding: the batches through pyarrow's IPC stream writer, with `checksum` as
    the checksum key's value in the last batch message (none: an unchecked entry, as Lance writes)."""
    meta = {b"generation": str(generation).encode(), b"writer_epoch": str(writer_epoch).encode()}
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batches[0].schema.with_metadata(meta)) as w:
        for b in batches[:-1]:
            w.write_batch(b)
        w.write_batch(batches[-1], None if checksum is None else {CHECKSUM_KEY: checksum})
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("dictionary", ["none", "top-level", "nested"])
def test_encoding_equals_the_stream_writer(dictionary: str) -> None:
    """Entries are the stream writer's bytes, the last batch written with the checksum as its message
    metadata; entries with dictionary columns (and dictionary messages) decode whole."""
    table = rows([1, 2, 3, 4, 5])
    if dictionary != "none":
        names = pa.array(["a", "b", None, "a", "c"]).dictionary_encode()
        col = names if dictionary == "top-level" else pa.StructArray.from_arrays([names], ["n"])
        table = table.append_column("d", col)
    ws = wal_schema(table.schema, lance_field_ids(table.schema))
    full = table.combine_chunks()
    batches = [
        pa.RecordBatch.from_arrays(
            [*(c.chunk(0) for c in t.columns), pa.array([i % 2 == 0] * t.num_rows)], schema=ws
        )
        for i, t in enumerate((full.slice(0, 2), full.slice(2)))
    ]
    data = entry_bytes(batches, 3, 9)
    assert data == _stream_writer_bytes(batches, 3, 9, last_batch_metadata(data)[CHECKSUM_KEY])
    assert_same_batches(decode_entry(data, 1, "p").batches, batches)


def test_fence_sentinel_shape() -> None:
    data = encode_fence_sentinel(5)
    assert data.endswith(EOS)
    reader = ipc.open_stream(data)
    assert len(reader.schema) == 0  # an empty schema: no fields at all
    assert unchecked_metadata(reader.schema) == {b"fence_sentinel": b"true", b"writer_epoch": b"5"}  # no gen.
    assert list(reader) == []  # zero batches
    entry = decode_entry(data, 4, "p")
    assert entry == WalEntry(4, 5, None, (), True)
    assert entry.num_rows == 0


# ------------------------------------------------------------------ Lance 14's own entries


def native_shard(uri: str, opts: dict[str, str] | None) -> tuple[uuid.UUID, list[tuple[str, list[int]]]]:
    """Entries written by Lance's writer: a non-durable writer (several batches in one entry), then a
    re-claim (fence sentinel) and durable single-batch entries."""
    ds = lance.write_dataset(rows([0]), uri, storage_options=opts)
    ds.initialize_mem_wal()
    shard = uuid.uuid4()
    ops = [("put", [1, 2, 3]), ("put", [4, 5]), ("delete", [2])]
    w = lance.dataset(uri, storage_options=opts).mem_wal_writer(str(shard), durable_write=False)
    for op, ids in ops:
        w.put(rows(ids)) if op == "put" else w.delete(pa.table({"id": pa.array(ids, pa.int64())}))
    w.close()
    more = [("put", [6, 7]), ("delete", [4, 99])]
    w = lance.dataset(uri, storage_options=opts).mem_wal_writer(str(shard))
    for op, ids in more:
        w.put(rows(ids)) if op == "put" else w.delete(pa.table({"id": pa.array(ids, pa.int64())}))
    w.close()
    return shard, ops + more


def test_decode_native_entries(table_uri: str, table_storage_options: dict[str, str] | None) -> None:
    shard, ops = native_shard(table_uri, table_storage_options)
    storage = open_storage(table_uri, table_storage_options)
    wal = Wal(storage, shard)
    names = storage.list(f"{layout.region_dir(shard)}/{layout.WAL_DIR}")
    n = len(names)
    assert sorted(names) == sorted(layout.wal_path(shard, p) for p in range(1, n + 1))  # native file names
    entries = list(wal.scan(1))
    assert len(entries) == n and wal.last_position(1) == n

    sentinels = [e for e in entries if e.is_sentinel]
    assert len(sentinels) == 1
    sentinel = sentinels[0]
    assert sentinel.writer_epoch == 2 and sentinel.generation is None and sentinel.batches == ()
    native_sentinel = storage.get(wal.path(sentinel.position))
    ours = encode_fence_sentinel(2)
    assert raw_schema(native_sentinel) == raw_schema(ours)
    assert raw_schema(native_sentinel).metadata == unchecked_metadata(raw_schema(ours))
    assert len(native_sentinel) == 200  # arrow-rs; pyarrow's bytes differ but decode the same
    assert decode_entry(ours, sentinel.position, "p") == decode_entry(native_sentinel, sentinel.position, "p")

    data_entries = [e for e in entries if not e.is_sentinel]
    first = data_entries[0]
    assert first.writer_epoch == 1 and first.generation == 1
    assert len(first.batches) == 3  # one batch per put/delete in a non-durable entry
    assert all(e.writer_epoch == 2 for e in data_entries[1:])
    assert [e.position for e in entries] == list(range(1, n + 1))

    want = []
    for op, ids in ops:
        want.append(wal_batch(rows(ids)) if op == "put" else tombstones(ids))
    got = [b for e in data_entries for b in e.batches]
    assert_same_batches(tuple(got), want, nested_metadata=False)
    # native's schema is ours (top-level fields and their metadata; native also numbers nested children)
    native_schema = got[0].schema
    assert native_schema.metadata.keys() == {b"generation", b"writer_epoch"}
    for f in WAL_SCHEMA:
        nf = native_schema.field(f.name)
        assert nf.type == f.type and nf.nullable == f.nullable and nf.metadata == f.metadata, f.name

    # our encoding of the same entry decodes to the same thing
    again = decode_entry(entry_bytes(list(first.batches), 1, 1), first.position, "p")
    assert again == WalEntry(first.position, 1, 1, again.batches, False)
    assert_same_batches(again.batches, list(first.batches))

    # a native entry cut anywhere is refused
    data = storage.get(wal.path(first.position))
    for i in range(0, len(data), 3):
        with pytest.raises(CorruptWalEntryError):
            decode_entry(data[:i], first.position, "p")


def test_native_writer_replays_our_entries(
    table_uri: str, table_storage_options: dict[str, str] | None
) -> None:
    """Entries we encode (all column types, a tombstone, several batches) replay in Lance's writer."""
    opts = table_storage_options
    lance.write_dataset(rows([0]), table_uri, storage_options=opts).initialize_mem_wal()
    ds = lance.dataset(table_uri, storage_options=opts)
    ws = wal_schema(ds.schema, lance_field_ids(ds))
    assert ws == WAL_SCHEMA and [f.metadata for f in ws] == [f.metadata for f in WAL_SCHEMA]
    storage = open_storage(table_uri, opts)
    shard = uuid.uuid4()
    assert RegionManifestStore(storage, shard).commit(new_manifest(shard, 0, {}))
    wal = Wal(storage, shard)
    assert wal.append(1, entry_bytes([wal_batch(rows([1, 2, 3])), tombstones([2])], 1, 1))
    assert wal.append(2, entry_bytes([wal_batch(rows([4]))], 1, 1))
    ds.mem_wal_writer(str(shard)).close()  # claims epoch 2, replays 1..2, flushes on close
    m = not_none(RegionManifestStore(storage, shard).latest())
    assert m.writer_epoch == 2 and len(m.sstables) == 1 and m.replay_after_wal_entry_position >= 2
    gen = lance.dataset(
        storage.child_uri(layout.generation_path(shard, m.sstables[0].path)), storage_options=opts
    ).to_table()
    live = gen.filter(pa.compute.invert(gen[TOMBSTONE])).drop_columns([TOMBSTONE])
    assert live.sort_by("id").to_pylist() == rows([1, 3, 4]).to_pylist()
    assert gen.filter(gen[TOMBSTONE])["id"].to_pylist() == [2]


# ------------------------------------------------------------------ malformed entries


def small_entry() -> bytes:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.utf8())])
    ws = wal_schema(schema, {"id": 0, "name": 1})
    batch = pa.RecordBatch.from_arrays(
        [pa.array([1, 2]), pa.array(["a", None]), pa.array([False, True])], schema=ws
    )
    return entry_bytes([batch], 1, 1)


def tombstone_heavy_entry() -> bytes:
    """Two batches; the first one's body ends with the bytes of an end-of-stream marker (32 set
    tombstone bits, then 4 zero bytes of padding), so a cut right after it looks complete."""
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
    ws = wal_schema(schema, {"id": 0, "v": 1})
    dead = pa.RecordBatch.from_arrays(
        [pa.array(range(32), pa.int64()), pa.nulls(32, pa.float64()), pa.array([True] * 32)], schema=ws
    )
    live = pa.RecordBatch.from_arrays(
        [pa.array([100], pa.int64()), pa.array([1.0]), pa.array([False])], schema=ws
    )
    return entry_bytes([dead, live], 1, 1)


@pytest.mark.parametrize("make", [small_entry, tombstone_heavy_entry, lambda: encode_fence_sentinel(3)])
def test_truncated_at_every_offset(make) -> None:
    data = make()
    full = decode_entry(data, 1, "wal/x.arrow")
    for i in range(len(data)):
        with pytest.raises(CorruptWalEntryError) as ei:
            got = decode_entry(data[:i], 1, "wal/x.arrow")
            pytest.fail(f"cut at {i} of {len(data)} decoded {got.num_rows} of {full.num_rows} rows")
        assert ei.value.path == "wal/x.arrow" and "wal/x.arrow" in str(ei.value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage",
        EOS,  # a stream with no schema
        b"\x00" * 64,
        b"ARROW1\x00\x00" + EOS,
        b"garbage" + EOS,
        b"\xff\xff\xff\xff\x10\x00\x00\x00" + b"\x00" * 16 + EOS,
    ],
)
def test_garbage(data: bytes) -> None:
    with pytest.raises(CorruptWalEntryError):
        decode_entry(data, 1, "p")


def test_trailing_bytes_after_end_of_stream() -> None:
    data = small_entry()
    for tail in (b"x", EOS, small_entry()):
        with pytest.raises(CorruptWalEntryError):
            decode_entry(data + tail, 1, "p")


@HYP
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_only_raise_corrupt(data: bytes, with_eos: bool) -> None:
    try:
        decode_entry(data + (EOS if with_eos else b""), 1, "p")
    except CorruptWalEntryError:
        pass


@HYP
@given(st.data())
def test_flipped_bytes_of_unchecked_entries_decode_whole_or_raise_corrupt(data: st.DataObject) -> None:
    """Corrupted bytes of an entry without checksum raise CorruptWalEntryError and nothing else, or
    decode into valid batches (a flip in a buffer, or even in a row count, can go unnoticed there;
    test_wal_checksums.py covers entries with one)."""
    raw = bytearray(unchecked(data.draw(st.sampled_from([small_entry(), tombstone_heavy_entry()]))))
    full = decode_entry(bytes(raw), 1, "p")
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        entry = decode_entry(bytes(raw), 1, "p")
    except CorruptWalEntryError:
        return
    assert not entry.is_sentinel and len(entry.batches) == len(full.batches)
    for b in entry.batches:
        b.validate(full=True)


def _entry_with(schema: pa.Schema, batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def _data_schema(meta: dict[bytes, bytes] | None, tombstone_type: pa.DataType | None = None) -> pa.Schema:
    tombstone_type = tombstone_type or pa.bool_()
    return pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field(TOMBSTONE, tombstone_type, nullable=False)],
        metadata=meta,
    )


def _one_row(schema: pa.Schema, tombstone: object = False) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([1], pa.int64()), pa.array([tombstone], schema.field(TOMBSTONE).type)], schema=schema
    )


@pytest.mark.parametrize(
    "meta",
    [
        None,
        {b"generation": b"1"},  # no writer_epoch
        {b"generation": b"1", b"writer_epoch": b""},
        {b"generation": b"1", b"writer_epoch": b"abc"},
        {b"generation": b"1", b"writer_epoch": b"-1"},
        {b"generation": b"1", b"writer_epoch": b"1.0"},
        {b"generation": b"1", b"writer_epoch": b"1_0"},  # int() would read 10
        {b"generation": b"1", b"writer_epoch": b" 1"},
        {b"generation": b"1", b"writer_epoch": b"18446744073709551616"},  # beyond u64
        {b"generation": b"x", b"writer_epoch": b"1"},
        {b"generation": b"-2", b"writer_epoch": b"1"},
    ],
)
def test_bad_metadata(meta: dict[bytes, bytes] | None) -> None:
    schema = _data_schema(meta)
    with pytest.raises(CorruptWalEntryError):
        decode_entry(_entry_with(schema, [_one_row(schema)]), 1, "p")


def test_entry_without_generation_is_accepted() -> None:
    schema = _data_schema({b"writer_epoch": b"4"})
    entry = decode_entry(_entry_with(schema, [_one_row(schema)]), 1, "p")
    assert entry.generation is None and entry.writer_epoch == 4 and entry.num_rows == 1


def test_sentinel_with_data() -> None:
    meta = {b"fence_sentinel": b"true", b"writer_epoch": b"2"}
    schema = _data_schema(meta)
    with pytest.raises(CorruptWalEntryError):
        decode_entry(_entry_with(schema, [_one_row(schema)]), 1, "p")
    empty = pa.schema([pa.field("x", pa.int32())], metadata=meta)
    with pytest.raises(CorruptWalEntryError):
        decode_entry(
            _entry_with(empty, [pa.RecordBatch.from_arrays([pa.array([], pa.int32())], schema=empty)]), 1, "p"
        )


def test_data_entry_shape_errors() -> None:
    meta = {b"generation": b"1", b"writer_epoch": b"1"}
    no_tomb = pa.schema([pa.field("id", pa.int64())], metadata=meta)
    with pytest.raises(CorruptWalEntryError):
        decode_entry(
            _entry_with(no_tomb, [pa.RecordBatch.from_arrays([pa.array([1])], schema=no_tomb)]), 1, "p"
        )
    int_tomb = _data_schema(meta, pa.int8())
    with pytest.raises(CorruptWalEntryError):
        decode_entry(_entry_with(int_tomb, [_one_row(int_tomb, 1)]), 1, "p")
    # a data entry without batches is a cut entry (writers never write one)
    with pytest.raises(CorruptWalEntryError):
        decode_entry(_entry_with(_data_schema(meta), []), 1, "p")


# ------------------------------------------------------------------ the Wal store


def test_append_read_round_trip(storage: Storage) -> None:
    region = uuid.uuid4()
    wal = Wal(storage, region)
    assert wal.read(1) is None and not wal.exists(1) and list(wal.scan(1)) == []
    batches = [wal_batch(rows([1, 2])), tombstones([1])]
    data = entry_bytes(batches, 3, 2)
    assert wal.append(1, data)
    assert storage.get(layout.wal_path(region, 1)) == data
    entry = not_none(wal.read(1))
    assert (entry.position, entry.writer_epoch, entry.generation) == (1, 3, 2)
    assert_same_batches(entry.batches, batches)
    assert wal.exists(1) and wal.path(1) == layout.wal_path(region, 1)


def test_append_refuses_a_taken_position(storage: Storage) -> None:
    wal = Wal(storage, uuid.uuid4())
    first = entry_bytes([wal_batch(rows([1]))], 1, 1)
    assert wal.append(1, first)
    assert not wal.append(1, entry_bytes([wal_batch(rows([2]))], 2, 1))
    assert not wal.append(1, encode_fence_sentinel(2))
    assert storage.get(wal.path(1)) == first
    assert not_none(wal.read(1)).batches[0]["id"].to_pylist() == [1]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            wal.append(bad, first)


def test_append_race_has_one_winner(table_uri: str, table_storage_options: dict[str, str] | None) -> None:
    region = uuid.uuid4()
    n = 6
    entries = [entry_bytes([wal_batch(rows([i]))], i + 1, 1) for i in range(n)]
    barrier = threading.Barrier(n)
    results: dict[int, bool] = {}

    def run(i: int) -> None:
        wal = Wal(open_storage(table_uri, table_storage_options), region)
        barrier.wait()
        results[i] = wal.append(1, entries[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(results) == n and len(winners) == 1
    entry = not_none(Wal(open_storage(table_uri, table_storage_options), region).read(1))
    assert entry.writer_epoch == winners[0] + 1


def test_read_corrupt_entry_names_the_file(storage: Storage) -> None:
    region = uuid.uuid4()
    wal = Wal(storage, region)
    assert storage.put_if_not_exists(wal.path(1), small_entry()[:-5])
    with pytest.raises(CorruptWalEntryError) as ei:
        wal.read(1)
    assert ei.value.path == layout.wal_path(region, 1)
    with pytest.raises(CorruptWalEntryError):
        list(wal.scan(1))


def test_scan_stops_at_first_gap_and_has_data_after(storage: Storage) -> None:
    wal = Wal(storage, uuid.uuid4())
    assert not wal.has_data_after(0)
    assert wal.last_position(1) == 0
    data = {p: entry_bytes([wal_batch(rows([p]))], 1, 1) for p in (1, 3, 6)}
    data[2] = encode_fence_sentinel(2)
    data[4] = encode_fence_sentinel(3)
    for p, d in data.items():
        assert wal.append(p, d)
    # positions 1 2 3 4 _ 6
    assert [e.position for e in wal.scan(1)] == [1, 2, 3, 4]
    assert [e.is_sentinel for e in wal.scan(1)] == [False, True, False, True]
    assert [e.position for e in wal.scan(3)] == [3, 4]
    assert list(wal.scan(5)) == []
    assert [e.position for e in wal.scan(6)] == [6]
    assert list(wal.scan(7)) == []
    assert wal.last_position(1) == 4 and wal.last_position(4) == 4
    assert wal.last_position(5) == 4 and wal.last_position(6) == 6

    assert wal.has_data_after(0)  # 1
    assert wal.has_data_after(1)  # 3 (after sentinel 2)
    assert wal.has_data_after(2)
    assert not wal.has_data_after(3)  # only sentinel 4, then a gap
    assert not wal.has_data_after(4)  # 6 is beyond the gap: not reachable by replay
    assert wal.has_data_after(5)
    assert not wal.has_data_after(6)
