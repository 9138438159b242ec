"""WAL entry checksums (`memwal_df.crc32`): what the key covers; damage to an entry memwal_df wrote
(flipped bytes, zeroed ranges, anywhere) never decodes to other batches; entries without the key
(Lance's writer) still decode, unchecked; Lance's writer replays entries that carry the key and its
LSM reader reads the rows; a region whose entry has a flipped value is reported corrupt by `status`
and set right by `repair`."""

from __future__ import annotations

import datetime
import json
import re
import struct
import uuid
import zlib
from typing import Any

import lance
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.mem_wal import LsmScanner, ShardSnapshot
from support.optional import not_none
from support.reference import stored_rows
from support.wal_oracle import unchecked

import memwal_df as mw
from memwal_df import errors
from memwal_df.cli import Exit, main
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.rows import wal_schema
from memwal_df.format.wal import (
    CHECKSUM_KEY,
    Wal,
    WalEntry,
    decode_entry,
    encode_entry,
    encode_fence_sentinel,
)

PK = {"lance-schema:unenforced-primary-key": "true"}
PROPERTY = settings(
    database=None, deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)

# Column kinds of the entries under test: integers, strings, floats, vectors, lists, dates, booleans,
# binary, a dictionary column (encoded by the stream writer), every one but the key nullable.
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("name", pa.utf8()),
        pa.field("score", pa.float64()),
        pa.field("vec", pa.list_(pa.float32(), 4)),
        pa.field("small", pa.int32()),
        pa.field("flag", pa.bool_()),
        pa.field("day", pa.date32()),
        pa.field("tags", pa.list_(pa.utf8())),
        pa.field("blob", pa.binary()),
        pa.field("big", pa.large_utf8()),
    ]
)
DICT_SCHEMA = pa.schema([*SCHEMA, pa.field("cat", pa.dictionary(pa.int32(), pa.utf8()))])


def wal_batch(schema: pa.Schema, columns: dict[str, list], tombstones: list[bool]) -> pa.RecordBatch:
    ws = wal_schema(schema, {f.name: i for i, f in enumerate(schema)})
    arrays = [pa.array(columns[f.name], f.type) for f in schema]
    return pa.RecordBatch.from_arrays([*arrays, pa.array(tombstones, pa.bool_())], schema=ws)


def sample_batches(schema: pa.Schema = SCHEMA) -> list[pa.RecordBatch]:
    """Three batches (puts with NULLs, a tombstone, more puts) of every column kind."""

    def put(ids: list[int]) -> pa.RecordBatch:
        columns: dict[str, list[Any]] = {
            "id": ids,
            "name": [None if i % 3 == 0 else f"name-{i}" for i in ids],
            "score": [None if i % 4 == 0 else i * 1.25 for i in ids],
            "vec": [None if i % 5 == 0 else [i, -i, 0.5, 1e30] for i in ids],
            "small": [None if i % 6 == 0 else i - 1000 for i in ids],
            "flag": [None if i % 7 == 0 else i % 2 == 0 for i in ids],
            "day": [datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in ids],
            "tags": [[f"t{j}" for j in range(i % 3)] for i in ids],
            "blob": [bytes([i % 256]) * (i % 5) for i in ids],
            "big": ["ü" * (i % 9) for i in ids],
            "cat": [("a", "b", None)[i % 3] for i in ids],
        }
        return wal_batch(schema, columns, [False] * len(ids))

    dead = {f.name: [None] for f in schema} | {"id": [2]}
    return [put([1, 2, 3, 4, 5]), wal_batch(schema, dead, [True]), put(list(range(10, 24)))]


def with_entry_metadata(batch: pa.RecordBatch, epoch: int, generation: int) -> pa.RecordBatch:
    meta = {b"generation": str(generation).encode(), b"writer_epoch": str(epoch).encode()}
    return batch.replace_schema_metadata(meta)


