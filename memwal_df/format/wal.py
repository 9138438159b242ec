"""The write-ahead log of a region: one Arrow IPC stream file per WAL entry, positions from 1.

An entry holds one or more record batches of stored rows (`rows.wal_schema`: the table's columns
plus `_tombstone: bool not null`), with schema metadata `{"generation": g, "writer_epoch": e}`
(decimal strings). A fence sentinel entry has an empty schema, no batches and metadata
`{"fence_sentinel": "true", "writer_epoch": e}`; replay skips it. Entries are published with
put-if-not-exists, so position N+1 never exists before N and a writer that finds its position taken
knows a newer writer fenced it.

Guarantees: `decode_entry` either returns the exact batches that were encoded or raises
`CorruptWalEntryError` naming the file; it never returns part of an entry.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

from memwal_df.errors import CorruptWalEntryError, NotFoundError
from memwal_df.format import layout
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.storage import Blob, Storage

GENERATION_KEY = b"generation"
EPOCH_KEY = b"writer_epoch"
SENTINEL_KEY = b"fence_sentinel"
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_DECIMAL_RE = re.compile(rb"[0-9]{1,20}")
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class WalEntry:
    """A decoded WAL entry. `batches` is empty for a fence sentinel."""

    position: int
    writer_epoch: int
    generation: int | None
    batches: tuple[pa.RecordBatch, ...]
    is_sentinel: bool

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.batches)


def _has_dictionary(t: pa.DataType) -> bool:
    return pa.types.is_dictionary(t) or any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def encode_entry(batches: Sequence[pa.RecordBatch], writer_epoch: int, generation: int) -> memoryview:
    """Serialize data batches (already in WAL schema) as one WAL entry, an Arrow IPC stream (a
    zero-copy view of the encoded bytes).

    Without dictionary columns the stream is assembled from the schema message and each batch's
    message (what `ipc.new_stream` writes, byte for byte, at a third of its cost on small puts);
    with them, the stream writer adds the dictionary messages."""
    if not batches:
        raise ValueError("a data WAL entry needs at least one batch")
    schema = batches[0].schema.with_metadata(
        {GENERATION_KEY: str(generation).encode(), EPOCH_KEY: str(writer_epoch).encode()}
    )
    if not any(_has_dictionary(f.type) for f in schema):
        return memoryview(b"".join([schema.serialize(), *(b.serialize() for b in batches), _EOS]))
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
    return memoryview(sink.getvalue()).cast("B")


def encode_fence_sentinel(writer_epoch: int) -> bytes:
    """The fence sentinel a claiming writer writes at the first free position."""
    schema = pa.schema([]).with_metadata({SENTINEL_KEY: b"true", EPOCH_KEY: str(writer_epoch).encode()})
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, schema):
        pass
    return sink.getvalue().to_pybytes()


def _u64(value: bytes, what: str) -> int:
    """A decimal u64 as Lance writes it (`"7"`); int() alone would also take `" 7"`, `"1_0"`, `"-1"`."""
    if not _DECIMAL_RE.fullmatch(value) or int(value) > _U64_MAX:
        raise ValueError(f"invalid {what} {value!r}")
    return int(value)


def _stream_end(data: bytes) -> int:
    """The offset just past the last message of the IPC stream in `data`.

    The stream is complete only if exactly an end-of-stream marker follows it. Checking that `data`
    merely ends with the marker's bytes is not enough: a batch body can end with the same 8 bytes
    (32 set `_tombstone` bits, then padding), and a stream cut right after such a batch would pass
    for a whole entry holding fewer batches."""
    source = pa.BufferReader(pa.py_buffer(data))
    messages = ipc.MessageReader.open_stream(source)
    end = 0
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            break
        if message is None:
            break
        end = source.tell()
    return end


def decode_entry(data: Blob, position: int, path: str) -> WalEntry:
    """Decode one WAL entry; any malformation raises CorruptWalEntryError naming `path`."""
    data = data if isinstance(data, bytes) else bytes(data)

    def corrupt(why: str) -> CorruptWalEntryError:
        return CorruptWalEntryError(f"WAL entry {position} {why}", path)

    if not data.endswith(_EOS):
        raise corrupt("is truncated (no end-of-stream marker)")
    try:
        end = _stream_end(data)
        if data[end:] != _EOS:
            raise corrupt(
                "is truncated or has trailing bytes (no end-of-stream marker after the last message)"
            )
        reader = ipc.open_stream(pa.py_buffer(data))
        batches = tuple(reader)
        for b in batches:
            b.validate(full=True)
        schema = reader.schema
        meta = dict(schema.metadata or {})
        names = schema.names
        tombstone_type = schema.field(TOMBSTONE).type if TOMBSTONE in names else None
    except CorruptWalEntryError:
        raise
    except Exception as e:  # whatever pyarrow raises on malformed bytes (ArrowInvalid, UTF-8 errors ...)
        raise corrupt(f"cannot be decoded ({type(e).__name__}: {e})") from e
    if EPOCH_KEY not in meta:
        raise corrupt("has no writer_epoch")
    try:
        epoch = _u64(meta[EPOCH_KEY], "writer_epoch")
        generation = _u64(meta[GENERATION_KEY], "generation") if GENERATION_KEY in meta else None
    except ValueError as e:
        raise corrupt(f"has an {e}") from e
    if meta.get(SENTINEL_KEY) == b"true":
        if batches:
            raise corrupt("is a fence sentinel that carries data")
        return WalEntry(position, epoch, None, (), True)
    if tombstone_type is None:
        raise corrupt(f"has no {TOMBSTONE} column")
    if tombstone_type != pa.bool_():
        raise corrupt(f"has a {TOMBSTONE} column of type {tombstone_type}, not bool")
    if not batches:
        raise corrupt("holds no record batch (writers never write an empty data entry)")
    return WalEntry(position, epoch, generation, batches, False)


class Wal:
    """The WAL of one region on a storage backend."""

    def __init__(self, storage: Storage, region_id: uuid.UUID) -> None:
        self.storage = storage
        self.region_id = region_id

    def path(self, position: int) -> str:
        return layout.wal_path(self.region_id, position)

    def append(self, position: int, data: Blob) -> bool:
        """Publish an encoded entry at `position`; False when that position is already taken."""
        if position < 1:
            raise ValueError(f"WAL positions start at 1, got {position}")
        return self.storage.put_if_not_exists(self.path(position), data)

    def read(self, position: int) -> WalEntry | None:
        """The entry at `position`, or None if there is none."""
        path = self.path(position)
        try:
            data = self.storage.get(path)
        except NotFoundError:
            return None
        return decode_entry(data, position, path)

    def exists(self, position: int) -> bool:
        return self.storage.exists(self.path(position))

    def stored_positions(self) -> list[int]:
        """The positions of every entry file under the region's WAL directory, ascending (one
        listing; gaps included as they are)."""
        try:
            names = self.storage.list_dir(f"{layout.region_dir(self.region_id)}/{layout.WAL_DIR}")
        except NotFoundError:
            return []
        return sorted(p for n in names if n.endswith(".arrow") and (p := layout.parse_bitrev64_name(n)))

    def scan(self, start: int) -> Iterator[WalEntry]:
        """Entries from `start` upward, in order, until the first missing position."""
        position = start
        while (entry := self.read(position)) is not None:
            yield entry
            position += 1

    def has_data_after(self, position: int) -> bool:
        """Whether an entry with rows exists after `position` (sentinels and row-less entries, which a
        replay turns into nothing to flush, do not count)."""
        return any(e.num_rows for e in self.scan(position + 1))

    def last_position(self, start: int) -> int:
        """The highest existing position at or after `start` - 1, probing forward with HEAD requests."""
        position = start
        while self.exists(position):
            position += 1
        return position - 1