def assert_decodes_to(data: bytes, original: WalEntry) -> None:
    """`data` decodes to `original` exactly: every value, the schema with its field and schema
    metadata, epoch, generation and kind."""
    got = decode_entry(data, original.position, "p")
    assert (got.position, got.writer_epoch, got.generation, got.is_sentinel) == (
        original.position,
        original.writer_epoch,
        original.generation,
        original.is_sentinel,
    )
    assert len(got.batches) == len(original.batches)
    for g, w in zip(got.batches, original.batches, strict=True):
        assert g.schema.equals(w.schema, check_metadata=True)
        assert g.equals(w) and g.to_pylist() == w.to_pylist()


def last_message_metadata(data: bytes) -> dict[bytes, bytes]:
    """The custom metadata of an entry's last message: its last batch message, or the schema of a
    fence sentinel."""
    reader = ipc.open_stream(data)
    found = reader.schema.metadata
    while True:
        try:
            found = reader.read_next_batch_with_custom_metadata().custom_metadata
        except StopIteration:
            return dict(found or {})


def checksum_digits(data: bytes) -> tuple[int, bytes]:
    """Where the checksum's ten digits are in an encoded entry, and the digits."""
    digits = last_message_metadata(data)[CHECKSUM_KEY]
    (at,) = [m.start() for m in re.finditer(re.escape(b"\x0a\x00\x00\x00" + digits + b"\x00"), data)]
    return at + 4, digits


def batch_message_metadata(data: bytes) -> list[dict[bytes, bytes] | None]:
    """The custom metadata of each batch message of an entry."""
    reader = ipc.open_stream(data)
    found: list[dict[bytes, bytes] | None] = []
    while True:
        try:
            custom = reader.read_next_batch_with_custom_metadata().custom_metadata
        except StopIteration:
            return found
        found.append(None if custom is None else dict(custom))


# ------------------------------------------------------------------ the encoding


@pytest.mark.parametrize("kind", ["plain", "dictionary", "sentinel"])
def test_the_checksum_is_crc32_of_the_whole_entry_with_its_digits_zeroed(kind: str) -> None:
    if kind == "sentinel":
        data = encode_fence_sentinel(4)
    else:
        data = encode_entry(sample_batches(DICT_SCHEMA if kind == "dictionary" else SCHEMA), 4, 2).tobytes()
    at, digits = checksum_digits(data)
    assert len(digits) == 10 and digits.isdigit()
    assert zlib.crc32(data[:at] + b"0" * 10 + data[at + 10 :]) == int(digits)
    entry = decode_entry(data, 1, "p")
    if kind == "sentinel":
        assert entry == WalEntry(1, 4, None, (), True)
        assert ipc.open_stream(data).schema.metadata[CHECKSUM_KEY] == digits
    else:  # the schema metadata is Lance's; only the last batch message carries the checksum
        assert ipc.open_stream(data).schema.metadata == {b"generation": b"2", b"writer_epoch": b"4"}
        assert batch_message_metadata(data) == [None, None, {CHECKSUM_KEY: digits}]
        assert [b.schema.metadata for b in entry.batches] == [
            {b"generation": b"2", b"writer_epoch": b"4"}
        ] * 3


# ------------------------------------------------------------------ damage never decodes to other batches


def entries() -> list[tuple[str, bytes, WalEntry]]:
    plain, with_dict = sample_batches(), sample_batches(DICT_SCHEMA)
    return [
        (
            "plain",
            encode_entry(plain, 7, 3).tobytes(),
            WalEntry(1, 7, 3, tuple(with_entry_metadata(b, 7, 3) for b in plain), False),
        ),
        (
            "dictionary",
            encode_entry(with_dict, 7, 3).tobytes(),
            WalEntry(1, 7, 3, tuple(with_entry_metadata(b, 7, 3) for b in with_dict), False),
        ),
        ("sentinel", encode_fence_sentinel(7), WalEntry(1, 7, None, (), True)),
    ]


@pytest.mark.parametrize("name, data, original", entries(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_single_byte_change_is_refused(name: str, data: bytes, original: WalEntry) -> None:
    assert_decodes_to(data, original)
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[i] ^= mask
            with pytest.raises(errors.CorruptWalEntryError) as e:
                decode_entry(bytes(damaged), 1, "wal/x.arrow")
                pytest.fail(f"{name}: byte {i} of {len(data)} xor {mask:#x} decoded")
            assert e.value.path == "wal/x.arrow"


@pytest.mark.parametrize("name, data, original", entries(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_zeroed_range_is_refused_or_changes_nothing(name: str, data: bytes, original: WalEntry) -> None:
    for length in (1, 3, 8, 64):
        for i in range(len(data) - length + 1):
            damaged = data[:i] + bytes(length) + data[i + length :]
            if damaged == data:
                continue
            with pytest.raises(errors.CorruptWalEntryError):
                decode_entry(damaged, 1, "p")
                pytest.fail(f"{name}: {length} zero bytes at {i} of {len(data)} decoded")


optional_text = st.none() | st.text(max_size=6)
row = st.fixed_dictionaries(
    {
        "id": st.integers(-(2**63), 2**63 - 1),
        "name": optional_text,
        "score": st.none() | st.floats(allow_nan=False),
        "vec": st.none() | st.lists(st.floats(allow_nan=False, width=32), min_size=4, max_size=4),
        "small": st.none() | st.integers(-(2**31), 2**31 - 1),
        "flag": st.none() | st.booleans(),
        "day": st.none() | st.dates(),
        "tags": st.none() | st.lists(optional_text, max_size=3),
        "blob": st.none() | st.binary(max_size=6),
        "big": optional_text,
        "cat": st.none() | st.sampled_from(["x", "y", "zz"]),
    }
)


@st.composite
def encoded_entries(draw: st.DrawFn) -> tuple[bytes, WalEntry]:
    if draw(st.integers(0, 9)) == 0:
        epoch = draw(st.integers(0, 2**64 - 1))
        return encode_fence_sentinel(epoch), WalEntry(1, epoch, None, (), True)
    schema = draw(st.sampled_from([SCHEMA, DICT_SCHEMA]))
    batches = []
    for rows in draw(st.lists(st.lists(row, max_size=6), min_size=1, max_size=4)):
        columns = {f.name: [r[f.name] for r in rows] for f in schema}
        batches.append(
            wal_batch(schema, columns, draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows))))
        )
    epoch, generation = draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1))
    original = WalEntry(
        1, epoch, generation, tuple(with_entry_metadata(b, epoch, generation) for b in batches), False
    )
    return encode_entry(batches, epoch, generation).tobytes(), original


@PROPERTY
@given(encoded_entries(), st.data())
def test_damaged_entries_decode_to_the_original_or_are_refused(
    entry: tuple[bytes, WalEntry], data: st.DataObject
) -> None:
    encoded, original = entry
    assert_decodes_to(encoded, original)
    damaged = bytearray(encoded)
    if data.draw(st.booleans(), label="flip"):
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(damaged) - 1))
            damaged[i] ^= data.draw(st.integers(1, 255))
    else:
        i = data.draw(st.integers(0, len(damaged) - 1))
        length = data.draw(st.integers(1, 256))
        damaged[i : i + length] = bytes(len(damaged[i : i + length]))
    try:
        decode_entry(bytes(damaged), 1, "p")
    except errors.CorruptWalEntryError:
        return
    assert_decodes_to(bytes(damaged), original)


# ------------------------------------------------------------------ entries without the key


def test_entries_without_the_key_decode_unchecked() -> None:
    """An entry as Lance's writer writes it decodes as it stands: the same flipped value that a
    checked entry refuses comes back as another value."""
    batches = sample_batches()
    checked = encode_entry(batches, 2, 1).tobytes()
    plain = unchecked(checked)
    original = WalEntry(1, 2, 1, tuple(with_entry_metadata(b, 2, 1) for b in batches), False)
    assert CHECKSUM_KEY not in ipc.open_stream(plain).schema.metadata
    assert_decodes_to(plain, original)

    value = struct.pack("<d", 13 * 1.25)  # `score` of id 13, in the third batch's body
    for data in (checked, plain):
        assert data.count(value) == 1
    flip = plain.index(value) + 2
    damaged = plain[:flip] + bytes([plain[flip] ^ 0x01]) + plain[flip + 1 :]
    got = decode_entry(damaged, 1, "p")
    scores, want = got.batches[2]["score"].to_pylist(), batches[2]["score"].to_pylist()
    assert scores[3] != want[3] == 13 * 1.25 and scores[:3] + scores[4:] == want[:3] + want[4:]

    flip = checked.index(value) + 2
    with pytest.raises(errors.CorruptWalEntryError, match="checksum"):
        decode_entry(checked[:flip] + bytes([checked[flip] ^ 0x01]) + checked[flip + 1 :], 1, "p")


def test_names_that_look_like_the_key_or_its_placeholder() -> None:
    """Columns and field metadata named like the checksum key or its placeholder digits: our entry
    still carries a checksum that catches every flipped bit, and the entry without it decodes."""
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata={"note": "0000000000"}),
            pa.field("0000000000", pa.utf8()),
            pa.field(CHECKSUM_KEY.decode(), pa.utf8()),
        ]
    )
    batch = wal_batch(
        schema, {"id": [1, 2], "0000000000": ["a", None], CHECKSUM_KEY.decode(): [None, "b"]}, [False, True]
    )
    data = encode_entry([batch], 3, 1).tobytes()
    original = WalEntry(1, 3, 1, (with_entry_metadata(batch, 3, 1),), False)
    assert_decodes_to(data, original)
    assert_decodes_to(unchecked(data), original)
    for i in range(len(data)):
        with pytest.raises(errors.CorruptWalEntryError):
            decode_entry(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :], 1, "p")
            pytest.fail(f"byte {i} of {len(data)} decoded")


# ------------------------------------------------------------------ Lance replays checked entries

TABLE_SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.utf8()), pa.field("v", pa.float64())]
)


def table_rows(ids: list[int], tag: str) -> pa.Table:
    return pa.table(
        {"id": ids, "name": [f"{tag}{i}" for i in ids], "v": [i + 0.5 for i in ids]}, schema=TABLE_SCHEMA
    )


def test_lance_replays_entries_that_carry_checksums(tmp_path) -> None:
    """Lance reads WAL entries written by others only when its writer claims a region: it replays
    them into its MemTable and flushes them into a generation its LsmScanner reads. Our data entries
    and our fence sentinel all carry the checksum key; Lance replays every one."""
    table = mw.create_table(str(tmp_path / "t"), table_rows([1, 2, 3], "base"), "id", region_spec=None)
    region_id = uuid.uuid4()
    rw = table.region_writer(region_id)
    rw.put(table_rows([2, 10, 11], "a"))
    rw.abort()  # a crash: the entry is not flushed
    rw = table.region_writer(region_id)  # our claim writes a fence sentinel
    rw.put(table_rows([11, 12], "b"))
    rw.delete([10, 3])
    rw.abort()
    wal = Wal(table.storage, region_id)
    positions = range(1, wal.last_position(1) + 1)
    kinds = [not_none(wal.read(p)).is_sentinel for p in positions]
    assert kinds == [False, True, False, False]
    for p in positions:
        assert last_message_metadata(table.storage.get(wal.path(p)))[CHECKSUM_KEY].isdigit()

    lance.dataset(table.uri).mem_wal_writer(str(region_id)).close()  # claim, replay, flush
    m = not_none(RegionManifestStore(table.storage, region_id).latest())
    assert m.replay_after_wal_entry_position >= len(kinds) + 1  # ours, then Lance's sentinel
    snapshot = ShardSnapshot(str(region_id)).with_spec_id(m.shard_spec_id)
    snapshot = snapshot.with_current_generation(m.current_generation)
    for sst in sorted(m.sstables, key=lambda s: s.generation):
        snapshot = snapshot.with_sstable(sst.generation, sst.path)
    got = LsmScanner.from_snapshots(lance.dataset(table.uri), [snapshot]).to_table()
    want = [*table_rows([1], "base").to_pylist(), *table_rows([2], "a").to_pylist()]
    want += table_rows([11, 12], "b").to_pylist()
    assert sorted(got.select(TABLE_SCHEMA.names).to_pylist(), key=lambda r: r["id"]) == want
    assert stored_rows(table) == {r["id"]: r for r in want}


def test_lance_refuses_an_entry_whose_schema_metadata_has_another_key(tmp_path) -> None:
    """Why a data entry's checksum is message metadata of its last batch, not a schema metadata key:
    Lance's replay refuses a batch whose schema metadata has a key besides its own two."""
    table = mw.create_table(str(tmp_path / "t"), table_rows([1, 2, 3], "base"), "id", region_spec=None)
    region_id = uuid.uuid4()
    rw = table.region_writer(region_id)
    rw.put(table_rows([5], "a"))
    rw.abort()
    path = layout.wal_path(region_id, 1)
    reader = ipc.open_stream(table.storage.get(path))
    sink = pa.BufferOutputStream()
    with ipc.new_stream(
        sink, reader.schema.with_metadata({**reader.schema.metadata, CHECKSUM_KEY: b"1"})
    ) as w:
        for b in reader:
            w.write_batch(b)
    table.storage.put(path, sink.getvalue().to_pybytes())
    with pytest.raises(OSError, match="schema doesn't match"):
        lance.dataset(table.uri).mem_wal_writer(str(region_id))


# ------------------------------------------------------------------ status and repair


def test_a_flipped_value_makes_the_region_corrupt_until_repaired(tmp_path, capsys) -> None:
    """A byte of a float value flipped in the last WAL entry: `status` (API and CLI) reports the
    region corrupt with the entry's file, `recover` skips it, `repair` sets the entry aside, and the
    entry before it replays."""
    table = mw.create_table(str(tmp_path / "t"), table_rows([1, 2, 3], "base"), "id", region_spec=None)
    region_id = uuid.uuid4()
    rw = table.region_writer(region_id)
    rw.put(table_rows([1, 20], "acked"))
    rw.put(table_rows([2, 30], "flipped"))
    position = rw.stats()["next_wal_position"] - 1
    rw.abort()
    path = layout.wal_path(region_id, position)
    data = table.storage.get(path)
    value = struct.pack("<d", 30.5)  # `v` of id 30
    at = data.index(value) + 3
    assert data.count(value) == 1 and at > len(data) // 2  # in the batch body
    flipped = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
    table.storage.put(path, flipped)
    assert decode_entry(unchecked(flipped), position, path).batches[0]["v"].to_pylist()[1] != 30.5

    (problem,) = table.status()["corrupt_regions"]
    assert (problem.region_id, problem.kind, problem.path) == (region_id, "wal", path)
    assert "checksum" in problem.error and path in problem.error
    code = main(["status", table.uri])
    out = "".join(capsys.readouterr())
    assert code == Exit.FAILED and "CORRUPT" in out and path in out
    code = main(["status", table.uri, "--json"])
    (listed,) = json.loads(capsys.readouterr().out)["corrupt_regions"]
    assert code == Exit.FAILED and listed["path"] == path
    with pytest.raises(errors.CorruptRegionsError) as e:
        table.recover()
    error = e.value.errors[region_id]
    assert isinstance(
        error, errors.CorruptWalEntryError | errors.CorruptManifestError | errors.CorruptGenerationError
    )
    assert error.path == path

    plan = table.repair_region(region_id)
    assert plan.trailing and [x.position for x in plan.entries] == [position]
    code = main(["repair", table.uri, "--region", str(region_id), "--yes"])
    assert code == Exit.OK, capsys.readouterr()
    (moved,) = [p for p in table.storage.list(layout.region_dir(region_id)) if "/quarantine/" in p]
    assert table.storage.get(moved) == flipped
    assert not_none(Wal(table.storage, region_id).read(position)).is_sentinel
    assert table.status()["corrupt_regions"] == []
    assert table.recover() == [region_id]
    rows = stored_rows(table)
    assert {k: rows[k]["name"] for k in (1, 2, 3, 20)} == {1: "acked1", 2: "base2", 3: "base3", 20: "acked20"}
    assert 30 not in rows
